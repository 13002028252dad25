"""Per-request sampling: `SamplingParams` (HF's field names) and the sampler that turns one step's
logits into one token per request.

Random draws are counter-based: the token at sequence position `pos` is the Gumbel-max sample
`argmax(processed_logits + G)`, with noise `G` drawn from a generator keyed by `(seed, pos)` alone
(`token_noise`). So a request's tokens depend only on its seed and its own logits: not on its batch
mates, not on how many speculative tokens it was given (verification compares drafts with this very
sample), and a step that is retried draws the same numbers again. Gumbel-max sampling is exact: the
token is distributed as `softmax(processed_logits)`. The seed is `SamplingParams.seed`, or drawn from
torch's global RNG when unset (`draw_seed`, so `torch.manual_seed` makes unseeded runs reproducible).

The processing order is transformers' own: repetition penalty, then `min_new_tokens` (end-of-sequence
tokens masked), then temperature, top-k and top-p.

Owns the maths from logits to tokens; it knows nothing of blocks, caches or scheduling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..config import MAX_SPECULATIVE_TOKENS


@dataclass
class SamplingParams:
    """How one request generates. Field names follow transformers' `GenerationConfig`.

    Args:
        max_new_tokens: most tokens to generate (> 0).
        min_new_tokens: end-of-sequence and `stop_token_ids` are masked until this many were generated.
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens (0 disables).
        top_p: nucleus sampling; keep the smallest set of tokens whose probability reaches top_p (1 disables).
        seed: keys this request's random draws (with each token's position); None draws a seed from
            torch's global RNG when the request is added.
        stop_token_ids: extra token ids that end the request (the token is kept in the output).
        stop: strings that end the request once the decoded text contains one (needs a tokenizer);
            the text is cut before the stop string.
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        repetition_penalty: transformers' CTRL-style penalty on tokens already in prompt or output (1 disables).
        skip_special_tokens: drop special tokens when decoding `.text`.
        num_speculative_tokens: tokens drafted per step for this request when the engine speculates
            (None: the engine's setting; 0: no speculation for this request).

    Values are checked by `validate()`, which the engine calls when a request is added, so one bad
    request is reported on its own instead of failing a whole batch.
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    num_speculative_tokens: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def validate(self) -> None:
        """Raise ValueError/TypeError naming the first bad field."""
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens!r}"
            )
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) or not (
            math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        if self.stop is not None and not (
            isinstance(self.stop, str) or (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop))
        ):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        if self.num_speculative_tokens is not None and (
            not is_int(self.num_speculative_tokens) or not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS
        ):
            raise ValueError(f"num_speculative_tokens must be None or an integer in [0, {MAX_SPECULATIVE_TOKENS}], got "
                             f"{self.num_speculative_tokens!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not (
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0
        ):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")


@dataclass
class SamplingState:
    """What the sampler needs of one request: its params, seed, tokens so far and end ids.

    The next token sampled is at sequence position `len(token_ids)`; its noise is keyed by
    `(seed, len(token_ids))`."""

    params: SamplingParams
    seed: int
    token_ids: list[int]  # prompt + outputs, for the repetition penalty
    num_output_tokens: int
    end_token_ids: list[int]  # eos (unless ignore_eos) + stop_token_ids, masked before min_new_tokens

    @property
    def position(self) -> int:
        return len(self.token_ids)

    def extended(self, tokens: list[int]) -> "SamplingState":
        """The state after `tokens` were generated (speculative positions see their drafted history)."""
        if not tokens:
            return self
        return SamplingState(params=self.params, seed=self.seed, token_ids=self.token_ids + list(tokens),
                             num_output_tokens=self.num_output_tokens + len(tokens),
                             end_token_ids=self.end_token_ids)


def draw_seed(seed: int | None) -> int:
    """A request's seed: its own, or one drawn from torch's global RNG (so `torch.manual_seed`
    makes unseeded runs reproducible too)."""
    return int(torch.randint(0, 2**62, (1,)).item()) if seed is None else int(seed)


_MASK64 = (1 << 64) - 1


def _as_int64(value: int) -> int:
    """A 64-bit pattern as the signed int64 torch stores it."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)


def _noise_key(seed: int, position: int) -> int:
    """One 64-bit key per (seed, position); splitmix64 on the host."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return _as_int64(x ^ (x >> 31))


