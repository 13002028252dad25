"""Tests for the torch-free bookkeeping of per-sequence recurrent state (`core.state_slots`): which row of
the state pool holds which sequence's state, the prefix-cache checkpoints (LRU, bounded, keyed by the
hash of the block that ends at their boundary), what a step copies out (`plan_chunk`), how speculative
rollback settles on a snapshot (`settle`), where a prefix hit may end (`restore_point`), and how the
block manager and the scheduler use them (rows freed with the blocks, hits capped at a kept checkpoint,
checkpoints forgotten with their blocks).

Block sizes are small (4) and the interval a multiple of them (4 or 8), so a few tokens cross boundaries.
"""

from __future__ import annotations

import pytest

from hf_paged.core.block_pool import BlockManager, BlockPool
from hf_paged.core.scheduler import Request, RequestStatus, Scheduler
from hf_paged.core.sequence import KVSequence
from hf_paged.core.state_slots import (NoFreeStateRowsError, StateSlots, assign_row, plan_chunk, release_rows,
                                       restore_point, settle)
from hf_paged.kv_spec import FullAttention, SlidingWindow

BS = 4


def taken(slots: StateSlots) -> list[int]:
    return [row for row in range(slots.num_rows) if not slots._free[row]]


def seq_with_hashes(num_blocks: int, seq_id: int = 0) -> KVSequence:
    """A sequence whose first `num_blocks` blocks are hashed (fake hashes 100, 101, ...)."""
    seq = KVSequence(seq_id=seq_id)
    seq.block_hashes = [100 + i for i in range(num_blocks)]
    return seq


# --------------------------------------------------------------------------------- sequence rows
@pytest.mark.parametrize("kwargs", [dict(num_rows=0), dict(num_rows=True), dict(num_rows=4, max_checkpoints=-1),
                                    dict(num_rows=4, interval=0), dict(num_rows=4, interval=2.0),
                                    dict(num_rows=4, max_checkpoints=4)])
def test_constructor_rejects_bad_counts(kwargs):
    with pytest.raises(ValueError, match="num_rows|max_checkpoints|interval"):
        StateSlots(**kwargs)


def test_allocate_takes_the_first_contiguous_run_and_release_frees_it():
    slots = StateSlots(8)
    assert slots.allocate(3) == 0 and slots.allocate(1) == 3 and slots.allocate(2) == 4
    assert slots.num_free == 2
    slots.release(0, 3)
    slots.release(4, 2)
    # free: 0 1 2 . 4 5 6 7 -> a run of 4 starts at 4, one of 3 at 0
    assert slots.allocate(4) == 4
    assert slots.allocate(3) == 0
    assert taken(slots) == list(range(8)) and slots.num_free == 0


@pytest.mark.parametrize("start, count", [(-1, 1), (7, 2), (8, 1)])
def test_release_outside_the_pool_is_refused(start, count):
    slots = StateSlots(8)
    slots.allocate(8)
    with pytest.raises(ValueError, match="outside the pool"):
        slots.release(start, count)


def test_double_release_is_refused_and_bad_counts_too():
    slots = StateSlots(4)
    row = slots.allocate(1)
    slots.release(row)
    with pytest.raises(ValueError, match="already free"):
        slots.release(row)
    for bad in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="count"):
            slots.allocate(bad)
    assert slots.num_free == 4


def test_a_full_fixed_pool_raises_no_free_rows():
    slots = StateSlots(4)
    slots.allocate(2)
    slots.allocate(1)
    with pytest.raises(NoFreeStateRowsError):
        slots.allocate(2)  # one row free, not a run of two
    assert slots.num_free == 1 and slots.allocate(1) == 3


def test_a_pool_with_on_grow_grows_and_tells_the_tensors():
    slots = StateSlots(4)
    grown = []
    slots.on_grow = grown.append
    assert slots.allocate(4) == 0
    start = slots.allocate(3)
    assert start == 4 and slots.num_rows >= 7 and grown == [slots.num_rows]
    assert taken(slots) == list(range(7)) and slots.num_free == slots.num_rows - 7
    slots.grow(2)  # never shrinks
    assert grown == [slots.num_rows]


