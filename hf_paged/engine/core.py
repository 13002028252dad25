"""`EngineCore`: one step of continuous batching, and the requests it runs.

    step = schedule (core.scheduler, drafts first) -> execute (executor.py: one packed forward)
           -> sample (one batched sampler call over every row) -> update (commit tokens, finish)

It owns the scheduler, the executor, the KV owner (`hf.KVOwner`), the sampler, the drafter
(`drafting.py`), the lockstep of batch processors' rows (`lockstep.py`) and the registry of live
requests. It knows no text and no tokenizer: text, stop strings, events and outputs are the output processor's (`output_processor.py`), called at fixed points of `update`.
A step either commits or leaves no trace: a failure before the forward wrote the K/V requeues the
step's requests; one after it rolls back the request it concerns alone.

Single-threaded: the `Engine` front calls it under its lock.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch

from ..attention import UnsupportedModelError
from ..core import KVSequence, Request, RequestStatus, ScheduledRequest, Scheduler, SchedulerOutput
from ..hf import KVOwner
from ..sampling_params import SamplingParams
from ..spec_decode import verify_greedy
from ..worker import Chunk
from ..worker.sampler import BatchProcessorError, SampleRow, Sampler, SamplerOutput
from ..worker.sampling import SamplingState, sample_seed
from .executor import Executor, ExecutorLostError, ExecutorStep
from .drafting import Drafter
from .images import ImageQueue
from .lockstep import Lockstep
from .metrics import EngineMetrics, RequestMetrics, kv_cache_usage
from .output_processor import OutputProcessor
from .outputs import RequestOutput, StreamEvent
from .tracked import RequestGroup, TrackedRequest

logger = logging.getLogger(__name__)

# A request whose steps raise this many times ends with finish_reason="error" (a transient failure
# is retried: the step is undone and the request recomputed); so does every unfinished request when
# this many steps in a row fail before any request could be blamed (scheduling).
MAX_STEP_FAILURES = 3
_FATAL = (UnsupportedModelError, ExecutorLostError)  # a step failing so fails every retry: its requests end at once


class RequestError(ValueError):
    """A failure that belongs to one request and will not go away on a retry (NaN logits)."""


class InvalidDistributionError(RequestError, RuntimeError):
    """A sampling request's processed scores leave no token to draw: every one -inf, or a NaN among
    them (its logits processors made them so). A RuntimeError too, as stock's `torch.multinomial`
    raises there; the drop-in `generate` raises it."""


def _check_sampleable(request_id: str, is_invalid: list[bool] | None, num_rows: int) -> None:
    """Raise `InvalidDistributionError` if any of a request's first `num_rows` sampled rows (the ones its
    committed tokens come from; `SamplerOutput.is_invalid`) had no token to draw."""
    if is_invalid is not None and any(is_invalid[:num_rows]):
        raise InvalidDistributionError(
            f"request {request_id!r} has no token to sample: its processed scores are all -inf or hold a NaN "
            "(stock's sampling raises too: the probability tensor contains inf, nan or an element < 0); check "
            "its logits processors")


def _take_prefix(kv: KVOwner, request: Request, prefix: KVSequence) -> None:
    """Start `request` from its kept `prefix` if `kv` still holds it: admission starts after its tokens
    (`Scheduler.schedule`). Where the rope follows the length (`core.rope`), the prompt continues the
    prefix's rotary history, which a prefix whose blocks are lost (`ReturnedCache`) still carries."""
    if kv.take(prefix):
        prefix.rope = request.seq.rope and request.seq.rope.continuing(prefix.rope, prefix.num_tokens,
                                                                       request.num_prompt_tokens)
        request.seq = prefix
    elif prefix.rope is not None and request.seq.rope is not None:
        request.seq.rope = prefix.rope


