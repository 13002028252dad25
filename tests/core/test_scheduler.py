"""Tests for the torch-free continuous-batching scheduler (hf_paged/scheduler.py).

The unit tests pin down one behaviour each: decode-first ordering, the token budget and sequence cap,
chunked prefill boundaries, FIFO admission, preemption by recompute, prefix-cache hits on admission
and on resume, speculative drafts (budget, never preempting, rollback), `add` / `finish` /
constructor checks. Long simulations with a tiny pool check that preemption never starves anyone,
and a Hypothesis state machine drives random add / step (with drafts) / inject / abort sequences
against a *content model* of every KV slot, so a prefix hit or a resumed request that would read the
wrong K/V shows up as a content mismatch rather than only as inconsistent counters.

This module never imports torch itself (the scheduler is torch-free; see
`test_scheduler_module_imports_without_torch`).
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_paged.core.block_pool import BlockManager, BlockPool
from hf_paged.core.scheduler import Request, RequestStatus, ScheduledRequest, Scheduler, SchedulerOutput
from hf_paged.core.sequence import KVSequence

HF_PAGED_DIR = Path(__file__).resolve().parents[1] / "hf_paged"


# --- helpers --------------------------------------------------------------------------------------

_ids = itertools.count()


def make(
    num_blocks: int,
    block_size: int,
    *,
    caching: bool = True,
    max_num_seqs: int = 64,
    budget: int = 2048,
) -> tuple[BlockPool, Scheduler]:
    pool = BlockPool(num_blocks, enable_prefix_caching=caching)
    return pool, Scheduler(BlockManager(pool, block_size), max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=budget)


def req(prompt, max_new: int = 16, rid: str | None = None) -> Request:
    n = next(_ids)
    prompt = list(prompt)
    return Request(
        request_id=rid if rid is not None else f"r{n}",
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        max_total_tokens=len(prompt) + max_new,
        seq=KVSequence(seq_id=n),
    )


def fake_next(token_ids: list[int]) -> int:
    """The fake model's next token: deterministic in the history, so equal prefixes sample equal
    tokens (cache hits) and a draft can be checked against it."""
    return (sum(token_ids) * 7 + len(token_ids)) % 5


def fake_token(request: Request) -> int:
    return fake_next(request.token_ids)


def sample(out: SchedulerOutput) -> None:
    """What an engine does after the forward: one new token for every entry that samples."""
    for entry in out.scheduled:
        if entry.samples:
            entry.request.token_ids.append(fake_token(entry.request))


def who(out: SchedulerOutput) -> list[str]:
    return [e.request.request_id for e in out.scheduled]


def entry_of(out: SchedulerOutput, request: Request) -> ScheduledRequest:
    (entry,) = [e for e in out.scheduled if e.request is request]
    return entry


def holders(sched: Scheduler) -> dict[int, set[str]]:
    """Block id -> ids of the requests whose block table holds it."""
    held: dict[int, set[str]] = {}
    for r in sched.running:
        for b in r.seq.block_table:
            held.setdefault(b, set()).add(r.request_id)
    return held


def check_step(sched: Scheduler, out: SchedulerOutput, held_before: dict[int, set[str]]) -> None:
    """Structural checks every step must pass, whatever the scenario. `held_before`: `holders()`
    taken just before `schedule()`."""
    pool, bs = sched.manager.pool, sched.block_size
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    seen_slots: set[int] = set()
    preempted = {p.request_id for p in out.preempted}  # their blocks were freed before any reuse
    for e in out.scheduled:
        r = e.request
        assert r.status == RequestStatus.RUNNING and r in sched.running
        assert len(e.token_ids) >= 1
        real = len(e.token_ids) - len(e.draft_token_ids)  # drafts (speculation) follow the real tokens
        assert real >= 1 and e.token_ids[real:] == e.draft_token_ids
        assert e.token_ids[:real] == r.token_ids[e.start : e.start + real]
        assert r.num_computed_tokens == e.start + len(e.token_ids)
        assert e.samples == (e.start + real == len(r.token_ids))
        assert e.samples or not e.draft_token_ids, "drafts only after the request's last token"
        assert r.spec_token_ids == [], "scheduled drafts are consumed"
        assert len(e.slots) == len(e.token_ids)
        for j, slot in enumerate(e.slots):
            pos = e.start + j
            block = r.seq.block_table[pos // bs]
            if slot == -1:  # a prefix-cache hit inside the chunk: the block already holds this K/V
                assert pool.enable_prefix_caching and (pool.block_hash[block] is not None or pool.is_staged(block))
                assert pos % bs <= j and all(sl == -1 for sl in e.slots[j - pos % bs : j]), (
                    "a hit covers a whole block")
                continue
            assert slot == block * bs + pos % bs, "slot does not match the block table"
            # Never write into a block someone else already held (copy-on-write). Another request
            # may take it from the prefix cache later in this same step: the forward writes every
            # token's K/V of a layer before any attention of that layer reads them.
            others = held_before.get(block, set()) - {r.request_id} - preempted
            assert not others, f"write into block {block} still held by {others}"
            assert slot not in seen_slots, "two tokens of one step share a slot"
            seen_slots.add(slot)
    assert len({e.request.request_id for e in out.scheduled}) == len(out.scheduled)
    for r in out.preempted:
        assert r.status == RequestStatus.WAITING and r in sched.waiting and r not in sched.running
        assert r.num_computed_tokens == 0 and r.seq.num_tokens == 0 and r.seq.block_table == []
        assert all(e.request is not r for e in out.scheduled)
    pool.check_invariants()


def schedule(sched: Scheduler) -> SchedulerOutput:
    """One scheduled step whose forward succeeds: its filled blocks are then published, as the
    engine's runner does once the K/V are written."""
    held = holders(sched)
    out = sched.schedule()
    check_step(sched, out, held)
    sched.manager.commit_full_blocks(out.new_full_blocks)
    return out


def step(sched: Scheduler) -> SchedulerOutput:
    out = schedule(sched)
    sample(out)
    return out


# --- torch-freedom --------------------------------------------------------------------------------