def test_assign_row_once_and_release_rows_frees_everything_the_sequence_holds():
    slots = StateSlots(8, max_checkpoints=2)
    seq = KVSequence(seq_id=0)
    assign_row(slots, seq)
    row = seq.state_row
    assign_row(slots, seq)  # admitted again with its row (a kept sequence): no second row
    assert seq.state_row == row and slots.num_free == 7
    seq.state_snapshots = {5: slots.allocate(1), 6: slots.allocate(1)}
    seq.state_checkpoints = [(123, slots.reserve_checkpoint())]
    seq.state_saves = [(1, 9)]
    slots.copy_later(7, row)  # a copy into its row, pending for the next step: dropped with the row
    release_rows(slots, seq)
    assert slots.num_free == 8 and slots.num_checkpoints == 0 and slots.pending_copies == {}
    assert (seq.state_row, seq.state_saves, seq.state_snapshots, seq.state_checkpoints) == (None, [], {}, [])
    release_rows(slots, seq)  # nothing left: a no-op, not a double free
    assert slots.num_free == 8


# --------------------------------------------------------------------------------- checkpoints
def test_a_reserved_checkpoint_is_findable_only_once_published():
    slots = StateSlots(4, max_checkpoints=2)
    row = slots.reserve_checkpoint()
    assert row is not None and not slots.has(7) and slots.lookup(7) is None
    slots.publish(7, row)
    assert slots.has(7) and slots.lookup(7) == row and slots.num_checkpoints == 1


def test_publishing_a_key_already_kept_keeps_the_first_row_and_frees_the_new():
    slots = StateSlots(4, max_checkpoints=2)
    first, second = slots.reserve_checkpoint(), slots.reserve_checkpoint()
    slots.publish(7, first)
    slots.publish(7, second)
    assert slots.lookup(7) == first and slots.num_checkpoints == 1
    assert taken(slots) == [first]


def test_checkpoints_are_evicted_least_recently_used_first_at_the_bound():
    slots = StateSlots(8, max_checkpoints=2)
    a, b = slots.reserve_checkpoint(), slots.reserve_checkpoint()
    slots.publish("a", a)
    slots.publish("b", b)
    assert slots.lookup("a") == a  # "a" becomes the most recently used
    c = slots.reserve_checkpoint()  # at the bound: "b" goes
    slots.publish("c", c)
    assert slots.has("a") and slots.has("c") and not slots.has("b")
    assert slots.num_checkpoints == 2 and sorted(taken(slots)) == sorted([a, c])


def test_has_does_not_refresh_a_checkpoint():
    slots = StateSlots(8, max_checkpoints=2)
    for key in ("a", "b"):
        slots.publish(key, slots.reserve_checkpoint())
    assert slots.has("a")
    slots.publish("c", slots.reserve_checkpoint())
    assert not slots.has("a") and slots.has("b")


def test_no_checkpoints_when_max_checkpoints_is_zero():
    slots = StateSlots(4, max_checkpoints=0)
    assert slots.reserve_checkpoint() is None and slots.num_free == 4


def test_reserve_gives_none_when_sequences_hold_every_row():
    slots = StateSlots(3, max_checkpoints=2)
    slots.allocate(3)
    assert slots.reserve_checkpoint() is None


def test_a_sequence_row_evicts_the_oldest_checkpoint_before_the_pool_grows():
    slots = StateSlots(4, max_checkpoints=2)
    grown = []
    slots.on_grow = grown.append
    a, b = slots.reserve_checkpoint(), slots.reserve_checkpoint()
    slots.publish("a", a)
    slots.publish("b", b)
    slots.allocate(2)
    assert slots.allocate(1) == a and not slots.has("a") and slots.has("b") and not grown
    assert slots.allocate(1) == b and slots.num_checkpoints == 0 and not grown
    slots.allocate(1)
    assert grown  # no checkpoint left to evict: now it grows


