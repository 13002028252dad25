"""`Engine`: continuous batching over a transformers model with a paged KV cache.

Each `step()` is

    schedule (core.scheduler) -> one StepMetadata -> one packed forward [1, num_tokens] with explicit
    positions and no padding (worker.runner) -> logits only where a request samples -> per-request
    sampling (worker.sampling) -> update

Requests join and leave at every step; long prompts are chunked; when blocks run out the newest
request is preempted and later recomputed (mostly from the prefix cache).

    engine = hf_paged.Engine(model, tokenizer)
    outputs = engine.generate(["Hello!", "Tell me a joke."], hf_paged.SamplingParams(max_new_tokens=64))
    for out in engine.stream("Once upon a time", hf_paged.SamplingParams(max_new_tokens=32)):
        print(out.text, end="")

This module owns the loop and the per-request state between steps; it never computes a slot or
an address (the scheduler and block manager do), never runs tensors beyond routing logits rows, and
leaves input checks (`inputs.py`), pool sizing (`kv_budget.py`), text (`outputs.py`) and metrics
(`metrics.py`) to their modules.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Iterator, Sequence as SequenceABC

import torch

from ..attention import ATTN_IMPLEMENTATION
from ..config import PagedCacheConfig
from ..core import Request, RequestStatus, ScheduledRequest, Scheduler, SchedulerOutput
from ..hf import PagedCache, check_model_supported, weights_fingerprint
from ..spec_decode import ProposalRequest, make_proposer, rejection_sample, target_distributions, verify_greedy
from ..worker import Chunk, ModelRunner
from ..worker.sampling import SamplingParams, SamplingState, make_generator, needs_processing, sample
from .inputs import as_params_list, as_prompt_list, as_token_id_list, model_eos_token_ids, prompt_token_ids
from .kv_budget import default_num_blocks
from .metrics import EngineMetrics, RequestMetrics
from .outputs import RequestOutput, StreamEvent, StreamText, decode_output, stop_string_cut

logger = logging.getLogger(__name__)


class _Tracked:
    """Engine-side state of one request: the scheduler's view plus sampling and output."""

    def __init__(self, request: Request, params: SamplingParams, generator, metrics: RequestMetrics):
        self.request = request
        self.params = params
        self.generator = generator
        self.metrics = metrics
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.draft_probs: torch.Tensor | None = None  # [k, vocab] q of this step's drafts (None: one-hot)

    @property
    def output_ids(self) -> list[int]:
        return self.request.token_ids[self.request.num_prompt_tokens:]


