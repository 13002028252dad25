"""The batched sampler: one step's logits rows -> one token per row, plus the logprobs, scores and
raw logits the rows' requests asked for.

Every row is a request's next position (`SampleRow`: its `SamplingState`, plus the drafted tokens
that precede the position when it verifies speculative tokens). One call processes all of a step's
rows together, in transformers' order:

    logit_bias -> repetition / presence / frequency penalties -> n-gram and bad-word bans ->
    min_new_tokens mask                                        (sparse index ops over all rows)
    greedy rows: argmax                                        (one call)
    sampling rows: temperature -> top-k -> top-p -> min-p -> inverse-CDF draw
        rows with top-k: one `topk(max k + 1)` over them; temperature, top-p and min-p then touch
            only those k values (the extra value detects ties at the k-th, which transformers keeps)
        rows without: temperature over the row; top-p from the 1024 (then 16384) most likely tokens
            when they decide it clearly, else a full sort (transformers' own order of operations)

Rows that share settings cost no per-row tensor work: per-row values travel as small tensors, and the
only per-row Python is gathering each request's (incrementally kept) penalty arrays and ban lists.

No processed value is +inf or NaN for finite raw logits: each step that can overflow fp32 (a bias
added, a penalty divided by, the temperature) clamps +inf to FP32_MAX right where it arises (on the
touched entries for the processors, on the divided rows for the temperature). In range nothing changes,
so the values stay transformers' own; out of range the overflowing tokens tie at the top (greedy takes
the first, sampling draws among them), where stock's softmax would turn the infinities into NaN. -inf
stays: it means "dropped". A caller's batch processor may return NaN, which stays too, as in stock:
greedy takes it (argmax), and a sampling row whose scores leave no token to draw (every one -inf, or a
NaN among them, where stock's `torch.multinomial` raises) is flagged (`SamplerOutput.is_invalid`).

The host waits for the device once per call, to read the tokens (with each row's flags):
per-row values go to the device through asynchronous copies (`host_to_device`), every token lands in
one device tensor, and nothing else is read back, except where the result itself is host data
(logprobs) or a rule needs a value to decide (a tie at the k-th value of top-k, whether the most
likely tokens already decide top-p's nucleus).

Owns the maths from logits to tokens; it knows nothing of blocks, caches or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..attention.metadata import host_to_device
from ..attention.workspace import Workspace
from ..sampling_params import FP32_MAX
from .sampling import SamplingState, uniform

# Top-p without top-k: the nucleus is read off the most likely tokens (1024, then 16384 for the rows
# still undecided) when their mass exceeds top_p and no kept/dropped decision lies within
# TOP_P_MARGIN of the threshold (so fp32 summation order cannot flip it); otherwise the row is
# sorted whole, as transformers does. topk(16384) over 152k tokens costs ~1/6 of a sort.
TOP_P_CANDIDATES = (1024, 16384)
TOP_P_MARGIN = 1e-4


@dataclass
class SampleRow:
    """One logits row to sample: the request's state, the tokens drafted before this position (a
    speculative verify row; empty otherwise), and, for a request with a `batch_processor`, its row in
    that processor's batch."""

    state: SamplingState
    extra: tuple[int, ...] = ()
    batch_row: int = 0

    @property
    def position(self) -> int:
        return self.state.position + len(self.extra)


class BatchProcessor(Protocol):
    """Logits processing over the rows of one batch that the engine samples in lockstep
    (`SamplingParams.batch_processor`; the drop-in `generate`'s `logits_processor` list).

    Called once per step with every live row of the batch, in the batch's row order: `rows[i]` is
    row i's index in the batch, `token_ids[i]` the engine's list of its tokens (prompt, then output:
    the same list object for as long as the row lives, still readable after it ends) with
    `num_prompt_tokens[i]` of them the prompt, and `scores[i]` its processed fp32 logits. Returns the
    new scores, the same shape. Whatever it raises ends every request of the batch with that error."""

    def __call__(self, rows: list[int], token_ids: list[list[int]], num_prompt_tokens: list[int],
                 scores: torch.Tensor) -> torch.Tensor:  # [len(rows), vocab] fp32 -> the same
        ...


