"""Iteration-level scheduler: which tokens of which requests go into the next forward. Torch-free.

Every step packs, up to a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`):

1. one token for every running request that is decoding (decodes first: they are latency-bound
   and cost one token each);
2. the next chunk of every running request still in prefill (chunked prefill: a long prompt is
   spread over several steps instead of stalling everyone's decode);
3. new requests from the waiting queue, strictly in arrival order, while their first chunk fits the
   budget and the pool (FIFO admission: a large request at the head is never starved by smaller
   ones behind it).

A request's state is the vLLM v1 one: `token_ids` (prompt, then outputs) and
`num_computed_tokens`, the prefix whose K/V are in the cache. Whatever lies beyond it is pending;
prefill and decode are the same thing with a different pending count.

When the pool cannot give a running request its next block, the newest running request not yet
scheduled in this step is preempted by recompute (possibly the request itself): its blocks are freed and it goes back to the head of the waiting queue.
Its full blocks keep their hashes in the prefix cache, so on resume most of it is a cache hit
rather than recomputation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from ..config import EngineConfig
from .block_pool import BlockManager
from .sequence import KVSequence
from .state_slots import assign_row, plan_chunk, settle


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """The scheduler's view of one request.

    Attributes:
        request_id: unique among live requests.
        token_ids: prompt followed by the outputs sampled so far.
        num_prompt_tokens: length of the prompt prefix of `token_ids`.
        max_total_tokens: the request never grows past this many tokens (prompt + outputs); the
            scheduler checks at admission that the pool could ever hold it.
        seq: the block manager's record (the tokens whose K/V are stored and where).
        num_computed_tokens: leading `token_ids` whose K/V are in the cache (or scheduled into the
            current step).
        arrival: admission order key; lower is older. Preemption picks the newest.
        atomic_spans: `(start, end)` position ranges a prefill chunk never ends inside (an image whose
            placeholders attend to each other both ways must be computed in one forward); sorted.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_total_tokens: int
    seq: KVSequence
    arrival: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the latest admission
    use_prefix_cache: bool = True  # False: admission computes the whole prompt (its logits are wanted)
    # Speculative tokens proposed for the next step (set by the engine, consumed by `schedule`).
    spec_token_ids: list[int] = field(default_factory=list)
    atomic_spans: tuple[tuple[int, int], ...] = ()

    def fit_chunk(self, start: int, num_new: int) -> int:
        """The most tokens, up to `num_new`, a chunk from `start` may take without ending inside an atomic
        span: cut back to the span's start, or 0 when the chunk starts inside a span it cannot finish."""
        end = start + num_new
        for s, e in self.atomic_spans:
            if s < end < e:
                return 0 if s <= start else s - start
        return num_new

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request.
        start: position of the first scheduled token (== tokens already in the cache before it).
        token_ids: the tokens fed to the model this step, positions `start .. start+len-1`.
        group_slots: per KV group, one KV slot per token, -1 where the block is a prefix-cache hit
            (nothing to write); `slots` is group 0's.
        samples: True when this chunk reaches the end of `token_ids`, so its last logits yield the
            request's next token; False for a prompt chunk that stops short of it.
        draft_token_ids: speculative tokens appended after the request's last token (the tail of
            `token_ids` here); the engine verifies them and `rollback`s the rejected ones.
    """

    request: Request
    start: int
    token_ids: list[int]
    group_slots: list[list[int]]
    samples: bool
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def slots(self) -> list[int]:
        return self.group_slots[0]


@dataclass
class SchedulerOutput:
    """What one step runs: the scheduled chunks in forward order, plus block copies to make first."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Blocks this step fills, published in the prefix cache only once its forward wrote their K/V
    # (`BlockManager.commit_full_blocks`): a failed step leaves nothing findable behind.
    new_full_blocks: list[tuple[int, int]] = field(default_factory=list)
    # Requests recomputed from scratch because their sequence passed a longrope threshold (`core.rope`).
    rope_restarted: list[Request] = field(default_factory=list)
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous-batching scheduler over a `BlockManager`.

    Args:
        manager: the block manager whose pool holds every request's K/V. Its pool must not grow
            behind the scheduler's back: admission and preemption reason about its free blocks.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (decodes plus prefill chunks).
    """

    def __init__(self, manager: BlockManager, max_num_seqs: int = EngineConfig.max_num_seqs,
                 max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens):
        self.check_limits(max_num_seqs, max_num_batched_tokens)
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the newest
        self.num_preemptions = 0
        self._next_arrival = 0

    @staticmethod
    def check_limits(max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Raise ValueError unless both limits are positive integers."""
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    # ------------------------------------------------------------------ questions
    @property
    def block_size(self) -> int:
        return self.manager.block_size

    def max_blocks_for(self, num_tokens: int) -> int:
        """The most blocks one request of `num_tokens` tokens ever holds at once (every group; a
        sliding or chunked group holds its window or chunk plus one step's tokens at most)."""
        return self.manager.max_blocks_for(num_tokens, self.max_num_batched_tokens)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one request of `num_tokens` tokens fits the pool once everything else is gone."""
        return self.max_blocks_for(num_tokens) <= self.manager.pool.num_blocks

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ mutations
    def add(self, request: Request) -> None:
        """Queue a request. Raises ValueError if it could never fit the pool (it would wait forever)."""
        if not self.can_ever_fit(request.max_total_tokens):
            raise ValueError(
                f"request {request.request_id!r} may grow to {request.max_total_tokens} tokens, which needs "
                f"{self.max_blocks_for(request.max_total_tokens)} KV blocks of {self.block_size}, but the pool has "
                f"only {self.manager.pool.num_blocks}; shorten the prompt or max_new_tokens, or enlarge the pool"
            )
        request.status = RequestStatus.WAITING
        request.arrival = self._next_arrival
        self._next_arrival += 1
        self.waiting.append(request)

    def add_forked(self, request: Request) -> None:
        """Add a request whose `seq` already holds its computed tokens (a sample forked from another
        request's computed prompt): it runs at once, or, with `max_num_seqs` requests running, its
        blocks are released and it waits to be recomputed (mostly from the prefix cache)."""
        request.arrival = self._next_arrival
        self._next_arrival += 1
        if len(self.running) < self.max_num_seqs:
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = request.seq.num_tokens
            self.running.append(request)
        else:
            self.manager.free(request.seq)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.append(request)

    def finish(self, request: Request, keep_kv: bool = False) -> KVSequence | None:
        """Remove a request (finished or aborted) and release its blocks; idempotent. With `keep_kv`
        its sequence is returned instead, blocks and all (None if it was already finished): the caller
        owns it, and the request gets an empty one."""
        kept = None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            try:
                self.waiting.remove(request)
            except ValueError:  # ended before it was ever queued (an engine shutting down)
                pass
        if request.status != RequestStatus.FINISHED:
            if keep_kv:
                kept, request.seq = request.seq, KVSequence(seq_id=request.seq.seq_id, extra_key=request.seq.extra_key,
                                                          mm_spans=request.seq.mm_spans, rope=request.seq.rope)
            else:
                self.manager.free(request.seq)
            request.num_computed_tokens = 0
            request.status = RequestStatus.FINISHED
        return kept

    def release_waiting(self) -> bool:
        """Free the blocks of waiting requests that hold some (a sequence handed over with its first
        tokens computed): they are recomputed on admission. For a pool so full that nothing can be
        scheduled; returns whether any block was freed."""
        freed = False
        for request in self.waiting:
            if request.seq.num_tokens or any(request.seq.block_tables):
                self.manager.free(request.seq)
                request.num_computed_tokens = 0
                freed = True
        return freed

    def schedule(self) -> SchedulerOutput:
        """Decide the next step and allocate its slots (the block tables change here)."""
        self.manager.pool.discard_staged()  # a step planned before this one has run or failed by now
        out = SchedulerOutput()
        self._restart_long_ropes(out)
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        # Decodes first, then prefill continuations; each in admission order.
        queue = sorted(self.running, key=lambda r: (r.num_pending_tokens > 1, r.arrival))
        for request in queue:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            drafts = request.spec_token_ids if request.num_pending_tokens == 1 else []
            request.spec_token_ids = []
            if drafts and request.seq.rope is not None and request.seq.rope.needs_restart(
                    len(request.token_ids) + len(drafts)):
                drafts = []  # the crossing recomputes the sequence from the token that makes it (as stock)
            num_new = min(request.num_pending_tokens + len(drafts), budget)
            if request.atomic_spans and not drafts:
                num_new = request.fit_chunk(request.num_computed_tokens, num_new)
            if num_new == 0:
                continue  # nothing to compute, or an atomic span that needs more budget than is left
            drafts = drafts[: num_new - 1]
            if drafts and not self.manager.can_append(request.seq, num_new):
                drafts, num_new = [], 1  # speculation never preempts anyone
            while not self.manager.can_append(request.seq, num_new):
                victim = self._newest_unscheduled(scheduled_ids)
                self.preempt(victim, out)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            self._schedule_chunk(request, num_new, out, drafts)
            scheduled_ids.add(request.request_id)
            budget -= num_new

        # Admit new work only when nothing had to be preempted: the pool is under pressure.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            request = self.waiting[0]
            prompt = request.token_ids
            # A sequence handed over with its first tokens computed (a kept sequence continued) starts after
            # them; any other starts empty. Keep the last token out of the cache hit so it yields logits.
            held = request.seq.num_tokens
            cacheable = prompt[: len(prompt) - 1]
            num_cached = (self.manager.num_cached_prefix_tokens(request.seq, cacheable)
                          if request.use_prefix_cache and not held else 0)
            num_new = min(len(prompt) - held - num_cached, budget)
            if request.atomic_spans:
                num_new = request.fit_chunk(held + num_cached, num_new)
                if num_new == 0:
                    break  # its first chunk cannot end yet: it waits for a step with more budget
            blocks = self.manager.num_blocks_needed(request.seq, num_new, num_cached_tokens=num_cached)
            if not self.manager.pool.can_allocate(blocks):
                break  # FIFO: nobody overtakes the head of the queue
            out.num_prefix_query_tokens += len(prompt) - held
            if num_cached:
                hit = self.manager.append_cached(request.seq, cacheable[:num_cached])
                out.copies.extend(hit.copies)
                num_cached = hit.num_cached_tokens  # == num_cached: the lookup and the take are one step
                request.num_computed_tokens = num_cached
            if held:
                request.num_computed_tokens = held
            slots = self.manager.state_slots
            if slots is not None:  # recurrent layers: the checkpoint where the hit ends, and a state row
                restore = None
                if num_cached:  # looked up first: the lookup keeps it from being the next evicted
                    restore = slots.lookup(request.seq.block_hashes[num_cached // self.block_size - 1])
                    if restore is None:  # `num_cached_prefix_tokens` ends every hit at a kept checkpoint
                        raise RuntimeError(f"no state checkpoint at the end of request {request.request_id!r}'s "
                                           f"prefix-cache hit of {num_cached} tokens")
                    slots.num_restores += 1
                assign_row(slots, request.seq)
                if restore is not None:
                    # A row freed by evicting that checkpoint keeps its bytes until the step's copies have run:
                    # rows are written only by the forward, after them.
                    slots.copy_later(restore, request.seq.state_row)
            request.num_cached_tokens = num_cached
            out.num_prefix_hit_tokens += num_cached
            # Leave the queue only together with joining `running`: an exception anywhere in this step
            # finds every request in one of the two (see `recover`).
            request.status = RequestStatus.RUNNING
            self.waiting.popleft()
            self.running.append(request)
            self._schedule_chunk(request, num_new, out)
            scheduled_ids.add(request.request_id)
            budget -= num_new
        return out

    def rollback(self, request: Request, num_tokens: int) -> bool:
        """Forget the last `num_tokens` computed tokens (rejected speculative tokens): their slots
        are released and their blocks truncated, so nothing stale is ever read. A sequence with a
        recurrent state takes the snapshot its step kept at that point (`state_slots.settle`); with none
        there it is preempted and recomputed. Returns whether it was preempted."""
        slots = self.manager.state_slots
        if slots is not None and request.status == RequestStatus.RUNNING:
            computed = request.num_computed_tokens
            if not settle(slots, request.seq, computed, computed - num_tokens):
                self.preempt(request)  # no snapshot where it goes back to: its state is recomputed
                return True
        if num_tokens:
            self.manager.truncate(request.seq, num_tokens)
            request.num_computed_tokens -= num_tokens
        return False

    def preempt(self, request: Request, out: SchedulerOutput | None = None) -> None:
        """Free a running request's blocks and put it back at the head of the waiting queue, to be
        recomputed (mostly from the prefix cache). Also used by the engine to requeue the requests of
        a step whose forward failed. `out`, when given, records it in the step's `preempted`."""
        self._requeue(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        if out is not None:
            out.preempted.append(request)

    def _requeue(self, request: Request) -> None:
        """Free a running request's blocks and put it at the head of the waiting queue."""
        self.running.remove(request)
        self.manager.free(request.seq)
        request.seq.prefix_epoch = None  # it restarts from nothing: hashing may resume
        request.seq.is_cacheable = True  # its tokens are all known ids (only inputs_embeds are not)
        request.spec_token_ids = []  # proposed after its last token; re-admission samples a new one
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _restart_long_ropes(self, out: SchedulerOutput) -> None:
        """Requests whose next token takes their sequence past a longrope threshold where stock drops the
        cache and recomputes it with the long factors (Phi-3): recomputed likewise, from scratch (kept
        prefixes of waiting ones freed). Recorded in the step's `rope_restarted`."""
        for request in list(self.running):
            rope = request.seq.rope
            if rope is not None and rope.needs_restart(len(request.token_ids)):
                self._requeue(request)
                request.seq.rope = rope.restarted()
                out.rope_restarted.append(request)
        for request in self.waiting:
            rope = request.seq.rope
            if rope is not None and rope.needs_restart(len(request.token_ids)):
                if request.seq.num_tokens or any(request.seq.block_tables):
                    self.manager.free(request.seq)
                    request.num_computed_tokens = 0
                    out.rope_restarted.append(request)
                request.seq.rope = rope.restarted()

    def recover(self) -> list[Request]:
        """Undo a `schedule` that raised part-way: every running request is preempted (its blocks
        freed, back to the head of the queue) and any waiting request's partly filled sequence is
        cleared. Nothing of the failed step was published in the prefix cache. Returns the requests
        that were running."""
        self.manager.pool.discard_staged()
        was_running = list(self.running)
        for request in reversed(was_running):  # newest first, so the oldest ends up at the head
            self.preempt(request)
        for request in self.waiting:
            if request.seq.token_ids or any(request.seq.block_tables):
                self.manager.free(request.seq)
            request.num_computed_tokens = 0
            request.spec_token_ids = []
        return was_running

    # ------------------------------------------------------------------ internals
    def _schedule_chunk(self, request: Request, num_new: int, out: SchedulerOutput,
                        drafts: list[int] | None = None) -> None:
        drafts = list(drafts or [])
        start = request.num_computed_tokens
        tokens = request.token_ids[start : start + num_new - len(drafts)] + drafts
        result = self.manager.append_tokens(request.seq, tokens, register=False)
        if self.manager.state_slots is not None:
            plan_chunk(self.manager.state_slots, request.seq, start, num_new, len(drafts), self.block_size)
        out.copies.extend(result.copies)
        out.new_full_blocks.extend(result.new_full_blocks)
        request.num_computed_tokens += num_new
        out.scheduled.append(ScheduledRequest(
            request=request, start=start, token_ids=tokens, group_slots=result.group_slots,
            samples=request.num_computed_tokens - len(drafts) == len(request.token_ids),
            draft_token_ids=drafts,
        ))

    def _newest_unscheduled(self, scheduled_ids: set[str]) -> Request:
        """The newest running request not already in this step (its slots are taken)."""
        for request in reversed(self.running):
            if request.request_id not in scheduled_ids:
                return request
        raise AssertionError("no preemptible request; can_ever_fit should have prevented this")