def test_drop_and_drop_all_free_the_rows():
    slots = StateSlots(6, max_checkpoints=3)
    for key in ("a", "b", "c"):
        slots.publish(key, slots.reserve_checkpoint())
    slots.drop("b")
    slots.drop("missing")  # a block with no checkpoint: nothing to do
    assert not slots.has("b") and slots.num_checkpoints == 2 and slots.num_free == 4
    slots.drop_all()
    assert slots.num_checkpoints == 0 and slots.num_free == 6


# --------------------------------------------------------------------------------- plan_chunk
def test_a_chunk_that_verifies_drafts_snapshots_after_every_token_but_the_last():
    slots = StateSlots(16, max_checkpoints=4, interval=BS)
    seq = seq_with_hashes(10)
    assign_row(slots, seq)
    plan_chunk(slots, seq, start=20, num_new=4, num_drafts=3, block_size=BS)
    rows = [row for _, row in seq.state_saves]
    assert [k for k, _ in seq.state_saves] == [1, 2, 3]
    assert seq.state_snapshots == {21: rows[0], 22: rows[1], 23: rows[2]}
    assert len(set(rows) | {seq.state_row}) == 4
    assert seq.state_checkpoints == [] and slots.num_checkpoints == 0  # a verify step keeps no checkpoint


def test_snapshots_of_an_earlier_step_are_freed_when_the_next_is_planned():
    slots = StateSlots(16, interval=BS)
    seq = seq_with_hashes(0)
    assign_row(slots, seq)
    plan_chunk(slots, seq, start=5, num_new=3, num_drafts=2, block_size=BS)
    assert slots.num_free == 16 - 3
    plan_chunk(slots, seq, start=8, num_new=1, num_drafts=0, block_size=BS)
    assert seq.state_snapshots == {} and seq.state_saves == [] and slots.num_free == 15


@pytest.mark.parametrize("start, num_new, boundaries", [(0, 20, [8, 16]), (5, 11, [8, 16]), (8, 8, [16]),
                                                        (9, 6, []), (0, 7, [])])