class BatchProcessorError(Exception):
    """A batch processor raised `error`: every request of its batch ends with it."""

    def __init__(self, processor, error: BaseException):
        super().__init__(f"a batch processor raised {type(error).__name__}: {error}")
        self.processor = processor
        self.error = error


@dataclass
class TokenLogprobs:
    """Log-probabilities at one generated (or prompt) position.

    Attributes:
        token_id: the token taken there.
        logprob: its log-probability.
        rank: its rank in the distribution (1 = most likely).
        top: the `k` most likely `(token_id, logprob)` pairs, most likely first; only tokens the
            processors kept (fewer than k when top-k / top-p / min-p keep fewer).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SamplerOutput:
    """Per row: the token, and what its request asked for (None where it did not).

    `is_nan` (when the call checked): whether the row's raw logits held a NaN; its token is then
    meaningless (drawn from garbage, but a valid id) and the caller must not commit it.
    `is_invalid` (when the call sampled any row): whether a sampling row's processed scores leave no
    token to draw (every one -inf, or a NaN among them: stock's `torch.multinomial` raises there); its
    token is as meaningless. Greedy rows are never flagged: argmax takes the first NaN, or token 0 of a
    row all -inf, as stock's does."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    scores: list[torch.Tensor | None]  # [vocab] processed logits (-inf outside the kept tokens)
    logits: list[torch.Tensor | None]  # [vocab] raw logits
    is_nan: list[bool] | None = None
    is_invalid: list[bool] | None = None

    def slice(self, start: int, count: int) -> "SamplerOutput":
        end = start + count
        return SamplerOutput(self.token_ids[start:end], self.logprobs[start:end], self.scores[start:end],
                             self.logits[start:end], None if self.is_nan is None else self.is_nan[start:end],
                             None if self.is_invalid is None else self.is_invalid[start:end])


@dataclass
class _Block:
    """Processed distributions of some rows: `vals` [r, K] over token ids `ids` [r, K] (None: the
    whole vocabulary, K = vocab), -inf where a token is dropped."""

    rows: list[int]
    ids: torch.Tensor | None
    vals: torch.Tensor


class Sampler:
    """Samples a step's rows. Stateless: all request state lives in the rows' `SamplingState`s (it
    keeps only the scratch buffer of `take_rows`)."""

    def __init__(self):
        self._workspace = Workspace()
        self._grammar_masks = None  # `structured.grammar.GrammarMasks`, made for the first constrained row

    def _apply_grammars(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        """Mask the tokens each constrained row's grammar forbids (`SamplingParams.structured`)."""
        constrained = [(i, r.state.grammar, r.extra) for i, r in enumerate(rows) if r.state.grammar is not None]
        if constrained:
            if self._grammar_masks is None:
                from ..structured.grammar import GrammarMasks  # the `structured` extra
                self._grammar_masks = GrammarMasks()
            self._grammar_masks.apply(logits, constrained)

    def take_rows(self, logits: torch.Tensor, index: list[int]) -> torch.Tensor:
        """[len(index), vocab] copy of `logits` rows `index`, for `__call__` to overwrite, in a buffer
        reused from step to step: a fresh multi-megabyte CPU tensor each step page-faults on first
        touch, which at batch 64 cost several times the copy. Valid until the next call."""
        out = self._workspace.get("logits", (len(index), logits.shape[-1]), logits.dtype, logits.device)
        return torch.index_select(logits, 0, host_to_device(index, torch.long, logits.device), out=out)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], with_outputs: bool = True,
                 check_nan: bool = False) -> SamplerOutput:
        """Args:
            logits: [len(rows), vocab] raw logits, row i for rows[i]. Overwritten (fp32 logits are
                processed in place; pass a copy to keep them).
            with_outputs: compute the logprobs, scores and logits the rows' params ask for (a draft
                model's proposals need only tokens).
            check_nan: flag the rows whose raw logits hold a NaN (`SamplerOutput.is_nan`), read back
                with the tokens in the same device-to-host copy.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"need one logits row per sample row, got {tuple(logits.shape)} for {len(rows)} rows")
        for r in rows:
            r.state.sync()
        logits = logits.float()
        device = logits.device
        params = [r.state.params for r in rows]
        ks = [p.logprobs for p in params]
        raw_rows = [i for i, p in enumerate(params) if with_outputs and (p.output_logits or _logprobs_in(p, "raw"))]
        raw = logits.index_select(0, _index(raw_rows, device)) if raw_rows else None
        # max propagates NaN. A NaN row goes through the processors and the draw like any other (every
        # step of it is row-local and yields a valid id), and the caller drops its token.
        nan_rows = torch.isnan(logits.amax(dim=-1)) if check_nan else None  # [num_rows] bool
        self.process(logits, rows)
        if with_outputs:
            self._apply_grammars(logits, rows)
            _apply_batch_processors(logits, rows)
        num_rows = len(rows)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        sampling = [i for i, p in enumerate(params) if not p.is_greedy]
        blocks: list[_Block] = []
        invalid = None  # [num_rows] bool: sampling rows with no token to draw
        if not sampling:
            token_ids = logits.argmax(dim=-1)  # [num_rows] int64
            if with_outputs and any(params[i].output_scores or _logprobs_in(params[i], "processed") for i in greedy):
                blocks.append(_Block(greedy, None, logits))
        else:
            token_ids = torch.zeros(num_rows, dtype=torch.long, device=device)
            invalid = torch.zeros(num_rows, dtype=torch.bool, device=device)
            if greedy:
                g = logits.index_select(0, _index(greedy, device))
                token_ids.index_copy_(0, _index(greedy, device), g.argmax(dim=-1))
                if with_outputs and any(params[i].output_scores or _logprobs_in(params[i], "processed")
                                        for i in greedy):
                    blocks.append(_Block(greedy, None, g))
            for block in self.warp(logits, rows, sampling):
                drawn, empty = _draw(block, [rows[i].position for i in block.rows],
                                     [rows[i].state.seed for i in block.rows])
                token_ids.index_copy_(0, _index(block.rows, device), drawn)
                invalid.index_copy_(0, _index(block.rows, device), empty)
                if with_outputs:
                    blocks.append(block)
        # The call's one wait for the device: the tokens, and the flags in the same copy.
        flags = [f for f in (nan_rows, invalid) if f is not None]
        tokens, *read = torch.stack([token_ids, *(f.long() for f in flags)]).tolist()
        read = iter([bool(v) for v in values] for values in read)
        is_nan = None if nan_rows is None else next(read)
        is_invalid = None if invalid is None else next(read)
        out = SamplerOutput(tokens, [None] * num_rows, [None] * num_rows, [None] * num_rows, is_nan, is_invalid)
        if raw is not None:
            for j, i in enumerate(raw_rows):
                if params[i].output_logits:
                    out.logits[i] = raw[j]
            asks = [j for j, i in enumerate(raw_rows) if params[i].logprobs is not None]
            if asks:
                lp = _logprobs(_Block([raw_rows[j] for j in asks], None, raw[asks]), tokens, ks)
                for i, entry in lp.items():
                    out.logprobs[i] = entry
        for block in blocks:
            if any(params[i].output_scores for i in block.rows):
                dense = _dense(block, logits.shape[-1])
                for j, i in enumerate(block.rows):
                    if params[i].output_scores:
                        out.scores[i] = dense[j]
            asks = [j for j, i in enumerate(block.rows) if _logprobs_in(params[i], "processed")]
            if asks:
                sub = _Block([block.rows[j] for j in asks], None if block.ids is None else block.ids[asks],
                             block.vals[asks])
                for i, entry in _logprobs(sub, tokens, ks).items():
                    out.logprobs[i] = entry
        return out

    # ------------------------------------------------------------------ processors (in place)
    def process(self, logits: torch.Tensor, rows: list[SampleRow]) -> None:
        """Apply the logits processors (bias, penalties, bans, min_new_tokens) to `logits` in place."""
        device, vocab = logits.device, logits.shape[-1]
        bias_rows, bias_ids, bias_vals = [], [], []
        pen_rows, pen_ids, pen_counts, pen_params = [], [], [], []
        ban_rows, ban_ids = [], []
        for i, r in enumerate(rows):
            p = r.state.params
            if p.logit_bias:
                ids, vals = _bias_arrays(p)
                bias_rows.append(np.full(len(ids), i, dtype=np.int64))
                bias_ids.append(ids)
                bias_vals.append(vals)
            if p.has_penalties:
                ids, counts = r.state.penalty_arrays(r.extra)
                pen_rows.append(np.full(len(ids), i, dtype=np.int64))
                pen_ids.append(ids)
                pen_counts.append(counts)
                pen_params.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
            if p.bad_words_ids or p.no_repeat_ngram_size:
                banned = r.state.banned_tokens(r.extra)
                ban_rows.extend([i] * len(banned))
                ban_ids.extend(banned)
            if r.state.masks_end_tokens(len(r.extra)):
                ban_rows.extend([i] * len(r.state.end_token_ids))
                ban_ids.extend(r.state.end_token_ids)
        # Indices are filtered on the host, before the copy: a boolean mask on the device would have
        # a data-dependent size, which the host must wait to learn.
        if bias_rows:
            row_idx, tok_idx, vals = np.concatenate(bias_rows), np.concatenate(bias_ids), np.concatenate(bias_vals)
            keep = tok_idx < vocab  # a draft model's vocabulary may be smaller than the target's
            # (row, token) pairs are distinct (a dict's keys per row): gather, add, scatter back
            row_idx = host_to_device(row_idx[keep], torch.long, device)
            tok_idx = host_to_device(tok_idx[keep], torch.long, device)
            biased = logits[row_idx, tok_idx] + host_to_device(vals[keep], torch.float32, device)
            logits[row_idx, tok_idx] = biased.clamp_(max=FP32_MAX)
        if pen_rows:
            sizes = [len(a) for a in pen_ids]
            row_idx, tok_idx, counts = np.concatenate(pen_rows), np.concatenate(pen_ids), np.concatenate(pen_counts)
            keep = tok_idx < vocab  # an embedding vocabulary larger than the head's: nothing to penalise
            # [m, 3]: repetition, frequency, presence
            per_row = np.repeat(np.asarray(pen_params, dtype=np.float32), sizes, axis=0)
            row_idx = host_to_device(row_idx[keep], torch.long, device)
            tok_idx = host_to_device(tok_idx[keep], torch.long, device)
            counts = host_to_device(counts[keep], torch.float32, device)
            per_row = host_to_device(per_row[keep], torch.float32, device)
            score = logits[row_idx, tok_idx]
            rep = per_row[:, 0]
            score = torch.where(score < 0, score * rep, score / rep)
            score = score - per_row[:, 1] * counts - per_row[:, 2] * (counts > 0).float()
            logits[row_idx, tok_idx] = score.clamp_(max=FP32_MAX)
        if ban_rows:
            pairs = [(r, t) for r, t in zip(ban_rows, ban_ids) if t < vocab]
            if pairs:
                index = host_to_device(pairs, torch.long, device).T
                logits.index_put_((index[0], index[1]), torch.full((), float("-inf"), device=device))

    # ------------------------------------------------------------------ warpers -> blocks
    def warp(self, logits: torch.Tensor, rows: list[SampleRow], sampling: list[int]) -> list[_Block]:
        """The warped distributions (temperature, top-k, top-p, min-p) of the `sampling` rows."""
        vocab = logits.shape[-1]
        params = [rows[i].state.params for i in sampling]
        with_k = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
        without_k = [j for j, p in enumerate(params) if not 0 < p.top_k < vocab]
        blocks: list[_Block] = []
        if with_k:
            blocks.extend(self._warp_top_k(logits, [sampling[j] for j in with_k], [params[j] for j in with_k]))
        if without_k:
            blocks.extend(self._warp_full(logits, [sampling[j] for j in without_k], [params[j] for j in without_k]))
        return blocks

    def _warp_top_k(self, logits, idx: list[int], params) -> list[_Block]:
        device, vocab = logits.device, logits.shape[-1]
        ks = host_to_device([p.top_k for p in params], torch.long, device)
        width = min(max(p.top_k for p in params) + 1, vocab)
        temp = host_to_device([p.temperature for p in params], torch.float32, device)[:, None]
        x = logits.index_select(0, _index(idx, device)) if len(idx) < logits.shape[0] else logits
        vals, ids = torch.topk(x, width, dim=-1)  # sorted, most likely first
        # positive scaling: same order, and transformers' very values (clamped where they overflow)
        vals = (vals / temp).clamp_(max=FP32_MAX)
        pos = torch.arange(width, device=device)[None, :]
        kth = vals.gather(1, (ks - 1)[:, None])
        # The value after the k-th equals it: transformers keeps every tie at the k-th value.
        tied = (ks < width) & (vals.gather(1, ks.clamp(max=width - 1)[:, None])[:, 0] == kth[:, 0])
        vals = vals.masked_fill(pos >= ks[:, None], float("-inf"))
        blocks = []
        tied_rows = tied.nonzero().flatten().tolist()  # a wait for the device: which rows need a whole-row pass
        if tied_rows:
            keep = sorted(set(range(len(idx))) - set(tied_rows))
            for j in tied_rows:  # rare: the whole row, masked below the k-th value
                row = (x[j] / temp[j]).clamp_(max=FP32_MAX)
                row = row.masked_fill(row < kth[j], float("-inf"))
                blocks.append(_Block([idx[j]], None, self._top_p_min_p_dense(row[None], [params[j]])))
            if not keep:
                return blocks
            keep_index = _index(keep, device)
            vals, ids = vals.index_select(0, keep_index), ids.index_select(0, keep_index)
            idx, params = [idx[j] for j in keep], [params[j] for j in keep]
        vals = _top_p_sorted(vals, [p.top_p for p in params])
        vals = _min_p(vals, [p.min_p for p in params])
        blocks.append(_Block(idx, ids, vals))
        return blocks

    def _warp_full(self, logits, idx: list[int], params) -> list[_Block]:
        device, vocab = logits.device, logits.shape[-1]
        temp = host_to_device([p.temperature for p in params], torch.float32, device)[:, None]
        x = (logits.index_select(0, _index(idx, device)) if len(idx) < logits.shape[0] else logits) / temp
        x.clamp_(max=FP32_MAX)  # a temperature >= SAMPLING_EPS can still overflow a huge logit
        top_p = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if not top_p:
            return [_Block(idx, None, _min_p(x, [p.min_p for p in params]))]
        blocks = []
        plain = [j for j in range(len(idx)) if params[j].top_p >= 1.0]
        if plain:
            blocks.append(_Block([idx[j] for j in plain], None,
                                 _min_p(x.index_select(0, _index(plain, device)), [params[j].min_p for j in plain])))
        pending = top_p  # rows (indices into params) whose nucleus is still undecided
        for m in TOP_P_CANDIDATES:
            if not pending:
                break
            m = min(m, vocab)
            sub = x.index_select(0, _index(pending, device))
            ps = host_to_device([params[j].top_p for j in pending], torch.float64, device)
            cand_vals, cand_ids = torch.topk(sub, m, dim=-1)
            probs = torch.exp(cand_vals - sub.logsumexp(dim=-1, keepdim=True)).double()
            above = probs.cumsum(dim=-1) - probs  # mass strictly more likely than each candidate
            # Clear: the least likely candidate is already dropped (so is everything after it), and no
            # candidate sits within the margin of the threshold.
            clear = (above[:, -1] > ps + TOP_P_MARGIN) & ((above - ps[:, None]).abs() > TOP_P_MARGIN).all(dim=-1)
            clear = clear.tolist()  # a wait for the device: which rows the candidates decide
            fast = [r for r, ok in enumerate(clear) if ok]
            if fast:
                rows = _index(fast, device)
                vals = cand_vals.index_select(0, rows).masked_fill(
                    above.index_select(0, rows) >= ps.index_select(0, rows)[:, None], float("-inf"))
                vals = _min_p(vals, [params[pending[r]].min_p for r in fast])
                blocks.append(_Block([idx[pending[r]] for r in fast], cand_ids.index_select(0, rows), vals))
            pending = [pending[r] for r, ok in enumerate(clear) if not ok]
            if m == vocab:
                break
        if pending:  # still undecided: the whole row, as transformers sorts it
            rows = self._top_p_min_p_dense(x.index_select(0, _index(pending, device)), [params[j] for j in pending])
            blocks.append(_Block([idx[j] for j in pending], None, rows))
        return blocks

    @staticmethod
    def _top_p_min_p_dense(x: torch.Tensor, params) -> torch.Tensor:
        """transformers' TopPLogitsWarper then MinPLogitsWarper on whole rows ([r, vocab])."""
        ps = [p.top_p for p in params]
        if any(p < 1.0 for p in ps):
            sorted_vals, order = torch.sort(x, descending=False)
            cum = sorted_vals.softmax(dim=-1).cumsum(dim=-1)
            p = host_to_device(ps, x.dtype, x.device)[:, None]
            drop = (cum <= 1 - p) & (p < 1.0)
            drop[:, -1] = False  # the most likely token always stays
            x = x.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        return _min_p(x, [p.min_p for p in params])