class Engine:
    """Continuous-batching generation for a transformers causal LM.

    Args:
        model: a decoder-only transformers model. It is switched to `attn_implementation="hf_paged"`
            if needed (forwards without the engine's metadata still run transformers' own sdpa).
        tokenizer: optional; needed for string prompts, `.text` and stop strings.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one forward (decodes plus prefill chunks).
        block_size, kv_cache_dtype, enable_prefix_caching, cache_salt: see `PagedCacheConfig`.
        num_blocks: fixed KV pool size in blocks. Default: from `max_kv_bytes`.
        max_kv_bytes: KV budget in bytes. Default: 2 GiB on CPU, half the free memory on CUDA, capped
            at what `max_num_seqs` full-length sequences need.
        max_model_len: longest sequence (prompt + output); default the model's max positions.
        show_progress: tqdm bar in `generate`; None = only when stderr is a terminal.
        draft_model: a smaller causal LM sharing the tokenizer: speculative decoding with it.
        speculative_method: "draft_model" (implied by `draft_model`), "ngram" (prompt lookup) or None.
        num_speculative_tokens: tokens drafted per step and request (default 5 when speculating, at
            at most `config.MAX_SPECULATIVE_TOKENS`); `SamplingParams.num_speculative_tokens` overrides it per request (0 = off).
        prompt_lookup_min, prompt_lookup_max: n-gram sizes the "ngram" proposer tries.
        eos_token_ids: end-of-sequence ids; default the model's generation config's (then its
            config's, then the tokenizer's).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_kv_bytes: int | None = None,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        cache_salt: str | None = None,
        max_model_len: int | None = None,
        show_progress: bool | None = None,
        draft_model: torch.nn.Module | None = None,
        speculative_method: str | None = None,
        num_speculative_tokens: int | None = None,
        prompt_lookup_min: int = 1,
        prompt_lookup_max: int = 3,
        eos_token_ids: int | SequenceABC[int] | None = None,
    ):
        check_model_supported(model.config)
        Scheduler.check_limits(max_num_seqs, max_num_batched_tokens)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.tokenizer = tokenizer
        text = model.config.get_text_config(decoder=True)
        self.max_model_len = max_model_len or getattr(text, "max_position_embeddings", None) or 1 << 30
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.device = next(model.parameters()).device
        self.show_progress = show_progress
        probe = PagedCacheConfig(block_size=block_size, num_blocks=num_blocks, max_kv_bytes=max_kv_bytes,
                                 kv_cache_dtype=kv_cache_dtype)  # validates the knobs before any sizing
        cache_config = PagedCacheConfig(
            block_size=block_size,
            num_blocks=num_blocks or default_num_blocks(model, probe, max_num_seqs, self.max_model_len, self.device),
            kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=enable_prefix_caching, cache_salt=cache_salt,
        )
        self.cache = PagedCache(model.config, cache_config)
        self.scheduler = Scheduler(self.cache.manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self.eos_token_ids = (model_eos_token_ids(model, tokenizer) if eos_token_ids is None
                              else as_token_id_list(eos_token_ids))
        self.runner = ModelRunner(model, self.cache)
        self.proposer, self.num_speculative_tokens = make_proposer(
            draft_model=draft_model, method=speculative_method, num_tokens=num_speculative_tokens,
            lookup_min=prompt_lookup_min, lookup_max=prompt_lookup_max, target_num_blocks=self.cache.pool.num_blocks,
            max_num_seqs=max_num_seqs, block_size=self.cache.block_size)
        self._requests: dict[str, _Tracked] = {}
        # Finished outputs kept for `generate`/`stream` calls that own the request (another caller's
        # step() may be the one that finishes it); requests added with add_request are not kept.
        self._watched: set[str] = set()
        self._finished_outputs: dict[str, RequestOutput] = {}
        self._ids = itertools.count()
        self._metrics = EngineMetrics()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | SequenceABC[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request and return its id.

        Args:
            prompt: a string (needs a tokenizer) or a list of token ids.
            sampling_params: defaults to `SamplingParams()` (greedy, 16 new tokens).
            request_id: unique among live requests; generated when omitted.

        Raises:
            ValueError/TypeError: naming what is wrong with this request; nothing is queued.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to the Engine")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._ids)}"
        elif request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        prompt_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within the model's "
                f"max_model_len={self.max_model_len}"
            )
        max_total = min(len(prompt_ids) + params.max_new_tokens, self.max_model_len)
        request = Request(request_id=request_id, token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids),
                          max_total_tokens=max_total, seq=self.cache.new_sequence())
        self.scheduler.add(request)  # raises if it can never fit the pool
        metrics = RequestMetrics(arrival_time=time.perf_counter(), num_prompt_tokens=len(prompt_ids))
        self._requests[request_id] = _Tracked(request, params, make_generator(params.seed, self.device), metrics)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its output so far (None if unknown)."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return None
        self._finish(tracked, "abort")
        return self._output(tracked)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns the requests that produced a token or finished in it."""
        self.cache.note_weights(weights_fingerprint(self.model))
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        self._metrics.peak_kv_blocks = max(self._metrics.peak_kv_blocks, self.cache.pool.num_used_blocks)
        for request in sched.preempted:
            self._requests[request.request_id].metrics.num_preemptions += 1
            if self.proposer is not None:
                self.proposer.free(request.request_id)
        self._metrics.num_preemptions += len(sched.preempted)
        if sched.is_empty:
            if self.scheduler.has_unfinished:
                raise RuntimeError(
                    "the scheduler could not schedule anything although requests are waiting; this is a bug "
                    f"(free blocks {self.cache.pool.num_free_blocks}/{self.cache.pool.num_blocks})"
                )
            return []
        now = time.perf_counter()
        self._note_admissions(sched, now)
        try:
            logits = self._forward(sched)
        except BaseException:
            self.cache.abandon_step()
            for entry in sched.scheduled:  # their new blocks hold no K/V: recompute them later
                if entry.request.status == RequestStatus.RUNNING:
                    self.scheduler.preempt(entry.request)
            raise
        # Logit rows: one per sampling request, k + 1 per request verifying k drafts.
        plain: list[tuple[ScheduledRequest, int]] = []
        speculative: list[tuple[ScheduledRequest, torch.Tensor]] = []
        row = 0
        for entry in sched.scheduled:
            if not entry.samples:
                continue
            n = 1 + len(entry.draft_token_ids)
            if entry.draft_token_ids:
                speculative.append((entry, logits[row : row + n]))
            else:
                plain.append((entry, row))
            row += n
        states = [self._sampling_state(self._requests[e.request.request_id]) for e, _ in plain]
        tokens = sample(logits[[r for _, r in plain]], states) if plain else []
        now = time.perf_counter()
        updated = []
        for (entry, _), token in zip(plain, tokens):
            tracked = self._requests[entry.request.request_id]
            self._append_token(tracked, token, now)
            updated.append(self._output(tracked))
        for entry, rows in speculative:
            tracked = self._requests[entry.request.request_id]
            self._commit_verified(tracked, entry, rows, now)
            updated.append(self._output(tracked))
        self._update_gauges(sched)
        return updated

    def _forward(self, sched: SchedulerOutput) -> torch.Tensor:  # [num logit rows, vocab]
        chunks = [Chunk(e.request.seq, e.start, e.token_ids, e.slots,
                        (1 + len(e.draft_token_ids)) if e.samples else 0) for e in sched.scheduled]
        logits = self.runner.forward(chunks, sched.copies)
        self._metrics.num_steps += 1
        self._metrics.iteration_tokens.append(sum(len(e.token_ids) for e in sched.scheduled))
        return logits

    # ------------------------------------------------------------------ speculative decoding
    def _num_drafts_for(self, tracked: _Tracked) -> int:
        request, params = tracked.request, tracked.params
        k = self.num_speculative_tokens if params.num_speculative_tokens is None else params.num_speculative_tokens
        # Never draft past what the request may still generate (the last token comes from the target).
        room = min(params.max_new_tokens - request.num_output_tokens, self.max_model_len - len(request.token_ids))
        return max(0, min(k, room - 1))

    def _propose(self) -> None:
        asks = []
        for request in self.scheduler.running:
            if request.num_pending_tokens != 1:
                continue  # still in prefill
            tracked = self._requests[request.request_id]
            k = self._num_drafts_for(tracked)
            if k > 0:
                asks.append(ProposalRequest(request.request_id, request.token_ids, k, self._sampling_state(tracked)))
        if not asks:
            return
        for ask, proposal in zip(asks, self.proposer.propose(asks)):
            tracked = self._requests[ask.request_id]
            drafts = proposal.token_ids[: ask.num_tokens]
            valid = next((i for i, t in enumerate(drafts) if not 0 <= t < self.vocab_size), len(drafts))
            tracked.request.spec_token_ids = drafts[:valid]  # a draft vocab may be larger than ours
            tracked.draft_probs = None if proposal.probs is None else _fit_vocab(proposal.probs[:valid], self.vocab_size)

    def _commit_verified(self, tracked: _Tracked, entry: ScheduledRequest, rows: torch.Tensor, now: float) -> None:
        """Verify `entry`'s drafts against the target's logits `rows` ([k + 1, vocab]), commit the
        accepted tokens plus one, and roll the cache back past the last accepted draft."""
        drafts = entry.draft_token_ids
        state = self._sampling_state(tracked)
        if state.params.is_greedy and not needs_processing(state):
            committed = verify_greedy(rows.argmax(dim=-1).tolist(), drafts)
        else:
            dist = target_distributions(rows[:, : self.vocab_size], state, drafts)
            if state.params.is_greedy:
                committed = verify_greedy(dist.argmax(dim=-1).tolist(), drafts)
            else:
                q = None if tracked.draft_probs is None else tracked.draft_probs[: len(drafts)]
                committed = rejection_sample(dist, q, drafts, tracked.generator)
        accepted = len(committed) - 1
        self._metrics.on_verification(len(drafts), accepted)
        request = tracked.request
        for token in committed:
            self._append_token(tracked, token, now)
            if tracked.finish_reason is not None:
                return  # finished (its blocks are already freed)
        self.scheduler.rollback(request, len(drafts) - accepted)

    def _note_admissions(self, sched: SchedulerOutput, now: float) -> None:
        self._metrics.prefix_cache_queries += sched.num_prefix_query_tokens
        self._metrics.prefix_cache_hits += sched.num_prefix_hit_tokens
        for entry in sched.scheduled:
            tracked = self._requests[entry.request.request_id]
            request = entry.request
            if tracked.metrics.first_scheduled_time is None:
                tracked.metrics.first_scheduled_time = now
            tracked.metrics.num_cached_tokens = request.num_cached_tokens
            # Prompt tokens actually computed (outputs recomputed after a preemption count as prompt work).
            computed_prompt = max(0, min(entry.start + len(entry.token_ids), request.num_prompt_tokens) - entry.start)
            self._metrics.prompt_tokens += computed_prompt

    def _sampling_state(self, tracked: _Tracked) -> SamplingState:
        params = tracked.params
        end_ids = ([] if params.ignore_eos else list(self.eos_token_ids)) + list(params.stop_token_ids)
        return SamplingState(params=params, generator=tracked.generator, token_ids=tracked.request.token_ids,
                             num_output_tokens=tracked.request.num_output_tokens, end_token_ids=end_ids)

    def _append_token(self, tracked: _Tracked, token: int, now: float) -> None:
        request, params = tracked.request, tracked.params
        request.token_ids.append(token)
        tracked.metrics.on_token(now)
        self._metrics.generation_tokens += 1
        num_out = request.num_output_tokens
        reason = None
        if num_out >= params.min_new_tokens and (
            token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        ):
            reason = "stop"
        elif params.stop_strings and num_out >= params.min_new_tokens and self._hit_stop_string(tracked):
            reason = "stop"
        elif num_out >= params.max_new_tokens or len(request.token_ids) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self._finish(tracked, reason)

    def _hit_stop_string(self, tracked: _Tracked) -> bool:
        text = self._decode(tracked)
        cut = stop_string_cut(text, tracked.params.stop_strings)
        if cut is not None:
            tracked.text = text[:cut]
        return cut is not None

    def _decode(self, tracked: _Tracked) -> str:
        return decode_output(self.tokenizer, tracked.output_ids, tracked.params.skip_special_tokens)

    def _finish(self, tracked: _Tracked, reason: str) -> None:
        if tracked.finish_reason is not None:
            return
        self.scheduler.finish(tracked.request)
        if self.proposer is not None:
            self.proposer.free(tracked.request.request_id)
        tracked.finish_reason = reason
        tracked.metrics.finished_time = time.perf_counter()
        if tracked.text is None and self.tokenizer is not None:
            tracked.text = self._decode(tracked)
        self._metrics.on_finished(tracked.metrics, reason)
        del self._requests[tracked.request.request_id]
        if tracked.request.request_id in self._watched:
            self._finished_outputs[tracked.request.request_id] = self._output(tracked)

    def _output(self, tracked: _Tracked) -> RequestOutput:
        request = tracked.request
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.token_ids[: request.num_prompt_tokens],
            token_ids=list(tracked.output_ids),
            text=tracked.text,  # set once finished; streaming decodes its own deltas
            finish_reason=tracked.finish_reason,
            metrics=tracked.metrics,
        )

    def _update_gauges(self, sched: SchedulerOutput) -> None:
        m, pool = self._metrics, self.cache.pool
        m.num_requests_running = len(self.scheduler.running)
        m.num_requests_waiting = len(self.scheduler.waiting)
        m.kv_cache_usage_perc = pool.num_used_blocks / max(pool.num_blocks, 1)

    # ------------------------------------------------------------------ batch API
    def generate(
        self,
        prompts: str | SequenceABC[int] | SequenceABC[str | SequenceABC[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one `RequestOutput` per prompt, in input order.

        A prompt that is rejected (empty, too long, out-of-vocabulary ids, bad sampling params) gets an
        output with `finish_reason="error"` and `.error` set; the others still run.
        """
        prompts = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(prompts))
        ids: list[str | None] = []
        results: dict[int, RequestOutput] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                ids.append(self.add_request(prompt, p))
            except (ValueError, TypeError) as exc:
                logger.warning("hf_paged: request %d rejected: %s", i, exc)
                ids.append(None)
                prompt_ids = list(prompt) if not isinstance(prompt, str) else []
                results[i] = RequestOutput(request_id=f"rejected-{i}", prompt_token_ids=prompt_ids,
                                           finish_reason="error", error=exc)
        live = {rid: i for i, rid in enumerate(ids) if rid is not None}
        self._watched.update(live)
        bar = self._progress_bar(len(live), use_tqdm)
        try:
            while any(rid in self._requests for rid in live):
                for out in self.step():
                    if out.finished and out.request_id in live and bar is not None:
                        bar.update(1)
        except BaseException:
            for rid in live:
                self.abort(rid)
            raise
        finally:
            self._watched.difference_update(live)
            if bar is not None:
                bar.close()
        for rid, i in live.items():
            results[i] = self._finished_outputs.pop(rid)
        return [results[i] for i in range(len(prompts))]

    def stream(
        self,
        prompts: str | SequenceABC[int] | SequenceABC[str | SequenceABC[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> Iterator[StreamEvent]:
        """Yield each token as it is produced, in order per request, for one prompt or many.

        Invalid prompts raise before anything runs. Closing the iterator early aborts the requests
        it started (their blocks are freed)."""
        prompts = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(prompts))
        live: dict[str, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                live[self.add_request(prompt, p)] = i
            self._watched.update(live)
            texts = StreamText(self.tokenizer)
            while any(rid in self._requests for rid in live):
                for out in self.step():
                    if out.request_id not in live:
                        continue
                    yield StreamEvent(request_id=out.request_id, index=live[out.request_id],
                                      token_id=out.token_ids[-1], text=texts.delta(out),
                                      finish_reason=out.finish_reason)
        finally:
            for rid in live:
                if rid in self._requests:
                    self.abort(rid)
                self._finished_outputs.pop(rid, None)
            self._watched.difference_update(live)

    def _progress_bar(self, total: int, use_tqdm: bool | None):
        show = use_tqdm if use_tqdm is not None else self.show_progress
        if show is None:
            show = sys.stderr.isatty() and total > 1
        if not show:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="hf_paged", unit="req")

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        """Engine-wide metrics keyed by vLLM's names (see `hf_paged.metrics.EngineMetrics.as_dict`),
        plus the KV pool: `kv_block_size`, `kv_num_blocks`, `kv_bytes_per_block` and the peak in use
        (`kv_peak_blocks`, `kv_peak_bytes`)."""
        self._update_gauges(None)
        bytes_per_block = self.cache.bytes_per_block(next(self.model.parameters()).dtype)
        return {**self._metrics.as_dict(), "kv_block_size": self.cache.block_size,
                "kv_num_blocks": self.cache.pool.num_blocks, "kv_bytes_per_block": bytes_per_block,
                "kv_peak_blocks": self._metrics.peak_kv_blocks,
                "kv_peak_bytes": self._metrics.peak_kv_blocks * bytes_per_block}

    def metrics_summary(self) -> str:
        self._update_gauges(None)
        return self._metrics.summary()

    def reset_metrics(self) -> None:
        self._metrics.reset()


def _fit_vocab(probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft distributions over the target's vocabulary (a draft may pad its vocabulary differently)."""
    if probs.shape[-1] == vocab_size:
        return probs
    if probs.shape[-1] > vocab_size:
        return probs[:, :vocab_size]
    return torch.nn.functional.pad(probs, (0, vocab_size - probs.shape[-1]))