class EngineCore:
    """Schedules, executes, samples and updates the engine's requests, one step at a time.

    Args:
        scheduler, executor: the scheduler over `kv`'s block manager; what runs a step (`executor.Executor`).
        kv: the KV owner of the target model's cache.
        outputs: text, events and outputs of the requests.
        proposer, num_speculative_tokens: speculative decoding (`spec_decode.make_proposer`), or None.
        eos_token_ids, max_model_len, vocab_size: the model's.
        fingerprint: reads the weights fingerprint (`hf.weights_fingerprint`), checked before admitting.
    """

    def __init__(self, scheduler: Scheduler, executor: Executor, kv: KVOwner, outputs: OutputProcessor, *,
                 proposer, num_speculative_tokens: int, eos_token_ids: list[int], max_model_len: int,
                 vocab_size: int, fingerprint: Callable[[], object]):
        self.scheduler = scheduler
        self.executor = executor
        self.kv = kv
        self.outputs = outputs
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.fingerprint = fingerprint
        self.metrics = EngineMetrics()
        self.drafter = Drafter(proposer, num_speculative_tokens, vocab_size=vocab_size, metrics=self.metrics)
        self.requests: dict[str, TrackedRequest] = {}  # live requests (and samples), registered before queued
        self.groups: dict[str, RequestGroup] = {}  # live requests by the id the caller knows
        self.finished_groups: dict[str, RequestGroup] = {}  # retain_kv requests until `kept_kv` collects
        self.registry_lock = threading.Lock()  # the two dicts above: submitters never wait for a step
        self._ids = itertools.count()
        # Requests the step advanced (by the id the caller knows), their outputs built once at its end.
        self._updates: dict[str, TrackedRequest] = {}
        self._consecutive_failed_steps = 0
        self.images = ImageQueue(executor, lambda: scheduler.max_num_batched_tokens, self.metrics, self.fail)
        self.lockstep = Lockstep()  # batch processors' rows sample together

    # ------------------------------------------------------------------ the step
    def step(self) -> list[TrackedRequest]:
        """Run one step; returns the requests that produced a token or finished in it (with those of a
        failed step before it). Raises what undid the step: its requests retry or end with an error."""
        self.images.place()  # before scheduling: their blocks are hashed with their images' digests
        sched = self._schedule()
        if sched is None:
            return self._take_updates()
        try:
            work = self._executor_step(sched)
            logits = self.executor.execute(work)
        except Exception as exc:
            self._requeue([e.request for e in sched.scheduled], exc, "forward")
            raise
        self._note_forward(sched)
        self._update(sched, logits, self._sample(sched, work, logits))
        return self._take_updates()

    def _take_updates(self) -> list[TrackedRequest]:
        updates, self._updates = self._updates, {}
        return list(updates.values())

    def _schedule(self) -> SchedulerOutput | None:
        """The step's plan (drafts proposed first); None when nothing runs. Raises what undid it."""
        try:
            began = time.perf_counter()
            # Prefix-cache lookups happen only when admitting, and nothing is admitted while every slot
            # runs (the fingerprint reads a checksum from the device: no step pays for it in vain).
            if self.scheduler.waiting and len(self.scheduler.running) < self.scheduler.max_num_seqs:
                self.note_weights()
            self.drafter.propose(self.scheduler.running, self.requests, self.max_model_len)
            sched = self.scheduler.schedule()
            self.metrics.schedule_seconds += time.perf_counter() - began
            self.metrics.peak_kv_blocks = max(self.metrics.peak_kv_blocks, self.kv.num_used_blocks)
            self.metrics.peak_num_running = max(self.metrics.peak_num_running, len(self.scheduler.running))
            for request in sched.preempted:
                self._note_preempted(self.requests[request.request_id])
            self.metrics.num_rope_recomputes += len(sched.rope_restarted)  # longrope's long factors (`core.rope`)
            if sched.is_empty and self.scheduler.has_unfinished and (self.kv.evict_kept()
                                                                     or self.scheduler.release_waiting()):
                # Returned caches, or waiting requests' handed-over prefixes, held the blocks the queue
                # needs: they are recomputed instead (mostly from the prefix cache).
                sched = self.scheduler.schedule()
            if sched.is_empty:
                if self.scheduler.has_unfinished:
                    raise RuntimeError(
                        "the scheduler could not schedule anything although requests are waiting "
                        f"(free blocks {self.kv.num_free_blocks}/{self.kv.num_blocks})"
                    )
                return None
            self._note_admissions(sched, time.perf_counter())
            return sched
        except Exception as exc:  # scheduling or the bookkeeping around it
            self._on_failed_schedule(exc)
            raise

    def _num_logits(self, entry: ScheduledRequest) -> int:
        """Logits rows the entry needs: every position while its request wants prompt logprobs and the
        chunk holds prompt tokens, else its last 1 + drafts positions when it samples, else none."""
        if self.requests[entry.request.request_id].params.prompt_logprobs is not None and (
                entry.start < entry.request.num_prompt_tokens - 1):
            return len(entry.token_ids)
        return (1 + len(entry.draft_token_ids)) if entry.samples else 0

    def _executor_step(self, sched: SchedulerOutput) -> ExecutorStep:
        chunks = [Chunk(e.request.seq, e.start, e.token_ids, e.group_slots, self._num_logits(e),
                        self.requests[e.request.request_id].image_features) for e in sched.scheduled]
        self._forward_began = time.perf_counter()
        return ExecutorStep(chunks, sched.copies, sched.new_full_blocks)

    def _note_forward(self, sched: SchedulerOutput) -> None:
        self._consecutive_failed_steps = 0
        m = self.metrics
        m.forward_seconds += time.perf_counter() - self._forward_began
        m.metadata_seconds += self.executor.last_times.metadata_seconds
        m.model_seconds += self.executor.last_times.model_seconds
        m.num_steps += 1
        num_tokens = sum(len(e.token_ids) for e in sched.scheduled)
        m.iteration_tokens.append(num_tokens)
        m.num_forward_tokens += num_tokens

    # ------------------------------------------------------------------ sample
    def _sample(self, sched: SchedulerOutput, work: ExecutorStep, logits: torch.Tensor) -> "_StepSamples":
        """Every sampling row of the step (each request's next position, each verified draft position,
        each of a request's n first samples) through one sampler call; None as the result if that
        call raises (each request is then sampled alone in `_update`). `work`: the step's forward,
        whose chunks (one per scheduled entry, in order) say how many logits rows each entry has."""
        plans, rows, index, row = [], [], [], 0
        deferred = self._lockstep_deferred(sched, work)
        for entry, chunk in zip(sched.scheduled, work.chunks):
            n = chunk.num_logits
            if not n:
                continue
            if (rid := entry.request.request_id) in deferred:  # its batch samples together, in a later step
                if rid in self.requests and self.scheduler.rollback(entry.request, 1):  # (not ended meanwhile)
                    self._note_preempted(self.requests[rid])  # a recurrent state without a snapshot: recomputed
                row += n
                continue
            tracked = self.requests[entry.request.request_id]
            first_sample = row + n - 1 - len(entry.draft_token_ids)
            num_rows = 0
            if entry.samples:
                group = tracked.group
                states = [tracked.state] + ([self._fork_state(tracked, j) for j in range(1, group.n)]
                                            if not group.forked else [])
                drafts = entry.draft_token_ids
                first_row = tracked.index * group.n + (tracked.sample_index if group.forked else 0)
                for j in range(len(drafts) + 1):
                    for k, state in enumerate(states):
                        rows.append(SampleRow(state, tuple(drafts[:j]), first_row + k))
                        index.append(first_sample + j)
                        num_rows += 1
            plans.append((tracked, entry, row, n, len(rows) - num_rows, num_rows))
            row += n
        result, failed_batch = None, None
        began = time.perf_counter()
        try:
            if rows:
                # Every row at once, NaN rows included: the sampler flags them (their tokens are dropped
                # below) and reads the flags back with the tokens, the step's one wait for the device.
                result = self.sampler(self.sampler.take_rows(logits, index), rows, check_nan=True)
        except BatchProcessorError as exc:  # a caller's processor: its batch ends with its error
            failed_batch = exc
        except Exception:
            logger.warning("hf_paged: batched sampling failed; sampling each request alone", exc_info=True)
            self.metrics.num_failed_steps += 1
        self.metrics.sampler_seconds += time.perf_counter() - began
        return _StepSamples(plans, rows, index, result, _nan_rows(logits, index, result) if plans else [],
                            failed_batch)

    def _lockstep_deferred(self, sched: SchedulerOutput, work: ExecutorStep) -> set[str]:
        """The step's sampling requests whose batch processor's batch does not sample whole in this
        step (`lockstep.py`); a batch that waited too long ends with a `LockstepError` here."""
        sampling = {e.request.request_id: self.requests[e.request.request_id].params.batch_processor
                    for e, chunk in zip(sched.scheduled, work.chunks) if chunk.num_logits and e.samples}
        if not any(sampling.values()):
            return set()
        with self.registry_lock:  # intake threads register requests while a step runs
            live = {rid: t.params.batch_processor for rid, t in self.requests.items() if t.finish_reason is None}
        deferred, ended = self.lockstep.deferred(sampling, live)
        for request_id, error in ended.items():
            self.fail(self.requests[request_id], error)
        return deferred

    # ------------------------------------------------------------------ update
    def _update(self, sched: SchedulerOutput, logits: torch.Tensor, samples: "_StepSamples") -> None:
        """Commit each request's tokens, one at a time: a request that fails here is rolled back alone."""
        now = time.perf_counter()
        for tracked, entry, start, n, first_row, num_rows in samples.plans:
            try:
                if tracked.params.batch_processor is not None and entry.samples and samples.result is None:
                    # Its batch's processor runs once per step over the whole batch, never on one row again.
                    raise samples.batch_failure(tracked.params.batch_processor)
                if any(samples.has_nan[start:start + n]):
                    raise RequestError(f"the model produced NaN logits for request {tracked.public_id!r}")
                if tracked.params.prompt_logprobs is not None:
                    self.outputs.record_prompt_logprobs(tracked, entry.start, len(entry.token_ids),
                                                        logits[start:start + n])
                if not entry.samples:
                    continue
                if samples.result is not None:
                    out = samples.result.slice(first_row, num_rows)
                else:
                    sub = samples.rows[first_row:first_row + num_rows]
                    out = self.sampler(logits[samples.index[first_row:first_row + num_rows]], sub)
                num_before = len(tracked.request.token_ids)
                self._commit_sample(tracked, entry, out, now)
                self.drafter.note_commit(tracked, start + n - 1 - len(entry.draft_token_ids), num_before, self.executor)
            except Exception as exc:
                self._roll_back(tracked, entry, exc)

    def _commit_sample(self, tracked: TrackedRequest, entry: ScheduledRequest, out: SamplerOutput, now: float) -> None:
        """Commit what the sampler drew for one entry: one token, or verified drafts plus one, or the
        first token of each of a request's n samples (which fork here)."""
        drafts = entry.draft_token_ids
        group = tracked.group
        if not group.forked:
            group.forked = True
            for j in range(1, group.n):  # each sample's own row j: its seed, the shared prompt logits
                self._fork_sample(tracked, j, out.slice(j, 1), now)
            out = out.slice(0, 1)
        if drafts:
            committed = verify_greedy(out.token_ids, drafts)
            self.metrics.on_verification(len(drafts), len(committed) - 1)
        else:
            committed = out.token_ids
        self._commit_tokens(tracked, committed, len(drafts), now, out)

    def _commit_tokens(self, tracked: TrackedRequest, tokens: list[int], num_drafts: int, now: float,
                       out: SamplerOutput) -> None:
        """Append `tokens` (cut at the first that ends the request), then roll the cache back past
        the rejected drafts. Everything that may raise (text, stop strings) runs before any change.
        `out` row j holds what the sampler returned with token j (logprobs, scores, logits)."""
        request, params = tracked.request, tracked.params
        num_out = request.num_output_tokens
        kept, reason = [], None
        for token in tokens:
            kept.append(token)
            reason = self._end_reason(params, num_out + len(kept), len(request.token_ids) + len(kept), token)
            if reason is not None:
                break
        kept, reason, deltas = self.outputs.cut(tracked, kept, reason)
        grammar = tracked.state.grammar
        if grammar is not None and (grammar.error is not None or not grammar.accept(kept)):  # all or none
            raise RequestError(grammar.error or f"request {tracked.public_id!r} drew tokens {kept} that its "
                               "structured outputs constraint does not allow (its mask left no allowed token?)")
        _check_sampleable(tracked.public_id, out.is_invalid, len(tokens))
        # Committed from here on: nothing below raises for a well-formed request.
        for _ in kept:
            tracked.metrics.on_token(now)
        request.token_ids.extend(kept)
        self.metrics.generation_tokens += len(kept)
        events = self.outputs.record(tracked, kept, deltas, out, finished=reason is not None)
        if reason is not None:
            self.finish(tracked, reason, last_event=events[-1] if events else None)
            return
        rejected = num_drafts - (len(tokens) - 1)
        if self.scheduler.rollback(request, rejected):  # a recurrent state without a snapshot there
            self._note_preempted(tracked)
        self._updates[tracked.public_id] = tracked

    def _end_reason(self, params: SamplingParams, num_out: int, total: int, token: int) -> str | None:
        if num_out >= params.min_new_tokens and (
            token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        ):
            return "stop"
        if num_out >= params.max_new_tokens or total >= self.max_model_len:
            return "length"
        return None

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        """A fresh id, unused by any live request (call under `registry_lock`)."""
        request_id = f"req-{next(self._ids)}"
        while request_id in self.requests or request_id in self.groups:
            request_id = f"req-{next(self._ids)}"
        return request_id

    def is_live(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.groups

    def register(self, tracked: TrackedRequest) -> None:
        """Make a request known before it is queued (call under `registry_lock`): a step never meets
        an unknown id."""
        self.requests[tracked.request.request_id] = tracked
        self.groups[tracked.public_id] = tracked.group

    def new_state(self, params: SamplingParams, seed: int, request: Request, grammar=None) -> SamplingState:
        """`grammar`: the request's fresh `structured.grammar.GrammarState`, with `params.structured`."""
        end_ids = ([] if params.ignore_eos else list(self.eos_token_ids)) + list(params.stop_token_ids)
        return SamplingState(params, seed, request.token_ids, request.num_prompt_tokens, end_ids, self.eos_token_ids,
                             grammar)

    def add(self, tracked: TrackedRequest) -> None:
        """Queue a registered request (taking over its kept `kv_prefix` if that is still held)."""
        prefix, tracked.kv_prefix = tracked.kv_prefix, None
        if prefix is not None:
            _take_prefix(self.kv, tracked.request, prefix)
        self.images.add(tracked)
        self.scheduler.add(tracked.request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End every sample of a request (not reported by `step`); its output so far, or None."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for member in list(group.members):
            if member is not None:
                self.finish(member, "abort", report=False)  # the caller gets it, not step()
        return self.outputs.output(group.members[0])

    def end_all(self, reason: str, error: Exception | None = None) -> None:
        """End every live request ("abort", or "error" with `error`); one failing never keeps the
        others waiting."""
        for tracked in list(self.requests.values()):
            try:
                if error is not None:
                    self.fail(tracked, error)
                else:
                    self.finish(tracked, reason)
            except Exception:  # noqa: BLE001
                logger.exception("hf_paged: ending request %r failed", tracked.public_id)

    def fail(self, tracked: TrackedRequest, exc: Exception) -> None:
        tracked.error = exc
        self.finish(tracked, "error")

    def finish(self, tracked: TrackedRequest, reason: str, last_event: StreamEvent | None = None,
               report: bool = True) -> None:
        """End a request exactly once: free its blocks, settle its text, tell its owner (and, with
        `report`, the caller of `step()`)."""
        if tracked.finish_reason is not None:
            return
        tail = self.outputs.settle_text(tracked)  # may fail on its own; it then falls back, never raises
        kept = self.scheduler.finish(tracked.request, keep_kv=tracked.group.retain_kv and reason != "error")
        if kept is not None and self.kv.keep(kept, len(tracked.request.token_ids) - 1):
            # The K/V of every token fed to the model: all but the last sampled one.
            tracked.group.kept[tracked.sample_index] = kept
        self.drafter.free(tracked.request.request_id)
        tracked.finish_reason = reason
        tracked.metrics.finished_time = time.perf_counter()
        self.metrics.on_finished(tracked.metrics, reason)
        with self.registry_lock:
            del self.requests[tracked.request.request_id]
        group = tracked.group
        if not group.forked:  # it ended before its other samples existed: they end with it
            group.forked = True
            group.unforked_reason = reason
        output = self.outputs.output(tracked) if group.finished else None  # built once, by the last sample
        if group.finished:
            with self.registry_lock:
                self.groups.pop(group.request_id, None)
            if group.retain_kv:
                self.finished_groups[group.request_id] = group  # until `kept_kv` collects its sequences
        if report:
            self._updates[tracked.public_id] = tracked
        self.outputs.finish(tracked, reason, last_event, tail, output)

    def collect_kept(self, request_id: str) -> list[KVSequence | None]:
        group = self.finished_groups.pop(request_id, None)
        return list(group.kept) if group is not None else []

    def drop_finished_groups(self) -> list[KVSequence | None]:
        """The kept sequences no caller collected (their groups forgotten)."""
        groups, self.finished_groups = list(self.finished_groups.values()), {}
        return [seq for group in groups for seq in group.kept]

    def raise_limits(self, max_num_seqs: int | None, max_model_len: int | None) -> None:
        """Raise (never lower) the running-request and sequence-length limits, between steps."""
        if max_num_seqs is not None:
            self.scheduler.max_num_seqs = max(self.scheduler.max_num_seqs, max_num_seqs)
        if max_model_len is not None:
            self.max_model_len = max(self.max_model_len, max_model_len)

    def note_weights(self) -> None:
        """Check the weights before admitting: if they changed, the prefix cache is dropped and a new
        epoch begins; waiting requests that store nothing yet are salted with it (so they share the
        blocks they compute under the new weights with each other, and nothing older)."""
        self.kv.note_weights(self.fingerprint())
        salt = self.kv.sequence_salt()
        for request in self.scheduler.waiting:
            if request.seq.num_tokens == 0:
                request.seq.extra_key = salt

    def update_gauges(self) -> None:
        m = self.metrics
        m.num_requests_running = len(self.scheduler.running)
        m.num_requests_waiting = len(self.scheduler.waiting)
        m.kv_cache_usage_perc = kv_cache_usage(self.kv.num_blocks, self.kv.num_free_blocks)

    # ------------------------------------------------------------------ failures
    def _roll_back(self, tracked: TrackedRequest, entry: ScheduledRequest, exc: Exception) -> None:
        """Undo one request's share of a step whose forward succeeded: forget the tokens it computed
        in this step (its K/V stay valid for whoever shares them), rebuild its text state, and retry
        it, unless the failure is its own for good."""
        self.metrics.num_failed_steps += 1
        request = tracked.request
        if request.status == RequestStatus.RUNNING:
            if self.scheduler.rollback(request, request.num_computed_tokens - entry.start):  # a recurrent state
                self._note_preempted(tracked)
        tracked.num_failures += 1
        if isinstance(exc, BatchProcessorError):  # the caller's processor raised: the caller's error, at once
            exc = exc.error
            tracked.num_failures = MAX_STEP_FAILURES
        fatal = isinstance(exc, RequestError) or tracked.num_failures >= MAX_STEP_FAILURES
        if not fatal:
            try:
                self.outputs.replay(tracked)
            except Exception as replay_exc:  # its text state cannot be rebuilt: it cannot go on
                exc, fatal = replay_exc, True
        if fatal:
            self.fail(tracked, exc)
        else:
            logger.warning("hf_paged: request %r failed after the forward (%r); retrying it",
                           request.request_id, exc)

    def _requeue(self, requests: list[Request], exc: Exception, stage: str) -> None:
        """The step raised before its K/V were complete: its requests go back to waiting (nothing of the
        step was published in the prefix cache) and are recomputed later."""
        self.kv.abort()
        self.metrics.num_failed_steps += 1
        logger.warning("hf_paged: a step failed in %s (%r); requeueing its %d requests", stage, exc, len(requests))
        for request in requests:
            tracked = self.requests.get(request.request_id)
            if tracked is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.scheduler.preempt(request)
                self._note_preempted(tracked)
            tracked.num_failures += 1
            if tracked.num_failures >= MAX_STEP_FAILURES or isinstance(exc, _FATAL):
                self.fail(tracked, exc)  # an unsupported model or a lost executor fails the same way on every retry

    def _on_failed_schedule(self, exc: Exception) -> None:
        """Scheduling (or the engine's own bookkeeping around it) raised: undo whatever it began."""
        self._consecutive_failed_steps += 1
        self._requeue(self.scheduler.recover(), exc, "scheduling")
        if self._consecutive_failed_steps >= MAX_STEP_FAILURES:  # nothing must hang silently
            logger.error("hf_paged: %d steps in a row failed; ending every unfinished request", MAX_STEP_FAILURES)
            for tracked in list(self.requests.values()):
                self.fail(tracked, exc)
            self._consecutive_failed_steps = 0

    def _note_preempted(self, tracked: TrackedRequest) -> None:
        tracked.metrics.num_preemptions += 1
        self.metrics.num_preemptions += 1
        self.drafter.free(tracked.request.request_id)

    # ------------------------------------------------------------------ bookkeeping
    def _note_admissions(self, sched: SchedulerOutput, now: float) -> None:
        self.metrics.prefix_cache_queries += sched.num_prefix_query_tokens
        self.metrics.prefix_cache_hits += sched.num_prefix_hit_tokens
        for entry in sched.scheduled:
            tracked = self.requests[entry.request.request_id]
            request = entry.request
            if tracked.metrics.first_scheduled_time is None:
                tracked.metrics.first_scheduled_time = now
            tracked.metrics.num_cached_tokens = request.num_cached_tokens
            if entry.start == request.num_cached_tokens:  # its admission
                self.images.note_admission(tracked)
            # Prompt tokens actually computed (outputs recomputed after a preemption count as prompt work).
            computed_prompt = max(0, min(entry.start + len(entry.token_ids), request.num_prompt_tokens) - entry.start)
            self.metrics.prompt_tokens += computed_prompt

    # ------------------------------------------------------------------ n samples
    def _fork_state(self, tracked: TrackedRequest, j: int) -> SamplingState:
        """Sample j's state for its first draw, before it exists as a request (the prompt so far)."""
        return self.new_state(tracked.params, sample_seed(tracked.state.seed, j), tracked.request,
                              _fresh_grammar(tracked.state))

    def _fork_sample(self, parent: TrackedRequest, j: int, out: SamplerOutput, now: float) -> None:
        """Create sample j of `parent`'s request from its just computed prompt (sharing every block) and
        commit the first token drawn for it. If that commit fails, the sample alone is retried (it
        waits, to be recomputed) or ends with an error."""
        prompt = parent.request.token_ids[: parent.request.num_prompt_tokens]
        with self.registry_lock:
            request_id = f"{parent.public_id}#{j}"
            while request_id in self.requests or request_id in self.groups:
                request_id += "'"
            request = Request(request_id=request_id, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                              max_total_tokens=parent.request.max_total_tokens,
                              seq=self.kv.fork_sequence(parent.request.seq))
            metrics = RequestMetrics(arrival_time=parent.metrics.arrival_time, num_prompt_tokens=len(prompt))
            metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            seed = sample_seed(parent.state.seed, j)
            child = TrackedRequest(request, parent.params, metrics, self.outputs.fork_detokenizer(parent, prompt),
                                   parent.inbox, parent.index,
                                   self.new_state(parent.params, seed, request, _fresh_grammar(parent.state)),
                                   parent.group, j)
            child.images, child.image_features = parent.images, parent.image_features
            self.requests[request_id] = child
        self.scheduler.add_forked(request)
        if request.status != RequestStatus.RUNNING:
            return  # no room to run it now: it recomputes its prompt (from the prefix cache) and draws again
        try:
            self._commit_tokens(child, out.token_ids, 0, now, out)
        except Exception as exc:
            self.metrics.num_failed_steps += 1
            child.num_failures += 1
            if child.finish_reason is None:
                self.scheduler.preempt(request)
                self._note_preempted(child)
                if child.num_failures >= MAX_STEP_FAILURES:
                    self.fail(child, exc)


class _StepSamples:
    """What `_sample` drew for the step, and how its rows map back to the requests."""

    def __init__(self, plans: list, rows: list[SampleRow], index: list[int], result: SamplerOutput | None,
                 has_nan: list[bool], failed_batch: BatchProcessorError | None = None):
        self.plans, self.rows, self.index, self.result, self.has_nan = plans, rows, index, result, has_nan
        self.failed_batch = failed_batch  # the batch processor that raised (its requests end with its error)

    def batch_failure(self, processor) -> BatchProcessorError:
        """Why a request of `processor`'s batch got no sample: its processor raised, or the batched
        sampler failed for another reason (a batch processor is never run on one row alone)."""
        if self.failed_batch is not None and self.failed_batch.processor is processor:
            return self.failed_batch
        return BatchProcessorError(processor, RequestError("batched sampling failed for a request with a batch "
                                                           "processor"))


def _fresh_grammar(state: SamplingState):
    return state.grammar.fresh() if state.grammar is not None else None


def _nan_rows(logits: torch.Tensor, index: list[int], result: SamplerOutput | None) -> list[bool]:
    """Per logits row, whether it holds a NaN: from the sampler's flags where it sampled the row; the
    rows it did not sample (prompt logprobs) or every row, if it failed, cost one more read."""
    has_nan = [False] * logits.shape[0]
    if result is not None:
        for k, row in enumerate(index):
            has_nan[row] = result.is_nan[k]
    unread = sorted(set(range(logits.shape[0])) - set(index)) if result is not None else range(logits.shape[0])
    if unread:
        for row, flag in zip(unread, torch.isnan(logits[list(unread)].amax(dim=-1)).tolist()):  # max propagates NaN
            has_nan[row] = flag
    return has_nan