# ---------------------------------------------------------------------- helpers
def _logprobs_in(params, mode: str) -> bool:
    """Whether the row's request wants logprobs under the `mode` ("processed" / "raw") distribution."""
    return params.logprobs is not None and params.logprobs_mode == mode


def _index(rows: list[int], device: torch.device) -> torch.Tensor:  # [len(rows)] int64
    return host_to_device(rows, torch.long, device)


def _bias_arrays(params) -> tuple[np.ndarray, np.ndarray]:
    bias = params.logit_bias
    return np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)), np.fromiter(
        bias.values(), dtype=np.float32, count=len(bias))


def _top_p_sorted(vals: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Top-p on values sorted most likely first ([r, K], -inf padded), as transformers decides it:
    ascending cumulative probability <= 1 - top_p is dropped; the most likely token stays."""
    if all(p >= 1.0 for p in ps):
        return vals
    p = host_to_device(ps, vals.dtype, vals.device)[:, None]
    cum = vals.flip(-1).softmax(dim=-1).cumsum(dim=-1).flip(-1)
    drop = (cum <= 1 - p) & (p < 1.0)
    drop[:, 0] = False
    return vals.masked_fill(drop, float("-inf"))


def _min_p(vals: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """transformers' MinPLogitsWarper: drop tokens whose probability is below min_p x the largest."""
    if all(m == 0 for m in min_ps):
        return vals
    m = host_to_device(min_ps, vals.dtype, vals.device)[:, None]
    probs = vals.softmax(dim=-1)
    drop = probs < m * probs.amax(dim=-1, keepdim=True)
    return vals.masked_fill(drop, float("-inf"))


def _draw(block: _Block, positions: list[int], seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw per row at u = uniform(seed, position), over the kept tokens in id order: the
    tokens ([r] int64) and whether each row had no token to draw ([r] bool: every value -inf, or a NaN
    among them, so its probabilities are NaN; its token is then meaningless), both on the device."""
    vals, ids = block.vals, block.ids
    if ids is not None:  # canonical (token id) order, so the draw does not depend on topk's tie order
        vocab_sentinel = torch.iinfo(torch.int64).max
        ids = ids.masked_fill(torch.isinf(vals), vocab_sentinel)
        ids, order = ids.sort(dim=-1)
        vals = vals.gather(1, order)
    probs = torch.softmax(vals, dim=-1)
    u = host_to_device([uniform(s, p) for s, p in zip(seeds, positions)], torch.float64, vals.device)
    j, total = _inverse_cdf(probs, u)
    empty = ~(total > 0)  # NaN or no mass: what stock's torch.multinomial refuses
    return (j if ids is None else ids.gather(1, j[:, None])[:, 0]), empty


CDF_CHUNK = 256


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `probs` ([r, K] fp32, rows summing to ~1), the index where the CDF first exceeds
    u * total (u: [r] fp64 in [0, 1)), and that total ([r] fp64, NaN for a row holding NaN). Two
    levels, so that no token's share is lost to fp32 rounding at large K without a float64 pass over
    the whole row: chunk masses (fp32 sums of CDF_CHUNK tokens, accumulated in fp64) pick the chunk,
    an fp64 cumsum inside it picks the token.

    Branch-free (no wait for the device): the rare fix-ups below are computed for every row and
    selected with `where`, over [r, num_chunks] and [r, CDF_CHUNK] only. A row holding NaN yields
    some index in range (its token is the caller's to discard)."""
    r, k = probs.shape
    size = next((c for c in (CDF_CHUNK, CDF_CHUNK // 2, CDF_CHUNK // 4) if k % c == 0), CDF_CHUNK)
    pad = -k % size  # a vocabulary that is a multiple of 64 needs no padded copy
    padded = torch.nn.functional.pad(probs, (0, pad)) if pad else probs
    chunks = padded.view(r, -1, size)
    sums = chunks.sum(dim=-1)  # [r, num_chunks]
    mass = sums.double().cumsum(dim=-1)
    x = u * mass[:, -1]
    c = torch.searchsorted(mass, x[:, None], right=True)[:, 0].clamp(max=mass.shape[-1] - 1)
    before = torch.where(c > 0, mass.gather(1, (c - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(x))
    rows = torch.arange(r, device=probs.device)
    chunk = chunks[rows, c]  # [r, size]
    j = torch.searchsorted(chunk.double().cumsum(dim=-1), (x - before)[:, None], right=True)[:, 0]
    # right=True lands on a token with probability > 0, unless rounding put the target at or past
    # the chunk's end: then the last token with any probability in the chunk is taken, or, if the
    # chunk has none, the last such token of the row (in its last chunk with any mass).
    cols = torch.arange(size, device=probs.device)
    last_in_chunk = torch.where(chunk > 0, cols, -1).amax(dim=-1)  # [r], -1: none
    last_chunk = torch.where(sums > 0, torch.arange(sums.shape[-1], device=probs.device), -1).amax(dim=-1)
    tail = chunks[rows, last_chunk.clamp(min=0)]  # [r, size]
    last_in_row = last_chunk * size + torch.where(tail > 0, cols, -1).amax(dim=-1)
    j = torch.where(j < size, j, last_in_chunk)
    j = torch.where(j >= 0, c * size + j, last_in_row)
    return j.clamp(0, k - 1), mass[:, -1]


def _dense(block: _Block, vocab: int) -> torch.Tensor:
    """The block's rows as [r, vocab] logits, -inf outside the kept tokens."""
    if block.ids is None:
        return block.vals.clone()
    out = torch.full((len(block.rows), vocab), float("-inf"), dtype=block.vals.dtype, device=block.vals.device)
    # A row's ids are distinct and its dropped ones hold -inf already: scattering every value is exact.
    return out.scatter_(1, block.ids, block.vals)


def _logprobs(block: _Block, tokens: list[int], ks: list[int | None]) -> dict[int, TokenLogprobs]:
    """Logprobs of each row's chosen token and its top `ks[row]`, under the block's distribution."""
    logp = torch.log_softmax(block.vals, dim=-1)
    ids = block.ids
    chosen = host_to_device([tokens[i] for i in block.rows], torch.long, logp.device)
    if ids is None:
        col = chosen[:, None]
    else:
        match = ids == chosen[:, None]
        col = match.int().argmax(dim=-1, keepdim=True)
        found = match.any(dim=-1)
    chosen_lp = logp.gather(1, col)[:, 0]
    if ids is not None:
        chosen_lp = torch.where(found, chosen_lp, torch.full_like(chosen_lp, float("-inf")))
    rank = (logp > chosen_lp[:, None]).sum(dim=-1) + 1
    kmax = max(ks[i] for i in block.rows)
    top_lp, top_col = (logp.topk(min(kmax, logp.shape[-1]), dim=-1) if kmax else (logp[:, :0], logp[:, :0].long()))
    top_ids = top_col if ids is None else ids.gather(1, top_col)
    chosen_lp, rank, top_lp, top_ids = chosen_lp.tolist(), rank.tolist(), top_lp.tolist(), top_ids.tolist()
    out = {}
    for j, i in enumerate(block.rows):
        k = ks[i]
        top = [(t, lp) for t, lp in zip(top_ids[j][:k], top_lp[j][:k]) if lp > float("-inf")]
        out[i] = TokenLogprobs(tokens[i], chosen_lp[j], rank[j], top)
    return out


def logprobs_of(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Per row of raw `logits` ([r, vocab]): the log-probability and rank of `token_ids[row]` and the
    `k` most likely tokens, under log_softmax of the row (prompt logprobs)."""
    block = _Block(list(range(len(token_ids))), None, logits.float())
    found = _logprobs(block, token_ids, [k] * len(token_ids))
    return [found[i] for i in range(len(token_ids))]


def processed_logits(row: torch.Tensor, state: SamplingState, extra: tuple[int, ...] = ()) -> torch.Tensor:
    """[vocab] logits after the request's processors and warpers, -inf outside the tokens they keep:
    what transformers' `LogitsProcessorList` returns for the same settings (a one-row `Sampler` call)."""
    state.sync()
    x = row.float().clone()[None]
    sampler = Sampler()
    rows = [SampleRow(state, tuple(extra))]
    sampler.process(x, rows)
    if state.params.is_greedy:
        return x[0]
    (block,) = sampler.warp(x, rows, [0])
    return _dense(block, x.shape[-1])[0]


def sample_processed(processed: torch.Tensor, state: SamplingState, extra: tuple[int, ...] = ()) -> int:
    """The token drawn from already processed logits ([vocab]) at `state`'s next position (after
    `extra`): argmax when greedy, else the inverse-CDF draw keyed by (seed, position)."""
    if state.params.is_greedy:
        return int(processed.argmax())
    token, _ = _draw(_Block([0], None, processed.float()[None]), [state.position + len(extra)], [state.seed])
    return int(token[0])


def _apply_batch_processors(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """Each batch processor of the rows, over its rows' logits (in batch-row order), in place."""
    batches: dict[int, tuple[object, list[int]]] = {}
    for i, r in enumerate(rows):
        processor = r.state.params.batch_processor
        if processor is not None:
            batches.setdefault(id(processor), (processor, []))[1].append(i)
    for processor, members in batches.values():
        members.sort(key=lambda i: rows[i].batch_row)
        index = _index(members, logits.device)
        states = [rows[i].state for i in members]
        try:
            out = processor([rows[i].batch_row for i in members], [st.token_ids for st in states],
                            [st.num_prompt_tokens for st in states], logits.index_select(0, index))
            if not torch.is_tensor(out) or tuple(out.shape) != (len(members), logits.shape[-1]):
                raise ValueError(f"a batch processor must return scores of shape {(len(members), logits.shape[-1])}, "
                                 f"got {tuple(out.shape) if torch.is_tensor(out) else type(out).__name__}")
        except Exception as exc:
            raise BatchProcessorError(processor, exc) from exc
        # +inf ties at the top (the module's rule); NaN and -inf stay, as in stock (see `SamplerOutput`)
        logits.index_copy_(0, index, out.to(device=logits.device, dtype=logits.dtype).clamp(max=FP32_MAX))