def _mix(x: torch.Tensor) -> torch.Tensor:  # int64, element-wise splitmix64 finaliser
    # int64 products wrap modulo 2**64; `>>` is arithmetic, so each shift is masked to be logical.
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def token_noise(seed: int, position: int, token_ids: torch.Tensor) -> torch.Tensor:  # [n] fp32
    """Gumbel noise for `token_ids` (int64 [n]) at `position` of a request seeded `seed`: a pure
    function of (seed, position, token id), computed by a counter-based hash, so any subset of the
    vocabulary (a top-k support, a draft's vocabulary) gets the same noise per token, on any device."""
    x = _mix(token_ids.to(torch.int64) * _GOLDEN + _noise_key(seed, position))
    u = ((x >> 11) & ((1 << 53) - 1)).to(torch.float64) * 2.0**-53  # uniform on [0, 1)
    exponential = -torch.log1p(-u)
    return (-torch.log(exponential.clamp_min(1e-300))).float()


def sample_processed(processed: torch.Tensor, state: SamplingState) -> int:
    """The token for `state`'s next position from its processed logits ([vocab]): argmax when greedy,
    else the Gumbel-max sample keyed by (seed, position), over the tokens still allowed."""
    if state.params.is_greedy:
        return int(processed.argmax())
    allowed = (processed > float("-inf")).nonzero().flatten()
    scores = processed[allowed] + token_noise(state.seed, state.position, allowed)
    return int(allowed[scores.argmax()])


def sample(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    """One token per row.

    Args:
        logits: [num_rows, vocab_size] raw next-token logits, one row per state.
        states: per row, its `SamplingState`.
    """
    logits = logits.float()
    out: list[int | None] = [None] * len(states)
    plain = [i for i, s in enumerate(states) if s.params.is_greedy and not needs_processing(s)]
    if plain:
        for i, tok in zip(plain, logits[plain].argmax(dim=-1).tolist()):
            out[i] = tok
    for i, state in enumerate(states):
        if out[i] is None:
            out[i] = _sample_row(logits[i], state)
    return out  # type: ignore[return-value]


def needs_processing(state: SamplingState) -> bool:
    """Whether the raw logits' argmax may differ from the processed one (penalty, min_new_tokens)."""
    p = state.params
    return p.repetition_penalty != 1.0 or (state.num_output_tokens < p.min_new_tokens and bool(state.end_token_ids))


def processed_support(row: torch.Tensor, state: SamplingState) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The request's processors applied to one row of raw logits ([vocab]), in transformers' order:
    repetition penalty, `min_new_tokens` mask, then (when sampling) temperature, top-k and top-p.

    Returns:
        `(token_ids, logits)`: the tokens still allowed ([n] int64; None = the whole vocabulary) and
        their processed logits ([n] fp32). Top-k and top-p keep exactly the tokens transformers'
        warpers keep (ties at the k-th value included) but never build a full masked row.
    """
    p = state.params
    penalise = p.repetition_penalty != 1.0 and bool(state.token_ids)
    mask_end = state.num_output_tokens < p.min_new_tokens and bool(state.end_token_ids)
    row = row.float().clone() if penalise or mask_end else row.float()  # never write into the logits
    if penalise:
        ids = torch.tensor(sorted(set(state.token_ids)), device=row.device)
        score = row[ids]
        row[ids] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
    if mask_end:
        row[torch.tensor(state.end_token_ids, device=row.device)] = float("-inf")
    if p.is_greedy:
        return None, row
    row = row / p.temperature
    token_ids = None
    if p.top_k and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        token_ids = (row >= kth).nonzero().flatten()
        row = row[token_ids]
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        keep = cum > (1 - p.top_p)
        keep[-1] = True  # always keep the most likely token
        kept = order[keep]
        token_ids = kept if token_ids is None else token_ids[kept]
        row = sorted_logits[keep]
    return token_ids, row


def processed_logits(row: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """[vocab] logits after the request's processors (see `processed_support`), -inf outside the
    tokens they keep: what transformers' processors and warpers return."""
    token_ids, logits = processed_support(row, state)
    if token_ids is None:
        return logits if logits.data_ptr() != row.data_ptr() else logits.clone()
    out = torch.full(row.shape, float("-inf"), device=row.device)
    out[token_ids] = logits
    return out


def _sample_row(row: torch.Tensor, state: SamplingState) -> int:
    token_ids, logits = processed_support(row, state)
    if state.params.is_greedy:
        return int(logits.argmax())
    if token_ids is None:
        return sample_processed(logits, state)
    # -inf can remain inside a top-k support only through min_new_tokens masks; they lose any argmax.
    return int(token_ids[(logits + token_noise(state.seed, state.position, token_ids)).argmax()])