def test_checkpoints_are_planned_at_interval_boundaries_the_chunk_crosses(start, num_new, boundaries):
    slots = StateSlots(16, max_checkpoints=8, interval=8)
    seq = seq_with_hashes(5)
    assign_row(slots, seq)
    plan_chunk(slots, seq, start, num_new, num_drafts=0, block_size=BS)
    assert [k + start for k, _ in seq.state_saves] == boundaries
    # keyed by the hash of the block that ends at the boundary
    assert [key for key, _ in seq.state_checkpoints] == [100 + b // BS - 1 for b in boundaries]
    assert [row for _, row in seq.state_saves] == [row for _, row in seq.state_checkpoints]
    assert seq.state_snapshots == {} and slots.num_checkpoints == 0  # published only when the step commits


def test_no_checkpoint_at_a_boundary_whose_block_is_not_hashed():
    slots = StateSlots(16, max_checkpoints=8, interval=BS)
    seq = seq_with_hashes(2)  # 8 tokens hashed (prefix caching off after that, or unknown tokens)
    assign_row(slots, seq)
    plan_chunk(slots, seq, 0, 16, num_drafts=0, block_size=BS)
    assert [k for k, _ in seq.state_saves] == [4, 8]


def test_no_checkpoint_where_one_is_already_kept():
    slots = StateSlots(16, max_checkpoints=8, interval=BS)
    slots.publish(101, slots.reserve_checkpoint())  # the state after 8 tokens of this prefix
    seq = seq_with_hashes(3)
    assign_row(slots, seq)
    plan_chunk(slots, seq, 0, 12, num_drafts=0, block_size=BS)
    assert [(k, key) for (k, _), (key, _) in zip(seq.state_saves, seq.state_checkpoints)] == [(4, 100), (12, 102)]


def test_no_checkpoints_planned_without_checkpoint_rows():
    slots = StateSlots(16, max_checkpoints=0, interval=BS)
    seq = seq_with_hashes(4)
    assign_row(slots, seq)
    plan_chunk(slots, seq, 0, 16, num_drafts=0, block_size=BS)
    assert seq.state_saves == [] and slots.num_free == 15


def test_planning_stops_when_no_row_is_left_for_a_checkpoint():
    slots = StateSlots(3, max_checkpoints=2, interval=BS)
    seq = seq_with_hashes(4)
    other = KVSequence(seq_id=1)
    assign_row(slots, seq)
    assign_row(slots, other)
    plan_chunk(slots, seq, 0, 16, num_drafts=0, block_size=BS)
    assert [k for k, _ in seq.state_saves] == [16]  # one row was free: the boundary nearest the chunk's end


# --------------------------------------------------------------------------------- settle
def _verifying(num_drafts=3, start=20):
    slots = StateSlots(16, interval=BS)
    seq = seq_with_hashes(0)
    assign_row(slots, seq)
    plan_chunk(slots, seq, start, num_drafts + 1, num_drafts, BS)
    return slots, seq


def test_settle_keeping_every_token_keeps_the_row_and_frees_the_snapshots():
    slots, seq = _verifying()
    row = seq.state_row
    assert settle(slots, seq, computed=24, kept=24)
    assert seq.state_row == row and seq.state_snapshots == {} and taken(slots) == [row]


@pytest.mark.parametrize("kept", [21, 22, 23])
def test_settle_on_a_snapshot_swaps_it_in_as_the_state_row(kept):
    slots, seq = _verifying()
    snapshot = seq.state_snapshots[kept]
    assert settle(slots, seq, computed=24, kept=kept)
    assert seq.state_row == snapshot and seq.state_snapshots == {} and taken(slots) == [snapshot]


def test_settle_without_a_snapshot_there_says_so_and_frees_the_snapshots():
    slots, seq = _verifying()
    row = seq.state_row
    assert not settle(slots, seq, computed=24, kept=20)  # before the chunk: the caller recomputes
    assert seq.state_row == row and seq.state_snapshots == {} and taken(slots) == [row]


# --------------------------------------------------------------------------------- restore_point
def test_restore_point_is_the_last_kept_boundary_within_the_hit():
    slots = StateSlots(8, max_checkpoints=4, interval=8)
    hashes = [100, 101, 102, 103, 104]
    assert restore_point(slots, hashes, 5, BS) == 0
    slots.publish(101, slots.reserve_checkpoint())  # 8 tokens
    assert restore_point(slots, hashes, 5, BS) == 2
    assert restore_point(slots, hashes, 1, BS) == 0  # the hit ends before it
    slots.publish(102, slots.reserve_checkpoint())  # 12 tokens: not a boundary of the interval
    assert restore_point(slots, hashes, 5, BS) == 2
    slots.publish(103, slots.reserve_checkpoint())  # 16 tokens
    assert restore_point(slots, hashes, 5, BS) == 4
    assert restore_point(slots, hashes, 3, BS) == 2


# --------------------------------------------------------------------------------- BlockManager
def manager(num_blocks=16, interval=BS, max_checkpoints=4, specs=None):
    pool = BlockPool(num_blocks)
    mgr = BlockManager(pool, BS, specs)
    slots = StateSlots(16, max_checkpoints=max_checkpoints, interval=interval)
    mgr.use_state_slots(slots)
    return pool, mgr, slots


def prefill(mgr, slots, tokens, seq_id=0, publish=True) -> KVSequence:
    """A sequence that computed `tokens` with checkpoints at every boundary (published, as a committed
    step does)."""
    seq = KVSequence(seq_id=seq_id)
    mgr.append_tokens(seq, tokens)
    assign_row(slots, seq)
    plan_chunk(slots, seq, 0, len(tokens), 0, BS)
    for key, row in seq.state_checkpoints:
        if publish:
            slots.publish(key, row)
        else:
            slots.release(row)
    seq.state_checkpoints = []
    return seq


def test_free_releases_the_sequences_rows():
    pool, mgr, slots = manager()
    seq = prefill(mgr, slots, list(range(10)))
    seq.state_snapshots = {11: slots.allocate(1)}
    assert slots.num_free == 16 - 2 - 2  # its row, a snapshot, 2 checkpoints
    mgr.free(seq)
    assert seq.state_row is None and slots.num_free == 16 - 2  # the checkpoints stay, keyed by cached blocks
    assert slots.num_checkpoints == 2


def test_a_prefix_hit_ends_at_the_last_kept_checkpoint():
    prompt = list(range(14))  # 3 full blocks
    pool, mgr, slots = manager(interval=8)
    first = prefill(mgr, slots, prompt)
    assert slots.num_checkpoints == 1  # at 8 (12 is not a multiple of 8)
    mgr.free(first)
    assert mgr.num_cached_prefix_tokens(KVSequence(seq_id=1), prompt) == 8  # 12 tokens of blocks, state at 8
    slots.drop_all()
    assert mgr.num_cached_prefix_tokens(KVSequence(seq_id=2), prompt) == 0  # blocks without a state: no hit


def test_a_prefix_hit_takes_every_block_when_each_boundary_is_kept():
    prompt = list(range(14))
    pool, mgr, slots = manager(interval=BS)
    mgr.free(prefill(mgr, slots, prompt))
    assert mgr.num_cached_prefix_tokens(KVSequence(seq_id=1), prompt) == 12
    slots.drop(_hash_at(prompt, 3))
    assert mgr.num_cached_prefix_tokens(KVSequence(seq_id=2), prompt) == 8


def _hash_at(tokens, num_blocks):
    """The hash of block `num_blocks - 1` of `tokens` (the key of the checkpoint after it)."""
    seq = KVSequence(seq_id=99)
    pool = BlockPool(8)
    BlockManager(pool, BS).append_tokens(seq, tokens[: num_blocks * BS])
    return seq.block_hashes[num_blocks - 1]


def test_a_prefix_hit_with_a_sliding_group_also_ends_at_a_kept_checkpoint():
    prompt = list(range(18))  # 4 full blocks
    pool, mgr, slots = manager(num_blocks=32, interval=8, specs=(FullAttention(), SlidingWindow(window=3)))
    mgr.free(prefill(mgr, slots, prompt))
    assert mgr.num_cached_prefix_tokens(KVSequence(seq_id=1), prompt) == 16
    slots.drop(_hash_at(prompt, 4))
    assert mgr.num_cached_prefix_tokens(KVSequence(seq_id=2), prompt) == 8


def test_a_block_evicted_from_the_pool_takes_its_checkpoint_along():
    prompt = list(range(9))  # 2 full blocks
    pool, mgr, slots = manager(num_blocks=4, interval=BS)
    mgr.free(prefill(mgr, slots, prompt))
    assert slots.num_checkpoints == 2 and pool.num_cached_blocks == 2
    free_rows = slots.num_free
    other = KVSequence(seq_id=5)
    mgr.append_tokens(other, [50 + t for t in range(13)])  # needs all 4 blocks: both cached ones are evicted
    assert slots.num_checkpoints == 0
    assert slots.num_free == free_rows + 2
    assert mgr.num_cached_prefix_tokens(KVSequence(seq_id=6), prompt) == 0


def test_reset_prefix_cache_drops_every_checkpoint():
    pool, mgr, slots = manager()
    seq = prefill(mgr, slots, list(range(9)))
    assert slots.num_checkpoints == 2
    pool.reset_prefix_cache()
    assert slots.num_checkpoints == 0 and slots.num_free == 15  # the live sequence keeps its row
    mgr.free(seq)
    assert slots.num_free == 16


# --------------------------------------------------------------------------------- Scheduler
def scheduler(num_blocks=32, interval=BS, budget=64):
    pool, mgr, slots = manager(num_blocks=num_blocks, interval=interval)
    return pool, slots, Scheduler(mgr, max_num_seqs=4, max_num_batched_tokens=budget)


def request(prompt, rid, max_new=8):
    return Request(request_id=rid, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                   max_total_tokens=len(prompt) + max_new, seq=KVSequence(seq_id=hash(rid) % 1000))


def commit(sched, slots, out):
    """What a committed step does: its full blocks and checkpoints published (the runner hands the
    checkpoints over, the owner publishes them), a token sampled where the step samples."""
    sched.manager.commit_full_blocks(out.new_full_blocks)
    for entry in out.scheduled:
        for key, row in entry.request.seq.state_checkpoints:
            slots.publish(key, row)
        entry.request.seq.state_checkpoints = []
    for entry in out.scheduled:
        if entry.samples:
            entry.request.token_ids.append(7)


def test_admission_gives_a_row_and_a_hit_restores_the_checkpoint_where_it_ends():
    pool, slots, sched = scheduler(interval=8)
    shared = list(range(3, 15))  # 12 tokens: blocks 0-2, a checkpoint at 8
    a = request(shared + [40, 41], "a")
    sched.add(a)
    out = sched.schedule()
    assert a.seq.state_row is not None and [k for k, _ in a.seq.state_saves] == [8]
    commit(sched, slots, out)
    checkpoint = slots.lookup(a.seq.block_hashes[1])
    sched.finish(a)
    b = request(shared + [50, 51, 52], "b")
    sched.add(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 8 and slots.pending_copies == {b.seq.state_row: checkpoint}
    assert b.seq.state_row not in (None, checkpoint)
    assert out.scheduled[0].start == 8


def test_rollback_settles_on_the_snapshot_or_preempts_without_one():
    pool, slots, sched = scheduler()
    a = request(range(3, 9), "a", max_new=16)
    sched.add(a)
    commit(sched, slots, sched.schedule())
    a.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert out.scheduled[0].draft_token_ids == [1, 2, 3] and len(a.seq.state_snapshots) == 3
    a.token_ids.append(1)  # the first draft accepted, the target's own token after it
    a.token_ids.append(9)
    snapshot = a.seq.state_snapshots[a.num_computed_tokens - 2]
    sched.rollback(a, 2)
    assert a.status == RequestStatus.RUNNING and a.seq.state_row == snapshot and a.seq.state_snapshots == {}
    assert a.num_computed_tokens == 8 and slots.num_free == 16 - 1 - slots.num_checkpoints
    # a rollback further back than the step's snapshots: the state is recomputed
    a.seq.state_snapshots = {}
    sched.rollback(a, 1)
    assert a.status == RequestStatus.WAITING and a.seq.state_row is None and a.num_computed_tokens == 0
    assert slots.num_free == 16 - slots.num_checkpoints


def test_checkpoints_stay_within_their_bound_and_never_grow_the_rows():
    """A long chunk crosses many boundaries: at most `max_checkpoints` rows are ever reserved or kept,
    and the rows do not grow for them (review finding: a 300-token prompt once left 18 of 2)."""
    slots = StateSlots(6, max_checkpoints=2, interval=4)
    slots.on_grow = lambda n: None  # growth would be allowed for sequences, never for checkpoints
    seq = KVSequence(seq_id=0, token_ids=list(range(40)), block_hashes=list(range(100, 110)))
    assign_row(slots, seq)
    plan_chunk(slots, seq, 0, 40, 0, 4)
    assert len(seq.state_checkpoints) == 2 and slots.num_rows == 6
    for key, row in seq.state_checkpoints:
        slots.publish(key, row)
    seq.state_checkpoints = []
    plan_chunk(slots, seq, 0, 40, 0, 4)  # the kept ones are evicted for new ones, still two at most
    for key, row in seq.state_checkpoints:
        slots.publish(key, row)
    assert slots.num_checkpoints == 2 and slots.num_rows == 6


def test_a_fork_copies_its_parents_state_at_the_fork_and_a_fork_of_a_fork_from_the_same_source():
    slots = StateSlots(8)
    slots.copy_later(1, 4)
    slots.copy_later(4, 5)  # row 4 is still waiting for row 1's state: row 5 takes it from row 1 too
    assert sorted(slots.take_copies()) == [(1, 4), (1, 5)] and slots.pending_copies == {}