def test_scheduler_module_imports_without_torch():
    # The package __init__ imports torch; load the three torch-free modules under a bare package.
    code = textwrap.dedent(
        f"""
        import sys, types
        pkg = types.ModuleType("hf_paged")
        pkg.__path__ = [{str(HF_PAGED_DIR)!r}]
        sys.modules["hf_paged"] = pkg
        from hf_paged.core.block_pool import BlockManager, BlockPool
        from hf_paged.core.scheduler import Request, Scheduler
        from hf_paged.core.sequence import KVSequence
        pool = BlockPool(4)
        s = Scheduler(BlockManager(pool, 2), max_num_seqs=2, max_num_batched_tokens=8)
        r = Request("a", [1, 2, 3], 3, 6, KVSequence(0))
        s.add(r)
        out = s.schedule()
        assert [e.token_ids for e in out.scheduled] == [[1, 2, 3]]
        s.finish(r)
        assert pool.num_free_blocks == 4
        assert "torch" not in sys.modules, "the scheduler pulled in torch"
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# --- construction and add -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens"])
@pytest.mark.parametrize("bad", [0, -1, True, False, 1.5, 2.0, "4", None])
def test_constructor_rejects_bad_limits(name, bad):
    pool = BlockPool(4)
    with pytest.raises(ValueError, match=name):
        Scheduler(BlockManager(pool, 2), **{name: bad})


def test_constructor_accepts_minimal_limits():
    pool = BlockPool(4)
    s = Scheduler(BlockManager(pool, 2), max_num_seqs=1, max_num_batched_tokens=1)
    assert s.max_num_seqs == 1 and s.max_num_batched_tokens == 1 and s.block_size == 2
    assert not s.has_unfinished and s.schedule().is_empty


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_add_rejects_a_request_that_can_never_fit(bs):
    pool, s = make(3, bs)
    capacity = 3 * bs
    fits = req(range(capacity - 1), max_new=1)  # exactly the whole pool
    s.add(fits)
    too_big = req(range(capacity - 1), max_new=2)  # one token more than the pool holds
    with pytest.raises(ValueError, match=too_big.request_id):
        s.add(too_big)
    assert list(s.waiting) == [fits], "a rejected request must not be queued"
    assert too_big.status == RequestStatus.WAITING  # untouched default
    # The one that fits runs alone; its K/V never outgrow the pool (the last output is never fed back).
    out = step(s)
    assert who(out) == [fits.request_id] and fits.num_output_tokens == 1
    assert pool.num_free_blocks == 3 - (-(-(capacity - 1) // bs))
    s.finish(fits)
    assert pool.num_free_blocks == 3
    # capacity - 2 prompt tokens, then one decode: capacity - 1 tokens cached, the pool (nearly) full.
    two = req(range(capacity - 2), max_new=2)
    s.add(two)
    step(s)
    out = step(s)
    assert who(out) == [two.request_id] and two.num_computed_tokens == capacity - 1
    assert pool.num_free_blocks == (1 if bs == 1 else 0)


def test_add_assigns_increasing_arrival_and_waiting_status():
    _, s = make(8, 4)
    rs = [req([i, i]) for i in range(3)]
    for r in rs:
        r.status = RequestStatus.FINISHED  # a recycled object is reset to WAITING
        s.add(r)
    assert [r.arrival for r in rs] == [0, 1, 2]
    assert all(r.status == RequestStatus.WAITING for r in rs)
    assert list(s.waiting) == rs and s.running == [] and s.has_unfinished


# --- prefill, decode, chunking --------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_single_request_prefill_then_decodes(caching):
    pool, s = make(8, 4, caching=caching)
    r = req([10, 11, 12, 13, 14], max_new=4)
    s.add(r)
    out = step(s)
    (e,) = out.scheduled
    assert (e.start, e.token_ids, e.samples) == (0, [10, 11, 12, 13, 14], True)
    assert r.status == RequestStatus.RUNNING and s.running == [r] and not s.waiting
    assert r.num_computed_tokens == 5 and r.seq.token_ids == [10, 11, 12, 13, 14]
    assert len(r.seq.block_table) == 2 and pool.num_used_blocks == 2
    assert out.num_prefix_query_tokens == 5 and out.num_prefix_hit_tokens == 0
    for i in range(3):
        out = step(s)
        (e,) = out.scheduled
        assert e.start == 5 + i and e.token_ids == [r.token_ids[5 + i]] and e.samples
        assert out.num_prefix_query_tokens == 0  # only admissions query the prefix cache
    assert r.seq.token_ids == r.token_ids[:8] and len(r.seq.block_table) == 2
    step(s)
    assert len(r.seq.block_table) == 3  # token 9 opens a third block


@pytest.mark.parametrize("budget", [1, 3, 4, 7])
def test_chunked_prefill_spreads_a_long_prompt_over_steps(budget):
    pool, s = make(16, 4, budget=budget)
    prompt = list(range(100, 117))  # 17 tokens
    r = req(prompt, max_new=2)
    s.add(r)
    starts, chunks, samples = [], [], []
    while True:
        out = step(s)
        (e,) = out.scheduled
        starts.append(e.start)
        chunks.append(e.token_ids)
        samples.append(e.samples)
        assert r.seq.token_ids == prompt[: r.num_computed_tokens]
        assert len(r.seq.block_table) == -(-r.num_computed_tokens // 4)
        if e.samples:
            break
    expected_starts = list(range(0, 17, budget))
    assert starts == expected_starts
    assert chunks == [prompt[i : i + budget] for i in expected_starts]
    assert samples == [False] * (len(expected_starts) - 1) + [True]
    assert r.num_output_tokens == 1
    out = step(s)  # then decodes, one token each
    assert [(e.start, len(e.token_ids), e.samples) for e in out.scheduled] == [(17, 1, True)]


def test_decodes_are_scheduled_before_prefill_continuations():
    _, s = make(16, 4, budget=3)
    a, b = req([1, 2, 3], rid="a"), req([4, 5, 6], rid="b")
    s.add(a)
    s.add(b)
    assert who(step(s)) == ["a"]  # a's prompt takes the whole budget
    out = step(s)  # a decodes, b is admitted with a 2-token chunk
    assert who(out) == ["a", "b"] and len(entry_of(out, b).token_ids) == 2
    out = step(s)
    assert who(out) == ["a", "b"] and entry_of(out, b).samples
    # Now make the OLDER request a prefill continuation (e.g. forced tokens appended by the caller):
    a.token_ids.extend([7, 8])
    computed = a.num_computed_tokens
    assert a.num_pending_tokens == 3 and b.num_pending_tokens == 1
    out = step(s)
    # The newer decode goes first and gets its token; the older continuation gets what is left.
    assert who(out) == ["b", "a"]
    eb, ea = out.scheduled
    assert len(eb.token_ids) == 1 and eb.samples
    assert (ea.start, len(ea.token_ids), ea.samples) == (computed, 2, False)
    assert ea.token_ids == a.token_ids[computed : computed + 2]
    out = step(s)
    assert who(out) == ["a", "b"]  # a has one token pending: both are decodes, in arrival order
    assert [len(e.token_ids) for e in out.scheduled] == [1, 1]


def test_budget_is_shared_by_decodes_then_an_admission_chunk():
    _, s = make(32, 4, budget=5)
    decoders = [req([i]) for i in range(3)]
    for r in decoders:
        s.add(r)
    step(s)
    p = req(range(20, 30))
    s.add(p)
    out = step(s)
    assert who(out) == [r.request_id for r in decoders] + [p.request_id]
    assert [len(e.token_ids) for e in out.scheduled] == [1, 1, 1, 2]
    ep = entry_of(out, p)
    assert (ep.start, ep.token_ids, ep.samples) == (0, [20, 21], False)
    assert out.num_tokens == 5
    out = step(s)
    ep = entry_of(out, p)
    assert (ep.start, ep.token_ids) == (2, [22, 23])


def test_token_budget_is_never_exceeded_with_many_requests():
    _, s = make(64, 2, budget=7)
    rs = [req(range(i, i + 1 + i % 5), max_new=6) for i in range(9)]
    for r in rs:
        s.add(r)
    full_steps = 0
    for _ in range(40):
        out = step(s)
        assert out.num_tokens <= 7
        full_steps += out.num_tokens == 7
        for r in list(s.running):
            if r.num_output_tokens >= 6:
                s.finish(r)
    assert full_steps >= 5, "the scenario never filled the budget"
    assert not s.has_unfinished


def test_max_num_seqs_caps_running_requests_and_admits_fifo():
    _, s = make(64, 4, max_num_seqs=2)
    rs = [req([i] * 3, rid=f"q{i}") for i in range(4)]
    for r in rs:
        s.add(r)
    for _ in range(3):
        out = step(s)
        assert who(out) == ["q0", "q1"] and len(s.running) == 2
        assert list(s.waiting) == rs[2:]
    s.finish(rs[1])
    out = step(s)
    assert who(out) == ["q0", "q2"]
    s.finish(rs[0])
    s.finish(rs[2])
    assert who(step(s)) == ["q3"]


def test_zero_leftover_budget_admits_nothing():
    _, s = make(64, 4, budget=2)
    a, b, c = req([1]), req([2]), req([3])
    for r in (a, b, c):
        s.add(r)
    assert who(step(s)) == [a.request_id, b.request_id]
    assert list(s.waiting) == [c]
    assert who(step(s)) == [a.request_id, b.request_id]  # two decodes fill the budget
    assert list(s.waiting) == [c]


# --- admission: blocks and FIFO -------------------------------------------------------------------


def test_fifo_a_big_request_at_the_head_is_not_overtaken():
    pool, s = make(4, 4, caching=False)
    a = req(range(8), max_new=8, rid="a")  # 2 blocks
    s.add(a)
    step(s)
    big = req(range(50, 62), max_new=4, rid="big")  # needs 3 blocks at once
    small = req([99], max_new=3, rid="small")  # 1 block: would fit, but is behind `big`
    s.add(big)
    s.add(small)
    for _ in range(3):
        out = step(s)
        assert who(out) == ["a"]
        assert list(s.waiting) == [big, small]
        assert pool.num_free_blocks >= 1  # `small` would have fit
    s.finish(a)
    out = step(s)
    assert who(out) == ["big", "small"]
    assert [e.start for e in out.scheduled] == [0, 0]


def test_admission_needs_blocks_for_the_first_chunk_only():
    pool, s = make(4, 4, caching=False, budget=4)
    a = req(range(8), max_new=4, rid="a")
    s.add(a)
    step(s)
    step(s)  # a's prompt in two chunks of 4
    step(s)  # a's first decode: 9 tokens, three blocks, one free
    assert pool.num_free_blocks == 1
    long = req(range(100, 112), max_new=4, rid="long")  # 12 tokens, chunks of 4 -> 1 block now
    s.add(long)
    out = step(s)
    assert who(out) == ["a", "long"]
    assert entry_of(out, long).token_ids == list(range(100, 103))  # 3 left after a's decode
    assert pool.num_free_blocks == 0


def test_admission_waits_until_blocks_are_free():
    pool, s = make(3, 2, caching=False)
    a = req([1, 2, 3, 4], max_new=2, rid="a")  # 2 blocks
    b = req([5, 6, 7], max_new=1, rid="b")  # needs 2 blocks
    s.add(a)
    s.add(b)
    out = step(s)
    assert who(out) == ["a"] and list(s.waiting) == [b]
    assert pool.num_free_blocks == 1
    out = step(s)  # a takes the last block for token 5
    assert who(out) == ["a"] and pool.num_free_blocks == 0 and list(s.waiting) == [b]
    s.finish(a)
    assert who(step(s)) == ["b"]


# --- preemption -----------------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_evicts_the_newest_running_request(caching):
    pool, s = make(6, 2, caching=caching, budget=12)
    a, b, c = (req([1, 2, 3, 4], max_new=4, rid="a"), req([5, 6, 7, 8], max_new=4, rid="b"),
               req([9, 10, 11, 12], max_new=4, rid="c"))
    for r in (a, b, c):
        s.add(r)
    out = step(s)
    assert who(out) == ["a", "b", "c"] and pool.num_free_blocks == 0
    c_tokens = list(c.token_ids)
    c_blocks = set(c.seq.block_table)
    out = schedule(s)
    assert out.preempted == [c]
    assert who(out) == ["a", "b"]
    assert c.status == RequestStatus.WAITING and list(s.waiting) == [c] and s.running == [a, b]
    assert c.num_computed_tokens == 0 and c.seq.token_ids == [] and c.seq.block_table == []
    assert c.token_ids == c_tokens, "preemption must keep the request's tokens (prompt and outputs)"
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    assert a.num_preemptions == 0 and b.num_preemptions == 0
    # c's blocks went to a and b.
    assert {a.seq.block_table[-1], b.seq.block_table[-1]} == c_blocks
    assert pool.num_free_blocks == 0


def test_preemption_takes_several_victims_newest_first_and_keeps_their_order():
    pool, s = make(8, 1, caching=False, budget=12)
    a, b, c = (req([1, 2, 3, 4], max_new=4, rid="a"), req([5, 6, 7], max_new=4, rid="b"),
               req([8], max_new=4, rid="c"))
    for r in (a, b, c):
        s.add(r)
    step(s)
    assert pool.num_free_blocks == 0
    for r in (a, b, c):  # every request has 4 pending tokens now
        r.token_ids.extend([0, 0, 0])
    out = schedule(s)
    assert out.preempted == [c, b]
    assert list(s.waiting) == [b, c], "preempted requests keep their arrival order at the head"
    assert who(out) == ["a"] and len(out.scheduled[0].token_ids) == 4
    assert s.num_preemptions == 2


def test_a_request_that_cannot_grow_preempts_itself_not_an_older_one():
    # bs 1: one block per token. `b` (newest) needs a block; `a` is older and already scheduled.
    pool, s = make(5, 1, caching=False, budget=3)
    a, b = req([1], max_new=4, rid="a"), req([2, 3], max_new=3, rid="b")
    s.add(a)
    s.add(b)
    step(s)  # a: 1 block, b: 2 blocks
    step(s)  # both decode: 5 blocks, pool full
    assert pool.num_free_blocks == 0
    out = schedule(s)
    assert out.preempted == [b] and who(out) == ["a"]
    assert a.status == RequestStatus.RUNNING and a.num_preemptions == 0


def test_no_admission_in_a_step_that_preempted():
    pool, s = make(5, 1, caching=False, budget=3)
    a, c = req([1], max_new=3, rid="a"), req([2, 3], max_new=3, rid="c")
    s.add(a)
    s.add(c)
    step(s)
    step(s)
    assert pool.num_free_blocks == 0
    out = step(s)
    assert out.preempted == [c] and who(out) == ["a"]
    # There is room for c's first chunk (2 tokens of budget left, 2 free blocks), yet it waits.
    assert pool.num_free_blocks >= 2 and s.max_num_batched_tokens - out.num_tokens >= 2
    assert list(s.waiting) == [c] and c.status == RequestStatus.WAITING
    s.finish(a)
    out = step(s)  # next step: nothing preempted, c comes back and recomputes from position 0
    assert who(out) == ["c"] and out.scheduled[0].start == 0
    assert out.scheduled[0].token_ids == c.token_ids[:3]


def test_preempted_request_recomputes_all_its_tokens_and_samples_only_at_the_end():
    pool, s = make(6, 2, caching=False, budget=3)
    a, b = req([1, 2, 3, 4], max_new=6, rid="a"), req([5, 6], max_new=6, rid="b")
    s.add(a)
    s.add(b)
    while not b.num_preemptions:
        out = step(s)
        assert s.num_preemptions == b.num_preemptions, "only the newest, b, is ever preempted"
    b_tokens = list(b.token_ids)
    s.finish(a)
    chunks = []
    while True:
        out = step(s)
        (e,) = out.scheduled
        chunks.append((e.start, e.token_ids, e.samples))
        if e.samples:
            break
    assert [t for _, toks, _ in chunks for t in toks] == b_tokens
    assert [smp for *_, smp in chunks] == [False] * (len(chunks) - 1) + [True]
    assert b.token_ids == b_tokens + [b.token_ids[-1]] and len(b.token_ids) == len(b_tokens) + 1


def test_an_older_continuation_never_preempts_a_request_already_scheduled_in_the_step():
    # bs 1: one block per token. b (newer) decodes first and takes the last free block; a (older)
    # then needs 3 blocks. b's slots are already handed out, so a must preempt itself, not b.
    pool, s = make(5, 1, caching=False, budget=8)
    a, b = req([1, 2], max_new=3, rid="a"), req([3], max_new=4, rid="b")
    s.add(a)
    s.add(b)
    step(s)
    assert pool.num_free_blocks == 2
    a.token_ids.extend([0, 0])  # a has 3 pending tokens: a prefill continuation
    out = schedule(s)
    assert who(out) == ["b"] and out.preempted == [a]
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 2
    assert list(s.waiting) == [a] and a.num_preemptions == 1


def test_preempted_request_hashes_again_after_a_prefix_cache_reset():
    # b is preempted right after a reset, before it appended anything: on resume it restarts from
    # nothing, so its blocks are hashed again (a, alive across the reset and appending, is not).
    pool, s = make(6, 2, caching=True, budget=16)
    a, b = req([1, 2, 3, 4], max_new=4, rid="a"), req([5, 6, 7, 8], max_new=4, rid="b")
    s.add(a)
    s.add(b)
    for _ in range(3):
        step(s)
    assert pool.num_free_blocks == 0 and b.num_output_tokens == 3
    pool.reset_prefix_cache()
    out = step(s)  # a needs a block for its 7th token: b is preempted
    assert out.preempted == [b]
    assert not a.seq.is_cacheable  # block_pool: alive across the reset, so never hashed again
    s.finish(a)
    out = step(s)
    assert who(out) == ["b"] and out.num_prefix_hit_tokens == 0  # the reset forgot everything
    assert b.seq.is_cacheable and len(b.seq.block_hashes) == 3
    assert pool.num_cached_blocks == 3
    c = req(b.token_ids[:7], max_new=1, rid="c")
    s.finish(b)
    s.add(c)
    step(s)
    assert c.num_cached_tokens == 6


def test_resumed_request_hits_its_cached_full_blocks():
    pool, s = make(5, 4, caching=True, budget=16)
    a, b = req(range(8), max_new=4, rid="a"), req(range(20, 28), max_new=4, rid="b")
    s.add(a)
    s.add(b)
    step(s)  # a, b: 2 full blocks each, 1 free
    old_b_blocks = list(b.seq.block_table)
    out = step(s)  # both need a block for token 9: a gets the free one, b preempts itself
    assert out.preempted == [b] and who(out) == ["a"]
    assert pool.num_cached_blocks >= 2
    s.finish(a)
    out = step(s)
    assert who(out) == ["b"]
    e = out.scheduled[0]
    assert b.num_cached_tokens == 8 and out.num_prefix_hit_tokens == 8
    assert out.num_prefix_query_tokens == 9
    assert (e.start, e.token_ids, e.samples) == (8, [b.token_ids[8]], True)
    assert b.seq.block_table[:2] == old_b_blocks, "the resume must reuse the very same blocks"
    assert b.seq.token_ids == b.token_ids[:9]


# --- speculative drafts ---------------------------------------------------------------------------


def right_drafts(r: Request, n: int) -> list[int]:
    """The next `n` tokens the fake target would produce: drafts it accepts."""
    toks = list(r.token_ids)
    for _ in range(n):
        toks.append(fake_next(toks))
    return toks[len(r.token_ids) :]


def verify(sched: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after a forward with drafts: commit the leading drafts the target agrees
    with plus one token of its own, then roll the cache back past the last accepted draft."""
    for e in out.scheduled:
        if e.samples:
            r = e.request
            accepted = 0
            for d in e.draft_token_ids:
                if d != fake_token(r):
                    break
                r.token_ids.append(d)
                accepted += 1
            r.token_ids.append(fake_token(r))
            sched.rollback(r, len(e.draft_token_ids) - accepted)


def decoding(num_blocks=16, bs=4, budget=64, caching=True):
    pool, s = make(num_blocks, bs, caching=caching, budget=budget)
    a = req([1, 2, 3], max_new=12, rid="a")
    s.add(a)
    step(s)
    assert a.num_pending_tokens == 1 and a.num_computed_tokens == 3
    return pool, s, a


def test_drafts_ride_along_with_a_decode_and_accepted_ones_stay():
    pool, s, a = decoding()
    drafts = right_drafts(a, 3)
    last = a.token_ids[-1]
    a.spec_token_ids = list(drafts)
    out = schedule(s)
    (e,) = out.scheduled
    assert (e.start, e.token_ids, e.draft_token_ids, e.samples) == (3, [last] + drafts, drafts, True)
    assert a.num_computed_tokens == 7 and a.spec_token_ids == []
    verify(s, out)
    assert a.token_ids[4:7] == drafts and len(a.token_ids) == 8  # 3 accepted + 1 of the target
    assert a.num_computed_tokens == 7 and a.seq.token_ids == a.token_ids[:7]
    assert len(a.seq.block_table) == 2


@pytest.mark.parametrize("num_right", [0, 1, 2])
def test_rejected_drafts_are_rolled_back_and_their_blocks_freed(num_right):
    pool, s, a = decoding(bs=2)
    assert len(a.seq.block_table) == 2
    drafts = right_drafts(a, num_right) + [9] * (4 - num_right)  # 9: never the fake target's token
    a.spec_token_ids = drafts
    out = schedule(s)
    assert a.num_computed_tokens == 8 and len(a.seq.block_table) == 4
    verify(s, out)
    assert a.num_computed_tokens == 4 + num_right
    assert a.seq.token_ids == a.token_ids[: a.num_computed_tokens] and a.num_pending_tokens == 1
    assert len(a.seq.block_table) == -(-(4 + num_right) // 2)
    assert pool.num_used_blocks == len(a.seq.block_table)
    pool.check_invariants()
    out = step(s)  # the next decode continues right after the accepted prefix
    assert out.scheduled[0].start == 4 + num_right


def test_drafts_are_ignored_and_cleared_for_a_prefill_continuation():
    pool, s = make(16, 4, budget=4)
    a = req(range(10), max_new=4, rid="a")
    s.add(a)
    step(s)
    a.spec_token_ids = [1, 2]
    out = schedule(s)
    (e,) = out.scheduled
    assert e.draft_token_ids == [] and e.token_ids == list(range(4, 8)) and not e.samples
    assert a.spec_token_ids == []


def test_preemption_drops_the_victims_drafts():
    # b is preempted (by a's decode) before the loop reaches it, so its drafts were never consumed.
    # They followed its last token; re-admission samples a new one, so they must not survive.
    pool, s = make(4, 2, caching=False, budget=16)
    a, b = req([1, 2, 3, 4], max_new=3, rid="a"), req([5, 6, 7, 8], max_new=3, rid="b")
    s.add(a)
    s.add(b)
    step(s)
    assert pool.num_free_blocks == 0
    b.spec_token_ids = right_drafts(b, 1)
    out = schedule(s)
    assert out.preempted == [b] and b.spec_token_ids == []
    sample(out)
    s.finish(a)
    out = step(s)  # b re-admitted: recomputes and samples the token its drafts were meant to follow
    assert who(out) == ["b"] and out.scheduled[0].draft_token_ids == []
    out = schedule(s)  # next decode: no stale draft rides along
    assert out.scheduled[0].draft_token_ids == [] and len(out.scheduled[0].token_ids) == 1


def test_drafts_are_cut_to_the_token_budget():
    pool, s, a = decoding(budget=3)
    a.spec_token_ids = right_drafts(a, 5)
    out = schedule(s)
    (e,) = out.scheduled
    assert len(e.token_ids) == 3 and e.draft_token_ids == right_drafts(a, 2)
    assert out.num_tokens == 3


def test_drafts_never_preempt_anyone():
    # bs 1: one block per token. a and b each need one new block for their decode and exactly two
    # are free: a's drafts would need more, so they are dropped rather than preempting b.
    pool, s = make(6, 1, caching=False, budget=16)
    a, b = req([1, 2], max_new=4, rid="a"), req([3, 4], max_new=4, rid="b")
    s.add(a)
    s.add(b)
    step(s)
    assert pool.num_free_blocks == 2  # exactly one decode token each
    a.spec_token_ids = right_drafts(a, 3)
    out = schedule(s)
    assert out.preempted == [] and who(out) == ["a", "b"]
    ea = entry_of(out, a)
    assert ea.draft_token_ids == [] and len(ea.token_ids) == 1 and ea.samples
    assert a.spec_token_ids == []


# --- prefix caching on admission ------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt_len, expected_cached",
    [(10, 8), (9, 8), (8, 4), (5, 4), (4, 0), (3, 0), (1, 0)],
)
def test_prefix_hit_counts_whole_blocks_and_never_the_last_prompt_token(prompt_len, expected_cached):
    pool, s = make(16, 4, caching=True)
    prompt = list(range(40, 40 + prompt_len))
    a = req(prompt, rid="a")
    s.add(a)
    step(s)
    step(s)
    b = req(prompt, rid="b")
    s.add(b)
    out = step(s)
    eb = entry_of(out, b)
    assert b.num_cached_tokens == expected_cached
    assert out.num_prefix_hit_tokens == expected_cached
    assert out.num_prefix_query_tokens == prompt_len
    assert eb.start == expected_cached and eb.token_ids == prompt[expected_cached:]
    assert len(eb.token_ids) >= 1 and eb.samples
    assert b.num_computed_tokens == prompt_len
    nblk = expected_cached // 4
    assert b.seq.block_table[:nblk] == a.seq.block_table[:nblk]
    assert all(pool.ref_count(blk) == 2 for blk in b.seq.block_table[:nblk])
    if prompt_len % 4 == 0:
        # The last prompt block is full and cached too: it is fed to the model (its last token must
        # yield logits) but its K/V already sit in a's block, so the chunk reuses it and writes nothing.
        assert len(eb.token_ids) == 4 and eb.slots == [-1] * 4
        assert b.seq.block_table[nblk] == a.seq.block_table[nblk]
    else:
        assert -1 not in eb.slots
        assert not set(b.seq.block_table[nblk:]) & set(a.seq.block_table)


def test_prefix_hit_stops_at_the_first_differing_block():
    pool, s = make(16, 4, caching=True)
    a = req(range(12), rid="a")
    s.add(a)
    step(s)
    b = req([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12], rid="b")  # differs in block 1
    s.add(b)
    out = step(s)
    assert b.num_cached_tokens == 4 and entry_of(out, b).start == 4


def test_prefix_hit_with_a_chunked_remainder():
    pool, s = make(16, 4, caching=True, budget=1)
    prompt = list(range(10))
    a = req(prompt, rid="a")
    s.add(a)
    while not a.num_output_tokens:
        step(s)
    s.finish(a)  # its full blocks stay cached
    b = req(prompt, rid="b")
    s.add(b)
    out = step(s)
    e = entry_of(out, b)
    assert (e.start, e.token_ids, e.samples) == (8, [8], False)
    assert out.num_prefix_hit_tokens == 8 and b.num_cached_tokens == 8
    out = step(s)
    e = entry_of(out, b)
    assert (e.start, e.token_ids, e.samples) == (9, [9], True)
    assert out.num_prefix_hit_tokens == 0


def test_no_prefix_hit_when_caching_is_disabled():
    pool, s = make(16, 4, caching=False)
    prompt = list(range(10))
    a, b = req(prompt), req(prompt)
    s.add(a)
    step(s)
    s.add(b)
    out = step(s)
    assert b.num_cached_tokens == 0 and out.num_prefix_hit_tokens == 0
    assert entry_of(out, b).start == 0 and entry_of(out, b).token_ids == prompt
    assert not set(a.seq.block_table) & set(b.seq.block_table)


def test_prefix_hit_on_blocks_of_a_finished_request_revives_them():
    pool, s = make(4, 4, caching=True)
    prompt = list(range(9))
    a = req(prompt, max_new=3)
    s.add(a)
    step(s)
    a_blocks = list(a.seq.block_table)
    s.finish(a)
    assert pool.num_free_blocks == 4
    b = req(prompt, max_new=3)
    s.add(b)
    out = step(s)
    assert b.num_cached_tokens == 8 and b.seq.block_table[:2] == a_blocks[:2]
    assert pool.num_free_blocks == 1


# --- finish ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_finish_running_frees_every_block_and_is_idempotent(caching):
    pool, s = make(8, 4, caching=caching)
    rs = [req(range(i, i + 6), rid=f"f{i}") for i in range(3)]
    for r in rs:
        s.add(r)
    step(s)
    step(s)
    assert pool.num_free_blocks < pool.num_blocks
    for r in rs:
        s.finish(r)
        assert r.status == RequestStatus.FINISHED and r.num_computed_tokens == 0
        assert r.seq.block_table == [] and r not in s.running
        s.finish(r)  # again: no double free
    assert pool.num_free_blocks == pool.num_blocks and not s.has_unfinished
    pool.check_invariants()
    assert s.schedule().is_empty


def test_finish_a_waiting_request_removes_it_from_the_queue():
    pool, s = make(8, 4)
    a, b, c = req([1]), req([2]), req([3])
    for r in (a, b, c):
        s.add(r)
    s.finish(b)
    s.finish(b)
    assert list(s.waiting) == [a, c] and b.status == RequestStatus.FINISHED
    assert who(step(s)) == [a.request_id, c.request_id]
    assert pool.num_free_blocks == 6


def test_finish_a_preempted_request_and_one_mid_prefill():
    pool, s = make(6, 2, caching=False, budget=12)
    a, b, c = req([1, 2, 3, 4], max_new=4), req([5, 6, 7, 8], max_new=4), req([9, 10, 11, 12], max_new=4)
    for r in (a, b, c):
        s.add(r)
    step(s)
    out = step(s)
    assert out.preempted == [c]
    s.finish(c)  # waiting, preempted: holds no blocks
    assert not s.waiting
    long = req(range(30), max_new=1)
    s2_pool, s2 = make(20, 4, budget=4)
    s2.add(long)
    step(s2)
    assert 0 < long.num_computed_tokens < 30
    s2.finish(long)  # running, mid-prefill
    assert s2_pool.num_free_blocks == 20 and not s2.has_unfinished
    s.finish(a)
    s.finish(b)
    assert pool.num_free_blocks == 6


def test_finish_keeps_blocks_shared_with_a_live_request():
    pool, s = make(16, 4, caching=True)
    prompt = list(range(12))
    a, b = req(prompt), req(prompt)
    s.add(a)
    step(s)
    s.add(b)
    step(s)
    shared = b.seq.block_table[:2]
    s.finish(a)
    assert all(pool.ref_count(blk) == 1 for blk in shared)
    assert b.seq.block_table[:2] == shared and pool.num_used_blocks == len(b.seq.block_table)
    s.finish(b)
    assert pool.num_free_blocks == pool.num_blocks


def test_finish_with_keep_kv_hands_over_the_sequence_and_a_new_request_continues_it():
    """A finished request's sequence kept for its caller (a returned cache), then handed to a new
    request whose prompt extends it: admission starts after the held tokens, with the partial last
    block appended to in place, and only the rest is scheduled."""
    pool, s = make(16, 4)
    first = req(range(1, 7), max_new=3)
    s.add(first)
    step(s)  # 6 prompt tokens, then one sampled
    step(s)
    kept = s.finish(first, keep_kv=True)
    assert kept is not None and kept.num_tokens == 7 and first.seq.num_tokens == 0
    assert first.status == RequestStatus.FINISHED and pool.num_used_blocks == 2  # held, not freed
    assert s.finish(first, keep_kv=True) is None  # idempotent
    tokens, blocks = list(kept.token_ids), list(kept.block_table)
    nxt = Request(request_id="next", token_ids=tokens + [fake_next(tokens), 9, 9], num_prompt_tokens=10,
                  max_total_tokens=14, seq=kept)
    s.add(nxt)
    out = s.schedule()
    (entry,) = out.scheduled
    assert entry.start == 7 and entry.token_ids == nxt.token_ids[7:] and entry.samples
    assert out.num_prefix_hit_tokens == 0 and out.num_prefix_query_tokens == 3
    assert nxt.seq is kept and kept.block_table[:2] == blocks and pool.num_used_blocks == 3  # no copy
    s.finish(nxt)
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


def test_release_waiting_frees_handed_over_prefixes_which_then_recompute():
    pool, s = make(8, 4)
    first = req(range(1, 7), max_new=2)
    s.add(first)
    step(s)
    kept = s.finish(first, keep_kv=True)
    waiting = Request(request_id="w", token_ids=list(kept.token_ids) + [3], num_prompt_tokens=7, max_total_tokens=9,
                      seq=kept)
    s.add(waiting)
    assert pool.num_used_blocks == 2 and s.release_waiting() and pool.num_used_blocks == 0
    assert not s.release_waiting()  # nothing left to free
    out = s.schedule()
    # Recomputed: its one full block from the prefix cache (published when it was computed), the rest anew.
    assert entry_of(out, waiting).start == 4 and out.num_prefix_hit_tokens == 4
    pool.check_invariants()


# --- liveness under heavy preemption --------------------------------------------------------------


def run_to_completion(sched: Scheduler, arrivals: list[tuple[int, Request, int]], max_steps: int):
    """Drive the scheduler like an engine. `arrivals`: (step to add at, request, outputs wanted).

    Returns {request_id: (step added, step finished)} and checks every step on the way."""
    pending = sorted(arrivals, key=lambda t: t[0])
    target = {r.request_id: n for _, r, n in arrivals}
    added, finished = {}, {}
    t = 0
    while pending or sched.has_unfinished:
        while pending and pending[0][0] <= t:
            _, r, _ = pending.pop(0)
            sched.add(r)
            added[r.request_id] = t
        if sched.has_unfinished:
            out = schedule(sched)
            assert not out.is_empty, "a step scheduled nothing although requests are unfinished"
            for e in out.scheduled:
                if e.samples:
                    r = e.request
                    r.token_ids.append(fake_token(r))
                    assert len(r.token_ids) <= r.max_total_tokens
                    if r.num_output_tokens == target[r.request_id]:
                        sched.finish(r)
                        finished[r.request_id] = t
        t += 1
        assert t <= max_steps, f"not done after {max_steps} steps: {len(finished)}/{len(arrivals)} finished"
    return {rid: (added[rid], finished[rid]) for rid in target}


@pytest.mark.parametrize("bs", [1, 4, 16])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_starvation_with_a_tiny_pool(bs, caching, seed):
    rng = random.Random(seed * 100 + bs)
    max_total = max(4 * bs, 12) + rng.randint(0, bs)  # every request needs most of the pool
    num_blocks = -(-max_total // bs) + 1
    pool, s = make(num_blocks, bs, caching=caching, max_num_seqs=4, budget=rng.choice([3, 8, 64]))
    arrivals = []
    for i in range(12):
        plen = rng.randint(1, max_total // 2)
        shared = [7] * (plen // 2)  # common prefix: prefix hits happen
        prompt = shared + [rng.randint(0, 9) for _ in range(plen - len(shared))]
        r = req(prompt, max_new=max_total - plen)
        # Most requests grow to their full length, so running ones collide in the pool.
        arrivals.append((rng.randint(0, 6), r, rng.choice([max_total - plen, max_total - plen, 1])))
    total_tokens = sum(r.max_total_tokens for _, r, _ in arrivals)
    spans = run_to_completion(s, arrivals, max_steps=2 * total_tokens)
    assert s.num_preemptions >= 2, "the scenario is meant to force preemptions"
    assert sum(r.num_preemptions for _, r, _ in arrivals) == s.num_preemptions
    for _, r, n in arrivals:
        assert r.status == RequestStatus.FINISHED and r.num_output_tokens == n
    # No request waits for more than the total work of everyone (FIFO: nobody overtakes it forever).
    assert max(end - start for start, end in spans.values()) <= total_tokens
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()
    assert not s.running and not s.waiting


@pytest.mark.parametrize("caching", [True, False])
def test_a_long_request_is_not_starved_by_a_stream_of_short_ones(caching):
    # Short requests arrive every step; a long prompt (chunked, needing most of the pool) arrives
    # while they run. It is preempted at least once, yet FIFO admission gets it through quickly.
    pool, s = make(8, 4, caching=caching, max_num_seqs=8, budget=8)
    long = req(range(100, 124), max_new=4, rid="long")  # 24 tokens: 6 blocks, 3 chunks
    arrivals = [(10, long, 4)]
    for i in range(80):
        arrivals.append((i, req([i % 7, 1, 2], max_new=6, rid=f"s{i}"), 6))
    total_tokens = sum(r.max_total_tokens for _, r, _ in arrivals)
    spans = run_to_completion(s, arrivals, max_steps=4 * total_tokens)
    start, end = spans["long"]
    assert long.num_preemptions >= 1, "the scenario is meant to preempt the long request"
    assert end - start <= 40, f"the long request took {end - start} steps"
    assert end < max(e for _, e in spans.values()) - 60, "it only finished once the stream dried up"
    assert pool.num_free_blocks == pool.num_blocks


# --- state machine --------------------------------------------------------------------------------

# New prompts are a prefix of one of these plus a random tail, so whole blocks repeat (prefix hits).
BASE_PROMPTS = [list(range(1, 18)), [1, 2, 3, 4, 0, 0, 0, 0, 0], [5] * 20]


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step (schedule + fake sample + finish at target) / abort, with a model of every
    KV slot: `content[block][offset]` is the prefix (as a tuple) whose last token's K/V the engine
    would have written there. A running request must read back exactly its own prefixes."""

    def __init__(self):
        super().__init__()
        self.pool: BlockPool
        self.sched: Scheduler
        self.bs = 1
        self.content: list[list[tuple | None]] = []
        self.live: dict[str, Request] = {}
        self.target: dict[str, int] = {}
        self.next_id = 0

    @initialize(
        bs=st.sampled_from([1, 4, 16]),
        blocks_for_longest=st.sampled_from([0, 1, 2, 4, 8, 0]),
        caching=st.sampled_from([True, True, False]),
        max_num_seqs=st.sampled_from([2, 3, 4, 8, 1]),
        budget=st.sampled_from([1, 2, 5, 16, 64]),
        speculate=st.booleans(),
    )
    def setup(self, bs, blocks_for_longest, caching, max_num_seqs, budget, speculate):
        self.bs = bs
        self.speculate = speculate
        self.max_total = 24  # any request: prompt + outputs <= 24 tokens
        num_blocks = -(-self.max_total // bs) + blocks_for_longest
        self.pool = BlockPool(num_blocks, enable_prefix_caching=caching)
        self.sched = Scheduler(BlockManager(self.pool, bs), max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=budget)
        self.content = [[None] * bs for _ in range(num_blocks)]

    # ------------------------------------------------------------ rules
    @precondition(lambda self: len(self.live) < 8)
    @rule(data=st.data())
    def add(self, data):
        for _ in range(data.draw(st.integers(1, 3), label="how many")):
            base = data.draw(st.sampled_from(BASE_PROMPTS), label="base")
            cut = data.draw(st.integers(0, len(base)), label="prefix")
            tail = data.draw(st.lists(st.integers(0, 3), max_size=6), label="tail")
            prompt = (base[:cut] + tail)[: self.max_total - 1] or [0]
            room = self.max_total - len(prompt)
            max_new = data.draw(st.just(room) | st.integers(1, room), label="max_new")
            r = req(prompt, max_new=max_new, rid=f"m{self.next_id}")
            self.next_id += 1
            self.sched.add(r)
            self.live[r.request_id] = r
            self.target[r.request_id] = data.draw(st.just(max_new) | st.integers(1, max_new), label="outputs")

    @precondition(lambda self: self.sched.has_unfinished)
    @rule(data=st.data())
    def step(self, data):
        self._step(data)

    @precondition(lambda self: self.sched.has_unfinished)
    @rule(data=st.data(), n=st.integers(2, 12))
    def run_steps(self, data, n):
        for _ in range(n):
            if self.sched.has_unfinished:
                self._step(data)
                self.check_all()

    def _propose(self, data) -> dict[str, list[int]]:
        """Speculation, when enabled: drafts for some running requests, a right prefix then junk,
        never past the request's target (as the engine caps them). The engine only drafts for
        decodes; drafts offered to a prefill continuation must be ignored."""
        proposed = {}
        if not self.speculate:
            return proposed
        for r in self.sched.running:
            room = self.target[r.request_id] - r.num_output_tokens - 1
            if room > 0:
                k = data.draw(st.integers(0, min(3, room)), label=f"drafts {r.request_id}")
                right = data.draw(st.integers(0, k), label=f"right {r.request_id}")
                r.spec_token_ids = right_drafts(r, right) + [9] * (k - right)
                proposed[r.request_id] = list(r.spec_token_ids)
        return proposed

    def _step(self, data):
        sched, pool, bs = self.sched, self.pool, self.bs
        proposed = self._propose(data)
        before = {rid: (r.status, r.num_computed_tokens, r.num_pending_tokens)
                  for rid, r in self.live.items()}
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        out = schedule(sched)
        assert not out.is_empty, "nothing scheduled although requests are unfinished"
        # Decodes of requests already running come before their prefill continuations, and a
        # continuation only gets tokens once every (non-preempted) decode has its one.
        cont_seen = False
        for e in out.scheduled:
            status, _, pending = before[e.request.request_id]
            if status != RequestStatus.RUNNING:
                continue
            if pending > 1:
                cont_seen = True
            else:
                assert not cont_seen, "a decode was scheduled after a prefill continuation"
        if cont_seen:
            scheduled = {e.request.request_id for e in out.scheduled}
            for r in running_before:
                if before[r.request_id][2] == 1 and r not in out.preempted:
                    assert r.request_id in scheduled, "a decode was skipped for a continuation"
        # Admitted requests: FIFO, and the prefix hit never covers the last token.
        admitted = [e for e in out.scheduled if before[e.request.request_id][0] == RequestStatus.WAITING]
        assert [e.request for e in admitted] == waiting_before[: len(admitted)], "admission is not FIFO"
        for e in admitted:
            assert e.start == e.request.num_cached_tokens and e.start % bs == 0
            assert e.start < len(e.request.token_ids)
            assert not out.preempted, "admission in a step that preempted"
        assert out.num_prefix_hit_tokens == sum(e.start for e in admitted)
        assert out.num_prefix_query_tokens == sum(len(e.request.token_ids) for e in admitted)
        if not pool.enable_prefix_caching:
            assert out.num_prefix_hit_tokens == 0
        # Running requests that were neither scheduled nor preempted only happen when out of budget.
        if out.num_tokens < sched.max_num_batched_tokens:
            scheduled = {e.request.request_id for e in out.scheduled}
            for r in sched.running:
                assert r.request_id in scheduled, "a running request was skipped with budget left"
        # Drafts: only a prefix of what was proposed, only on a decode, and consumed either way.
        for e in out.scheduled:
            assert proposed.get(e.request.request_id, [])[: len(e.draft_token_ids)] == e.draft_token_ids
            if e.draft_token_ids:
                assert before[e.request.request_id][:1] == (RequestStatus.RUNNING,)
                assert before[e.request.request_id][2] == 1, "drafts on a prefill continuation"
        # The engine: apply copies, write K/V of every scheduled token (drafts included), then
        # commit: accepted drafts plus one sampled token, finish at target, else roll back.
        for src, dst in out.copies:
            self.content[dst] = list(self.content[src])
        for e in out.scheduled:
            r = e.request
            for j, slot in enumerate(e.slots):
                pos = e.start + j
                prefix = tuple(r.token_ids[: e.start] + e.token_ids[: j + 1])
                if slot == -1:  # a prefix hit claims the K/V is already there: check the claim
                    block = r.seq.block_table[pos // bs]
                    assert self.content[block][pos % bs] == prefix
                else:
                    self.content[slot // bs][slot % bs] = prefix
        for e in out.scheduled:
            if not e.samples:
                continue
            r = e.request
            accepted = 0
            for d in e.draft_token_ids:
                if d != fake_token(r):
                    break
                r.token_ids.append(d)
                accepted += 1
            r.token_ids.append(fake_token(r))
            assert len(r.token_ids) <= r.max_total_tokens
            if r.num_output_tokens >= self.target[r.request_id]:
                self._finish(r)
            else:
                sched.rollback(r, len(e.draft_token_ids) - accepted)

    @precondition(lambda self: any(r.num_pending_tokens == 1 for r in self.sched.running))
    @rule(data=st.data())
    def inject(self, data):
        # The caller appends several tokens at once (forced tokens, a tool result): the request
        # turns from a decode into a prefill continuation.
        decoding = [r for r in self.sched.running if r.num_pending_tokens == 1]
        r = data.draw(st.sampled_from(decoding), label="inject")
        room = min(r.max_total_tokens - len(r.token_ids), self.target[r.request_id] - r.num_output_tokens) - 1
        if room >= 1:
            tokens = st.lists(st.integers(0, 3), min_size=1, max_size=min(room, 6))
            r.token_ids.extend(data.draw(tokens, label="tokens"))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)), label="abort")
        self._finish(self.live[rid])

    def _finish(self, r: Request) -> None:
        self.sched.finish(r)
        del self.live[r.request_id]
        assert r.status == RequestStatus.FINISHED and r.seq.block_table == []
        assert r not in self.sched.running and r not in self.sched.waiting

    # ------------------------------------------------------------ invariants
    def check_all(self):
        self.pool_is_consistent()
        self.queues_partition_live_requests()
        self.running_requests_hold_exactly_their_computed_prefix()
        self.every_block_is_free_or_referenced()

    @invariant()
    def pool_is_consistent(self):
        self.pool.check_invariants()

    @invariant()
    def queues_partition_live_requests(self):
        s = self.sched
        assert len(s.running) <= s.max_num_seqs
        running, waiting = {r.request_id for r in s.running}, {r.request_id for r in s.waiting}
        assert not running & waiting and running | waiting == set(self.live)
        assert len(running) == len(s.running) and len(waiting) == len(s.waiting)
        for r in s.running:
            assert r.status == RequestStatus.RUNNING
        for r in s.waiting:
            assert r.status == RequestStatus.WAITING
            assert r.num_computed_tokens == 0 and r.seq.num_tokens == 0 and r.seq.block_table == []

    @invariant()
    def running_requests_hold_exactly_their_computed_prefix(self):
        bs = self.bs
        for r in self.sched.running:
            seq = r.seq
            assert 1 <= r.num_computed_tokens <= len(r.token_ids)
            assert seq.num_tokens == r.num_computed_tokens
            assert seq.token_ids == r.token_ids[: r.num_computed_tokens]
            assert len(seq.block_table) == -(-seq.num_tokens // bs)
            assert len(set(seq.block_table)) == len(seq.block_table)
            # The model content: every computed position holds the K/V of its own prefix.
            for pos in range(seq.num_tokens):
                got = self.content[seq.block_table[pos // bs]][pos % bs]
                assert got == tuple(r.token_ids[: pos + 1]), (
                    f"{r.request_id} position {pos} reads K/V of {got}"
                )

    @invariant()
    def every_block_is_free_or_referenced(self):
        counts = [0] * self.pool.num_blocks
        for r in self.sched.running:
            for b in r.seq.block_table:
                counts[b] += 1
        assert self.pool.ref_counts == counts
        assert self.pool.num_free_blocks == counts.count(0)

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for r in list(self.live.values()):
            self._finish(r)
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert not self.sched.has_unfinished and self.sched.schedule().is_empty
        self.pool.check_invariants()


SchedulerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase


def test_blocks_staged_by_a_failed_step_are_never_found_again():
    """A step's filled blocks are findable by that step only (its forward writes them before any
    attention reads them). After the step fails, a block it staged can be reused by another request:
    its old hash must find nothing."""
    pool = BlockPool(2)
    s = Scheduler(BlockManager(pool, 2), max_num_seqs=2, max_num_batched_tokens=16)
    s.add(Request("a", [1, 2, 3], 3, 4, KVSequence(0)))
    out = s.schedule()
    (block, block_hash), = out.new_full_blocks
    assert pool.lookup(block_hash) == block and pool.is_staged(block)  # within its own step
    s.recover()  # the forward failed: nothing was published
    s.finish(s.waiting[0])
    s.add(Request("b", [5, 6, 7], 3, 4, KVSequence(1)))
    out = s.schedule()
    assert block in out.scheduled[0].request.seq.block_table  # the block now holds b's tokens
    assert pool.lookup(block_hash) is None
    pool.check_invariants()


def test_prefill_chunks_never_end_inside_an_atomic_span():
    """An image attended both ways (Gemma 3) is computed in one chunk: a chunk that would end inside it is
    cut at its start, and one starting there waits for a budget that holds it whole."""
    pool, sched = make(64, 4, budget=10)
    r = req(range(1, 41), max_new=2)
    r.atomic_spans = ((6, 14), (20, 28))
    assert r.fit_chunk(0, 10) == 6 and r.fit_chunk(6, 10) == 10 and r.fit_chunk(16, 8) == 4
    assert r.fit_chunk(21, 6) == 0 and r.fit_chunk(21, 7) == 7
    other = req(range(50, 53), max_new=30)
    sched.add(other)
    sched.add(r)
    chunks = []
    while r.num_computed_tokens < r.num_prompt_tokens:
        out = sched.schedule()
        chunks += [(e.start, e.start + len(e.token_ids)) for e in out.scheduled if e.request is r]
        sample(out)
    ends = [end for _, end in chunks]
    assert all(not (s < end < e) for end in ends for s, e in r.atomic_spans)
    assert chunks[0][0] == 0 and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])) and ends[-1] == 40
    pool.check_invariants()
