"""Tests for the torch-free KV bookkeeping: BlockPool (free list, ref counts, LRU, prefix-cache hash
chain) and BlockManager (append, fork with copy-on-write, truncate, free).

The unit tests pin down one behaviour each. The Hypothesis state machine at the end drives random
append/fork/truncate/free/reset sequences against a *content model* (what every physical slot would
hold), so a prefix hit or a copy-on-write that hands a sequence the wrong K/V shows up as a content
mismatch, not just as inconsistent counters.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_paged.core.block_pool import (
    BlockManager,
    BlockPool,
    NoFreeBlocksError,
    hash_block_tokens,
)
from hf_paged.core.sequence import KVSequence


# --- helpers --------------------------------------------------------------------------------------


def make(
    num_blocks: int, block_size: int, enable_prefix_caching: bool = True
) -> tuple[BlockPool, BlockManager]:
    pool = BlockPool(num_blocks, enable_prefix_caching=enable_prefix_caching)
    return pool, BlockManager(pool, block_size)


def pool_state(pool: BlockPool) -> tuple:
    """Everything observable about a pool, to assert that a failed call left it untouched."""
    return (
        list(pool.ref_counts),
        list(pool.block_hash),
        dict(pool.hash_to_block),
        list(pool._free),
        list(pool._evictable),
        pool.num_prefix_hits,
    )


def seq_state(seq: KVSequence) -> tuple:
    return (list(seq.token_ids), list(seq.block_table), list(seq.block_hashes))


def drain(pool: BlockPool) -> list[int]:
    """Allocate every remaining block one at a time, returning the ids in allocation order."""
    order = []
    while pool.num_free_blocks:
        order.extend(pool.allocate(1))
    return order


# --- BlockPool units ------------------------------------------------------------------------------


def test_allocate_and_free_round_trip():
    pool = BlockPool(4)
    assert pool.num_blocks == 4 and pool.num_free_blocks == 4 and pool.num_used_blocks == 0

    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and all(0 <= b < 4 for b in blocks)
    assert all(pool.ref_count(b) == 1 for b in blocks)
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    pool.check_invariants()

    pool.free(blocks)
    assert all(pool.ref_count(b) == 0 for b in blocks)
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    pool.check_invariants()


def test_allocate_zero_is_a_no_op():
    pool = BlockPool(2)
    before = pool_state(pool)
    assert pool.allocate(0) == []
    assert pool_state(pool) == before


def test_double_free_raises_value_error():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    pool.check_invariants()


def test_free_of_never_allocated_block_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.free([1])
    assert pool.num_free_blocks == 2
    pool.check_invariants()


def test_allocate_beyond_capacity_is_all_or_nothing():
    pool = BlockPool(5)
    held = pool.allocate(3)
    before = pool_state(pool)
    assert not pool.can_allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool_state(pool) == before
    assert pool.num_free_blocks == 2
    # The two that are left can still be taken.
    rest = pool.allocate(2)
    assert set(rest).isdisjoint(held) and pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_invariants()


def test_allocate_beyond_capacity_evicts_nothing():
    pool, mgr = make(3, 2)
    a = KVSequence(0)
    mgr.append_tokens(a, [1, 1, 2, 2])
    mgr.free(a)  # two cached free blocks plus one truly free block
    before = pool_state(pool)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(4)
    assert pool_state(pool) == before and pool.num_cached_blocks == 2


def test_no_free_blocks_error_is_a_runtime_error():
    # Engines catch it to preempt; it must not be confused with ValueError (a caller bug).
    assert issubclass(NoFreeBlocksError, RuntimeError)
    assert not issubclass(NoFreeBlocksError, ValueError)


def test_grow_adds_free_blocks_with_new_ids():
    pool = BlockPool(0)
    assert pool.num_blocks == 0 and not pool.can_allocate(1)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.grow(3)
    assert pool.num_blocks == 3 and pool.num_free_blocks == 3
    first = pool.allocate(3)
    assert sorted(first) == [0, 1, 2]
    pool.grow(2)
    assert pool.num_blocks == 5 and pool.num_free_blocks == 2
    assert sorted(pool.allocate(2)) == [3, 4]
    pool.check_invariants()


def test_invalid_constructor_arguments():
    with pytest.raises(ValueError):
        BlockPool(-1)
    with pytest.raises(ValueError):
        BlockPool(2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        BlockManager(BlockPool(2), 0)


def test_incref_shares_in_use_blocks_and_rejects_free_ones():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.incref([a])
    assert pool.ref_count(a) == 2
    pool.free([a])
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 2  # still held once
    pool.free([a])
    assert pool.num_free_blocks == 3

    before = pool_state(pool)
    with pytest.raises(ValueError):
        pool.incref([a])
    assert pool_state(pool) == before
    pool.check_invariants()


def test_incref_on_cached_evictable_block_raises():
    pool, mgr = make(4, 2)
    seq = KVSequence(0)
    mgr.append_tokens(seq, [1, 2])
    (b,) = seq.block_table
    mgr.free(seq)
    assert pool.ref_count(b) == 0 and pool.lookup(hash_block_tokens(None, [1, 2])) == b
    with pytest.raises(ValueError):
        pool.incref([b])


def test_hash_block_tokens_chains_and_salts():
    h1 = hash_block_tokens(None, [1, 2])
    assert h1 == hash_block_tokens(None, [1, 2])
    assert h1 != hash_block_tokens(None, [2, 1])
    assert h1 != hash_block_tokens(None, [1, 2], extra_key="lora-a")
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(None, [3, 4])
    other_parent = hash_block_tokens(None, [1, 3])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(other_parent, [3, 4])


# --- prefix caching -------------------------------------------------------------------------------

BS = 4


def test_identical_prefixes_share_full_blocks():
    pool, mgr = make(16, BS)
    tokens = list(range(10))  # 2.5 blocks

    a = KVSequence(0)
    ra = mgr.append_tokens(a, tokens)
    assert ra.num_cached_tokens == 0 and ra.copies == []
    assert -1 not in ra.slots
    assert ra.slots == [a.block_table[i // BS] * BS + i % BS for i in range(10)]
    assert len(a.block_table) == 3 and len(a.block_hashes) == 2

    b = KVSequence(1)
    rb = mgr.append_tokens(b, tokens)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # partial blocks are never shared
    assert [pool.ref_count(x) for x in a.block_table] == [2, 2, 1]
    assert pool.ref_count(b.block_table[2]) == 1
    assert rb.num_cached_tokens == 2 * BS
    assert rb.slots[: 2 * BS] == [-1] * (2 * BS)
    assert rb.slots[2 * BS :] == [b.block_table[2] * BS + 0, b.block_table[2] * BS + 1]
    assert rb.copies == []
    assert b.block_hashes == a.block_hashes
    assert pool.num_prefix_hits == 2
    assert pool.num_used_blocks == 4
    pool.check_invariants()


def test_hash_chaining_shares_only_the_common_prefix():
    pool, mgr = make(16, BS)
    a = KVSequence(0)
    mgr.append_tokens(a, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    c = KVSequence(2)
    rc = mgr.append_tokens(c, [0, 1, 2, 3, 4, 5, 6, 99, 8, 9])  # differs in block 1 only
    assert c.block_table[0] == a.block_table[0]
    assert c.block_table[1] != a.block_table[1]
    assert rc.num_cached_tokens == BS and rc.slots[:BS] == [-1] * BS
    assert -1 not in rc.slots[BS:]
    assert pool.ref_count(a.block_table[0]) == 2 and pool.ref_count(a.block_table[1]) == 1

    # Same block-1 content after a different block 0: the chain must make that a miss.
    d = KVSequence(3)
    rd = mgr.append_tokens(d, [9, 9, 9, 9, 4, 5, 6, 7])
    assert rd.num_cached_tokens == 0
    assert set(d.block_table).isdisjoint(a.block_table)
    pool.check_invariants()


def test_extra_key_prevents_sharing():
    pool, mgr = make(16, BS)
    tokens = list(range(8))
    a = KVSequence(0, extra_key="adapter-a")
    mgr.append_tokens(a, tokens)
    b = KVSequence(1, extra_key="adapter-b")
    rb = mgr.append_tokens(b, tokens)
    c = KVSequence(2)  # no salt at all
    rc = mgr.append_tokens(c, tokens)
    assert rb.num_cached_tokens == 0 and rc.num_cached_tokens == 0
    assert len(set(a.block_table) | set(b.block_table) | set(c.block_table)) == 6
    # The same salt does share.
    d = KVSequence(3, extra_key="adapter-a")
    rd = mgr.append_tokens(d, tokens)
    assert rd.num_cached_tokens == 8 and d.block_table == a.block_table
    pool.check_invariants()


def test_image_spans_salt_only_the_blocks_they_overlap():
    """Equal ids whose placeholder positions hide different images: the blocks before the image are
    shared, the block holding it and every later one are not (vLLM's multimodal block hashes)."""
    pool, mgr = make(32, BS)
    tokens = list(range(4 * BS))
    span = (BS + 1, 2 * BS + 1)  # ends one token into block 2

    def seq(i: int, digest: str) -> KVSequence:
        return KVSequence(i, mm_spans=((*span, digest),))

    a = seq(0, "image-a")
    mgr.append_tokens(a, tokens)
    assert [a.block_key(i, BS) for i in range(4)] == [None, (None, ("image-a",)), (None, ("image-a",)), None]
    b = seq(1, "image-b")
    assert mgr.num_cached_prefix_tokens(b, tokens) == BS
    rb = mgr.append_tokens(b, tokens)
    assert rb.num_cached_tokens == BS and b.block_table[0] == a.block_table[0]
    assert set(b.block_table[1:]).isdisjoint(a.block_table)
    c = seq(2, "image-a")
    assert mgr.num_cached_prefix_tokens(c, tokens) == 4 * BS
    assert mgr.append_tokens(c, tokens).num_cached_tokens == 4 * BS and c.block_table == a.block_table
    assert mgr.fork(c, 3).mm_spans == c.mm_spans
    pool.check_invariants()


def test_uncacheable_sequence_never_hits_and_never_registers():
    pool, mgr = make(16, BS)
    tokens = list(range(8))
    a = KVSequence(0)
    mgr.append_tokens(a, tokens)
    registered = dict(pool.hash_to_block)

    u = KVSequence(1, is_cacheable=False)
    ru = mgr.append_tokens(u, tokens)
    assert ru.num_cached_tokens == 0 and -1 not in ru.slots
    assert set(u.block_table).isdisjoint(a.block_table)
    assert u.block_hashes == []
    assert pool.hash_to_block == registered
    assert all(pool.block_hash[b] is None for b in u.block_table)

    # Blocks of an uncacheable sequence are plain free blocks once released, never cached.
    mgr.free(a)
    mgr.free(u)
    assert pool.num_cached_blocks == 2  # only a's two blocks
    v = KVSequence(2, is_cacheable=False)
    assert mgr.append_tokens(v, tokens).num_cached_tokens == 0
    pool.check_invariants()


def test_uncacheable_content_is_not_hit_by_a_later_cacheable_sequence():
    pool, mgr = make(8, BS)
    u = KVSequence(0, is_cacheable=False)
    mgr.append_tokens(u, list(range(8)))
    mgr.free(u)
    assert pool.num_cached_blocks == 0
    b = KVSequence(1)
    assert mgr.append_tokens(b, list(range(8))).num_cached_tokens == 0


def test_prefix_caching_disabled_never_shares():
    pool, mgr = make(16, BS, enable_prefix_caching=False)
    a, b = KVSequence(0), KVSequence(1)
    mgr.append_tokens(a, list(range(8)))
    rb = mgr.append_tokens(b, list(range(8)))
    assert rb.num_cached_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    assert pool.num_cached_blocks == 0
    mgr.free(a)
    assert pool.num_free_blocks == 16 - 2 and len(pool._evictable) == 0  # straight to the free list
    pool.check_invariants()


def test_hit_on_cached_free_block_revives_it():
    pool, mgr = make(4, BS)
    a = KVSequence(0)
    mgr.append_tokens(a, list(range(8)))
    blocks = list(a.block_table)
    mgr.free(a)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    b = KVSequence(1)
    rb = mgr.append_tokens(b, list(range(8)) + [42])
    assert b.block_table[:2] == blocks and rb.num_cached_tokens == 8
    assert [pool.ref_count(x) for x in blocks] == [1, 1]
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_block_filled_across_appends_is_registered():
    pool, mgr = make(8, BS)
    a = KVSequence(0)
    for t in range(BS):  # decode one token at a time
        mgr.append_tokens(a, [t])
    assert len(a.block_hashes) == 1
    assert pool.lookup(a.block_hashes[0]) == a.block_table[0]
    b = KVSequence(1)
    assert mgr.append_tokens(b, list(range(BS))).num_cached_tokens == BS


def test_duplicate_content_keeps_first_block_canonical():
    pool, mgr = make(8, BS)
    a, b = KVSequence(0), KVSequence(1)
    mgr.append_tokens(a, [1, 2])
    mgr.append_tokens(b, [1, 2])  # both partial: no sharing
    mgr.append_tokens(a, [3, 4])
    mgr.append_tokens(b, [3, 4])  # b completes the same content in its own block
    assert a.block_hashes == b.block_hashes
    assert pool.lookup(a.block_hashes[0]) == a.block_table[0]
    assert pool.block_hash[b.block_table[0]] is None
    mgr.free(b)  # the duplicate is a plain free block again
    assert pool.num_cached_blocks == 1
    pool.check_invariants()


# --- LRU eviction ---------------------------------------------------------------------------------


def test_allocation_prefers_free_blocks_then_evicts_oldest_cached():
    pool, mgr = make(6, 2)
    a, b = KVSequence(0), KVSequence(1)
    mgr.append_tokens(a, [1, 1])
    mgr.append_tokens(b, [2, 2])
    ha, hb = a.block_hashes[0], b.block_hashes[0]
    ba, bb = a.block_table[0], b.block_table[0]
    mgr.free(a)  # a is freed first: it is the least recently used
    mgr.free(b)
    assert pool.num_cached_blocks == 2 and pool.num_free_blocks == 6

    truly_free = set(range(6)) - {ba, bb}
    first = pool.allocate(4)
    assert set(first) == truly_free  # cached blocks are untouched while free ones remain
    assert pool.lookup(ha) == ba and pool.lookup(hb) == bb

    (evicted,) = pool.allocate(1)
    assert evicted == ba  # oldest first
    assert pool.lookup(ha) is None and pool.lookup(hb) == bb
    assert pool.block_hash[ba] is None

    # The evicted hash no longer hits; the surviving one does.
    pool.free(first)
    c = KVSequence(2)
    assert mgr.append_tokens(c, [1, 1]).num_cached_tokens == 0
    d = KVSequence(3)
    rd = mgr.append_tokens(d, [2, 2])
    assert rd.num_cached_tokens == 2 and d.block_table == [bb]
    pool.check_invariants()


def test_hit_refreshes_lru_position():
    pool, mgr = make(2, 2)
    a, b = KVSequence(0), KVSequence(1)
    mgr.append_tokens(a, [1, 1])
    mgr.append_tokens(b, [2, 2])
    ba, bb = a.block_table[0], b.block_table[0]
    mgr.free(a)
    mgr.free(b)
    # Touch a again: now b is the least recently used.
    c = KVSequence(2)
    mgr.append_tokens(c, [1, 1])
    mgr.free(c)
    assert pool.allocate(1) == [bb]
    assert pool.lookup(hash_block_tokens(None, [1, 1])) == ba
    assert pool.lookup(hash_block_tokens(None, [2, 2])) is None


def test_allocate_after_takes_the_next_free_block_then_falls_back_to_fifo():
    pool, _ = make(8, 4)
    assert pool.allocate(2) == [0, 1]
    pool.allocate(1)  # 2
    pool.free([0])
    assert pool.allocate(2, after=4) == [5, 6]  # the next ones, out of FIFO order
    assert pool.allocate(1, after=2) == [3]
    assert pool.allocate(1, after=6) == [7]
    assert pool.allocate(1, after=7) == [4]  # 8 does not exist: FIFO head
    assert pool.allocate(1, after=4) == [0]  # 5 is in use
    pool.check_invariants()


def test_allocate_after_never_evicts_a_cached_block_for_adjacency():
    pool, manager = make(6, 2)
    cached = KVSequence(seq_id=0)
    manager.append_tokens(cached, [1, 2, 3, 4])  # blocks 0, 1, both full and hashed
    manager.free(cached)  # cached, evictable
    assert pool.allocate(1, after=0) == [2]  # block 1 is cached: the FIFO head instead
    assert pool.num_cached_blocks == 2
    pool.check_invariants()


def test_sequences_grow_on_consecutive_blocks_where_free():
    pool, manager = make(16, 2)
    a, b = KVSequence(seq_id=0), KVSequence(seq_id=1)
    manager.append_tokens(a, [1, 2, 3])  # blocks 0, 1
    manager.append_tokens(b, [7])  # block 2
    manager.free(b)
    for token in range(4, 10):
        manager.append_tokens(a, [token])
    assert a.block_table == [0, 1, 2, 3, 4]  # block 2 came back and a took it next
    c = KVSequence(seq_id=2)
    manager.append_tokens(c, [5, 5, 5])
    assert c.block_table == [5, 6]
    pool.check_invariants()


def test_free_sequence_releases_tail_blocks_first():
    pool, mgr = make(4, 2)
    a = KVSequence(0)
    mgr.append_tokens(a, [1, 2, 3, 4, 5, 6, 7, 8])  # 4 full blocks, all cached after free
    table = list(a.block_table)
    mgr.free(a)
    assert a.block_table == [] and a.token_ids == [] and a.block_hashes == []
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    # No truly free block left, so allocation evicts: tail first, the prompt's first block last.
    assert drain(pool) == table[::-1]
    assert pool.num_cached_blocks == 0


def test_truncate_releases_tail_blocks_first():
    pool, mgr = make(4, 2)
    a = KVSequence(0)
    mgr.append_tokens(a, [1, 2, 3, 4, 5, 6, 7, 8])
    table = list(a.block_table)
    mgr.truncate(a, 6)
    assert a.block_table == table[:1]
    assert drain(pool) == [table[3], table[2], table[1]]


# --- fork and copy-on-write -----------------------------------------------------------------------


def test_fork_shares_every_block():
    pool, mgr = make(8, BS)
    parent = KVSequence(0, extra_key="k")
    mgr.append_tokens(parent, list(range(6)))
    child = mgr.fork(parent, 1)
    assert child.seq_id == 1 and child.extra_key == "k" and child.is_cacheable
    assert child.block_table == parent.block_table and child.block_table is not parent.block_table
    assert child.token_ids == parent.token_ids and child.token_ids is not parent.token_ids
    assert child.block_hashes == parent.block_hashes
    assert child.block_hashes is not parent.block_hashes
    assert all(pool.ref_count(b) == 2 for b in parent.block_table)
    assert pool.num_used_blocks == 2
    pool.check_invariants()


def test_fork_copies_is_cacheable_flag():
    pool, mgr = make(8, BS)
    parent = KVSequence(0, is_cacheable=False)
    mgr.append_tokens(parent, list(range(2)))
    assert not mgr.fork(parent, 1).is_cacheable


def test_append_to_child_with_partial_last_block_copies_on_write():
    pool, mgr = make(8, BS)
    parent = KVSequence(0)
    mgr.append_tokens(parent, list(range(6)))  # last block holds 2 of 4
    parent_table = list(parent.block_table)
    child = mgr.fork(parent, 1)
    shared_last = parent_table[-1]

    assert mgr.num_blocks_needed(child, 1) == 1  # the copy
    r = mgr.append_tokens(child, [100])
    assert len(r.copies) == 1
    src, dst = r.copies[0]
    assert src == shared_last and dst not in parent_table
    assert child.block_table == parent_table[:-1] + [dst]
    assert parent.block_table == parent_table
    assert r.slots == [dst * BS + 2]
    assert pool.ref_count(shared_last) == 1 and pool.ref_count(dst) == 1
    assert pool.ref_count(parent_table[0]) == 2  # full blocks stay shared

    # The parent is now the sole owner of its last block: it writes in place, no copy.
    rp = mgr.append_tokens(parent, [200])
    assert rp.copies == [] and rp.slots == [shared_last * BS + 2]
    assert parent.block_table == parent_table
    pool.check_invariants()


def test_append_to_child_with_full_last_block_needs_no_copy():
    pool, mgr = make(8, BS)
    parent = KVSequence(0)
    mgr.append_tokens(parent, list(range(8)))  # two full blocks
    parent_table = list(parent.block_table)
    child = mgr.fork(parent, 1)
    assert mgr.num_blocks_needed(child, 1) == 1
    r = mgr.append_tokens(child, [100])
    assert r.copies == []
    assert child.block_table[:2] == parent_table and len(child.block_table) == 3
    assert child.block_table[2] not in parent_table
    assert r.slots == [child.block_table[2] * BS]
    assert parent.block_table == parent_table
    assert all(pool.ref_count(b) == 2 for b in parent_table)
    pool.check_invariants()


def test_copy_on_write_then_fill_registers_the_copy():
    pool, mgr = make(8, BS)
    parent = KVSequence(0)
    mgr.append_tokens(parent, [0, 1])
    child = mgr.fork(parent, 1)
    r = mgr.append_tokens(child, [2, 3, 4])
    (src, dst), = r.copies
    assert child.block_table[0] == dst
    assert pool.lookup(hash_block_tokens(None, [0, 1, 2, 3])) == dst
    assert pool.block_hash[src] is None  # the parent's partial block is not full
    pool.check_invariants()


def test_copy_on_write_out_of_blocks_leaves_everything_untouched():
    pool, mgr = make(2, BS)
    parent = KVSequence(0)
    mgr.append_tokens(parent, [0, 1, 2, 3, 4])  # uses both blocks
    child = mgr.fork(parent, 1)
    assert not mgr.can_append(child, 1)
    before = (pool_state(pool), seq_state(parent), seq_state(child))
    with pytest.raises(NoFreeBlocksError):
        mgr.append_tokens(child, [9])
    assert (pool_state(pool), seq_state(parent), seq_state(child)) == before


# --- truncate -------------------------------------------------------------------------------------


def test_truncate_frees_whole_blocks_only():
    pool, mgr = make(8, BS)
    a = KVSequence(0)
    mgr.append_tokens(a, list(range(10)))  # 3 blocks
    table = list(a.block_table)

    mgr.truncate(a, 1)  # 9 tokens: still 3 blocks
    assert a.block_table == table and a.num_tokens == 9 and len(a.block_hashes) == 2
    mgr.truncate(a, 1)  # 8 tokens: the last block is empty now
    assert a.block_table == table[:2] and pool.ref_count(table[2]) == 0
    mgr.truncate(a, 3)  # 5 tokens: block 1 keeps one token, its hash is dropped from the sequence
    assert a.block_table == table[:2] and a.token_ids == [0, 1, 2, 3, 4]
    assert len(a.block_hashes) == 1
    mgr.truncate(a, 0)
    assert a.num_tokens == 5
    mgr.truncate(a, 5)
    assert a.block_table == [] and a.block_hashes == [] and pool.num_used_blocks == 0
    pool.check_invariants()


def test_truncate_rejects_bad_amounts():
    pool, mgr = make(4, BS)
    a = KVSequence(0)
    mgr.append_tokens(a, [1, 2, 3])
    before = (pool_state(pool), seq_state(a))
    with pytest.raises(ValueError):
        mgr.truncate(a, 4)
    with pytest.raises(ValueError):
        mgr.truncate(a, -1)
    assert (pool_state(pool), seq_state(a)) == before


def test_truncate_into_hashed_block_then_rewrite_leaves_no_stale_hit():
    pool, mgr = make(8, BS)
    original = [1, 2, 3, 4, 5, 6, 7, 8]
    a = KVSequence(0)
    mgr.append_tokens(a, original)
    b1 = a.block_table[1]
    h1 = a.block_hashes[1]
    assert pool.lookup(h1) == b1

    mgr.truncate(a, 2)  # speculative rollback into the full, hashed block 1
    r = mgr.append_tokens(a, [60, 70])  # rewrite its tail in place
    assert r.copies == [] and a.block_table[1] == b1
    assert r.slots == [b1 * BS + 2, b1 * BS + 3]
    # b1 now holds [5, 6, 60, 70]: the hash of [5, 6, 7, 8] must not point at it any more.
    assert pool.lookup(h1) != b1
    assert pool.lookup(a.block_hashes[1]) == b1
    assert a.block_hashes[1] == hash_block_tokens(a.block_hashes[0], [5, 6, 60, 70])

    c = KVSequence(1)
    rc = mgr.append_tokens(c, original)
    assert c.block_table[0] == a.block_table[0]
    assert c.block_table[1] != b1 and rc.num_cached_tokens == BS
    assert rc.slots[BS:] == [c.block_table[1] * BS + i for i in range(BS)]
    pool.check_invariants()


def test_truncate_then_partial_rewrite_then_free_leaves_no_stale_hit():
    pool, mgr = make(8, BS)
    original = [1, 2, 3, 4]
    a = KVSequence(0)
    mgr.append_tokens(a, original)
    b0 = a.block_table[0]
    mgr.truncate(a, 2)
    mgr.append_tokens(a, [9])  # [1, 2, 9, _]: no longer full, no longer the original content
    mgr.free(a)
    assert pool.block_hash[b0] is None
    c = KVSequence(1)
    assert mgr.append_tokens(c, original).num_cached_tokens == 0
    pool.check_invariants()


def test_truncate_without_rewrite_keeps_valid_cache_entry():
    # Truncating alone changes no K/V, so the block's full content is still what its hash says.
    pool, mgr = make(8, BS)
    a = KVSequence(0)
    mgr.append_tokens(a, [1, 2, 3, 4])
    b0 = a.block_table[0]
    mgr.truncate(a, 1)
    c = KVSequence(1)
    rc = mgr.append_tokens(c, [1, 2, 3, 4])
    assert c.block_table == [b0] and rc.num_cached_tokens == BS
    # a now shares b0 with c, so its next write must copy rather than clobber c's K/V.
    r = mgr.append_tokens(a, [99])
    assert r.copies == [(b0, a.block_table[0])] and a.block_table[0] != b0
    assert pool.lookup(hash_block_tokens(None, [1, 2, 3, 4])) == b0
    pool.check_invariants()


def test_truncate_shared_block_then_append_copies():
    pool, mgr = make(8, BS)
    parent = KVSequence(0)
    mgr.append_tokens(parent, list(range(8)))
    child = mgr.fork(parent, 1)
    mgr.truncate(child, 2)
    assert child.block_table == parent.block_table
    assert mgr.num_blocks_needed(child, 1) == 1
    r = mgr.append_tokens(child, [50])
    assert r.copies == [(parent.block_table[1], child.block_table[1])]
    assert pool.lookup(parent.block_hashes[1]) == parent.block_table[1]
    pool.check_invariants()


# --- num_blocks_needed / can_append ---------------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("bs", [1, 3, 4])
@pytest.mark.parametrize("prefix_len", [0, 1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("num_new", [0, 1, 2, 3, 4, 7])
def test_num_blocks_needed_matches_allocation_without_hits(shared, bs, prefix_len, num_new):
    pool, mgr = make(32, bs, enable_prefix_caching=False)
    seq = KVSequence(0)
    mgr.append_tokens(seq, list(range(prefix_len)))
    if shared:
        other = mgr.fork(seq, 1)
    needed = mgr.num_blocks_needed(seq, num_new)
    free_before = pool.num_free_blocks
    r = mgr.append_tokens(seq, list(range(100, 100 + num_new)))
    consumed = free_before - pool.num_free_blocks
    assert needed == consumed, (needed, consumed)
    cow = shared and prefix_len % bs != 0 and num_new > 0
    assert len(r.copies) == int(cow)
    assert len(seq.block_table) == -(-seq.num_tokens // bs)
    if shared:
        assert other.num_tokens == prefix_len
    pool.check_invariants()


def test_can_append_exact_boundary_including_copy_on_write():
    pool, mgr = make(3, BS, enable_prefix_caching=False)
    parent = KVSequence(0)
    mgr.append_tokens(parent, [0, 1])  # 1 block
    child = mgr.fork(parent, 1)
    # 2 free blocks: the copy plus one more block fits 1 + 4 tokens (2 + 1 + 4 = 7 <= 8) ...
    assert mgr.num_blocks_needed(child, 5) == 2 and mgr.can_append(child, 5)
    # ... but not 1 + 7 tokens (2 + 7 = 9 > 8 needs a third block).
    assert mgr.num_blocks_needed(child, 7) == 3 and not mgr.can_append(child, 7)
    before = (pool_state(pool), seq_state(parent), seq_state(child))
    with pytest.raises(NoFreeBlocksError):
        mgr.append_tokens(child, list(range(7)))
    assert (pool_state(pool), seq_state(parent), seq_state(child)) == before
    mgr.append_tokens(child, list(range(5)))
    assert pool.num_free_blocks == 0
    pool.check_invariants()


def test_can_append_counts_hits_on_cached_free_blocks_as_consumption():
    # A hit on an evictable block takes it out of the free count just as an allocation does, so
    # the worst-case estimate must still hold when hits and allocations mix.
    pool, mgr = make(3, 2)
    a = KVSequence(0)
    mgr.append_tokens(a, [1, 1, 2, 2, 3, 3])
    mgr.free(a)
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 3
    b = KVSequence(1)
    assert mgr.can_append(b, 6) and not mgr.can_append(b, 7)
    r = mgr.append_tokens(b, [1, 1, 2, 2, 9, 9])
    assert r.num_cached_tokens == 4 and pool.num_free_blocks == 0
    pool.check_invariants()


# --- reset_prefix_cache ---------------------------------------------------------------------------


def test_reset_prefix_cache_forgets_hashes_and_frees_cached_blocks():
    pool, mgr = make(6, BS)
    live, gone = KVSequence(0), KVSequence(1)
    mgr.append_tokens(live, list(range(8)))
    mgr.append_tokens(gone, list(range(10, 18)))
    mgr.free(gone)
    assert pool.num_cached_blocks == 4
    free_before = pool.num_free_blocks

    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.hash_to_block == {}
    assert all(h is None for h in pool.block_hash)
    assert pool.num_free_blocks == free_before  # cached-free blocks became plain free ones
    assert [pool.ref_count(b) for b in live.block_table] == [1, 1]
    pool.check_invariants()

    # Nothing hits any more, neither the freed prompt nor the live one.
    c = KVSequence(2)
    assert mgr.append_tokens(c, list(range(8))).num_cached_tokens == 0
    assert set(c.block_table).isdisjoint(live.block_table)
    # Their hashes are gone, so once released the old live blocks are plain free blocks.
    old_live = list(live.block_table)
    mgr.free(live)
    assert all(b in pool._free for b in old_live) and not set(old_live) & set(pool._evictable)
    pool.check_invariants()


def test_reset_prefix_cache_then_new_fills_register_again():
    pool, mgr = make(6, BS)
    a = KVSequence(0)
    mgr.append_tokens(a, list(range(8)))
    mgr.free(a)
    pool.reset_prefix_cache()
    b = KVSequence(1)
    assert mgr.append_tokens(b, list(range(8))).num_cached_tokens == 0
    c = KVSequence(2)
    rc = mgr.append_tokens(c, list(range(8)))
    assert rc.num_cached_tokens == 8 and c.block_table == b.block_table  # b registered both blocks
    pool.check_invariants()


def test_reset_prefix_cache_isolates_blocks_filled_by_sequences_live_across_it():
    """A block a sequence fills after a reset attends to K/V from before it: never share it."""
    pool, mgr = make(6, BS)
    a = KVSequence(0)
    mgr.append_tokens(a, list(range(4)))  # block 0: K/V from the old weights
    pool.reset_prefix_cache()  # "the weights changed"
    mgr.append_tokens(a, list(range(4, 8)))  # block 1: new weights, but attends to old block 0
    assert not a.is_cacheable and a.block_hashes == []
    b = KVSequence(1)
    rb = mgr.append_tokens(b, list(range(8)))
    assert b.block_table[0] != a.block_table[0]  # block 0 correctly misses ...
    assert rb.num_cached_tokens == 0  # ... and so does block 1
    assert not set(a.block_table) & set(b.block_table)
    pool.check_invariants()


# --- stateful property test -----------------------------------------------------------------------

TOKEN = st.integers(0, 2)
TOKENS = st.lists(TOKEN, min_size=1, max_size=9)
MAX_LIVE = 6


class BlockManagerMachine(RuleBasedStateMachine):
    """Random append / fork / truncate / free / reset against a model of every slot's content.

    `content[block][offset]` is the token whose K/V the tensor owner would have written there if it
    followed each AppendResult exactly: apply `copies`, then write every slot that is not -1. A slot
    of -1 claims the K/V is already there; the model checks that claim.
    """

    def __init__(self):
        super().__init__()
        self.pool: BlockPool
        self.mgr: BlockManager
        self.bs = 1
        self.live: dict[int, KVSequence] = {}
        self.content: list[list[int | None]] = []
        self.next_id = 0
        # Every hash the machine has seen a sequence carry, with the (salt, prefix) it stands for.
        self.hash_meaning: dict[int, tuple[object, tuple[int, ...]]] = {}
        # Token lists of past and present sequences, so new ones can reuse a prefix: random tokens
        # alone rarely repeat a whole block once block_size > 1.
        self.history: list[tuple[object, tuple[int, ...]]] = []
        self.num_appends_since_reset = 0

    @initialize(
        bs=st.integers(1, 4),
        num_blocks=st.sampled_from([24, 12, 6, 32]),
        enable_prefix_caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, bs, num_blocks, enable_prefix_caching):
        self.bs = bs
        self.pool = BlockPool(num_blocks, enable_prefix_caching=enable_prefix_caching)
        self.mgr = BlockManager(self.pool, bs)
        self.content = [[None] * bs for _ in range(num_blocks)]

    # ------------------------------------------------------------ helpers
    def _append(self, seq: KVSequence, tokens: list[int], is_new: bool) -> None:
        pool, mgr, bs = self.pool, self.mgr, self.bs
        needed = mgr.num_blocks_needed(seq, len(tokens))
        if not mgr.can_append(seq, len(tokens)):
            before = (pool_state(pool), seq_state(seq), [seq_state(s) for s in self.live.values()])
            with pytest.raises(NoFreeBlocksError):
                mgr.append_tokens(seq, tokens)
            after = (pool_state(pool), seq_state(seq), [seq_state(s) for s in self.live.values()])
            assert after == before, "a refused append changed state"
            return
        free_before = pool.num_free_blocks
        n0 = seq.num_tokens
        r = mgr.append_tokens(seq, tokens)
        consumed = free_before - pool.num_free_blocks
        assert consumed <= needed, f"num_blocks_needed={needed} but the append took {consumed}"
        if r.num_cached_tokens == 0:  # the estimate is exact when nothing hits
            assert consumed == needed, f"num_blocks_needed={needed} but the append took {consumed}"
        assert len(r.slots) == len(tokens)
        assert r.num_cached_tokens == r.slots.count(-1)
        if not (pool.enable_prefix_caching and seq.is_cacheable):
            assert r.num_cached_tokens == 0
        assert len(r.copies) <= 1

        for src, dst in r.copies:
            assert pool.ref_count(dst) >= 1 and dst in seq.block_table
            self.content[dst] = list(self.content[src])
        for j, (token, slot) in enumerate(zip(tokens, r.slots)):
            pos = n0 + j
            block, offset = seq.block_table[pos // bs], pos % bs
            if slot == -1:
                cached = self.content[block][offset]
                assert cached == token, f"block {block}[{offset}] holds {cached}, not {token}"
            else:
                assert slot == block * bs + offset, "slot does not match the block table"
                assert pool.ref_count(block) == 1, f"write into shared block {block}"
                self.content[block][offset] = token
        if is_new:
            self.live[seq.seq_id] = seq
        self._learn_hashes(seq)
        self.num_appends_since_reset += 1
        self._remember(seq.extra_key, seq.token_ids)

    def _learn_hashes(self, seq: KVSequence) -> None:
        for i, h in enumerate(seq.block_hashes):
            meaning = (seq.extra_key, tuple(seq.token_ids[: (i + 1) * self.bs]))
            assert self.hash_meaning.setdefault(h, meaning) == meaning, "one hash, two prefixes"

    def _remember(self, extra_key: object, token_ids: list[int]) -> None:
        if len(token_ids) >= self.bs:  # newest first: Hypothesis favours the first choice
            self.history.insert(0, (extra_key, tuple(token_ids)))
            del self.history[16:]

    def _pick(self, data) -> KVSequence:
        return self.live[data.draw(st.sampled_from(sorted(self.live)), label="seq")]

    # ------------------------------------------------------------ rules
    # Every rule takes exactly `data` and draws the rest itself. Hypothesis orders rules by argument
    # count, then name, and strongly favours the first enabled one; with equal counts that is
    # `append`, so most steps grow live sequences and the pool comes under pressure.

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def append(self, data):
        self._append(self._pick(data), data.draw(TOKENS, label="tokens"), is_new=False)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode_one_token(self, data):
        self._append(self._pick(data), [data.draw(TOKEN, label="token")], is_new=False)

    @precondition(lambda self: self.live and len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data)
        refs_before = [self.pool.ref_count(b) for b in parent.block_table]
        child = self.mgr.fork(parent, self.next_id)
        self.next_id += 1
        assert [self.pool.ref_count(b) for b in parent.block_table] == [r + 1 for r in refs_before]
        self.live[child.seq_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = self._pick(data)
        token_ids = list(seq.token_ids)
        held_alone = sum(self.pool.ref_count(b) == 1 for b in seq.block_table)
        free_before = self.pool.num_free_blocks
        self.mgr.free(seq)
        del self.live[seq.seq_id]
        self._remember(seq.extra_key, token_ids)
        # Exactly the blocks this sequence held alone go idle; shared ones stay with their owners.
        assert self.pool.num_free_blocks - free_before == held_alone
        assert seq.block_table == [] and seq.token_ids == [] and seq.block_hashes == []

    @precondition(lambda self: self.pool.num_free_blocks < 2 and self.pool.num_blocks < 32)
    @rule(data=st.data())
    def grow_pool(self, data):
        n = data.draw(st.integers(1, 4), label="new blocks")
        self.pool.grow(n)
        self.content.extend([None] * self.bs for _ in range(n))

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def new_sequence(self, data):
        seq = KVSequence(
            self.next_id,
            extra_key=data.draw(st.sampled_from([None, None, None, "salt"]), label="extra_key"),
            is_cacheable=data.draw(st.sampled_from([True, True, True, False]), label="cacheable"),
        )
        self.next_id += 1
        self._append(seq, data.draw(TOKENS, label="tokens"), is_new=True)

    @precondition(lambda self: self.history and len(self.live) < MAX_LIVE)
    @rule(data=st.data())
    def new_prefixed_sequence(self, data):
        # Random tokens alone rarely repeat a whole block once block_size > 1: reuse a prefix.
        extra_key, old = data.draw(st.sampled_from(self.history), label="history")
        cut = data.draw(st.just(len(old)) | st.integers(0, len(old)), label="prefix length")
        seq = KVSequence(self.next_id, extra_key=extra_key)
        self.next_id += 1
        self._append(seq, list(old[:cut]) + data.draw(TOKENS, label="tail"), is_new=True)

    @precondition(lambda self: self.num_appends_since_reset >= 10)
    @rule(data=st.data())
    def reset_prefix_cache(self, data):
        used_before = self.pool.num_used_blocks
        self.pool.reset_prefix_cache()
        self.num_appends_since_reset = 0
        assert self.pool.num_cached_blocks == 0
        assert self.pool.num_used_blocks == used_before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def rollback_and_rewrite(self, data):
        # Speculative decoding: reject the last few tokens, then write others in their place.
        seq = self._pick(data)
        n = data.draw(st.integers(0, min(seq.num_tokens, self.bs + 1)), label="reject")
        self.mgr.truncate(seq, n)
        self._append(seq, data.draw(st.lists(TOKEN, max_size=n + 1), label="tokens"), is_new=False)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def truncate(self, data):
        seq = self._pick(data)
        n = data.draw(st.integers(0, seq.num_tokens), label="remove")
        expected = list(seq.token_ids[: seq.num_tokens - n])
        self.mgr.truncate(seq, n)
        assert seq.token_ids == expected

    # ------------------------------------------------------------ invariants
    @invariant()
    def pool_is_consistent(self):
        self.pool.check_invariants()

    @invariant()
    def ref_counts_equal_table_occurrences(self):
        counts = [0] * self.pool.num_blocks
        for seq in self.live.values():
            for b in seq.block_table:
                counts[b] += 1
        assert self.pool.ref_counts == counts
        # Idle (free or cached-evictable) exactly when unreferenced, and never on both lists.
        free, evictable = list(self.pool._free), list(self.pool._evictable)
        assert len(set(free)) == len(free) and not set(free) & set(evictable)
        assert set(free) | set(evictable) == {b for b, c in enumerate(counts) if c == 0}
        assert self.pool.num_free_blocks == counts.count(0)

    @invariant()
    def tables_fit_tokens(self):
        bs = self.bs
        for seq in self.live.values():
            assert len(seq.block_table) == -(-seq.num_tokens // bs)
            waste = len(seq.block_table) * bs - seq.num_tokens
            assert 0 <= waste <= bs - 1
            assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        bs = self.bs
        for seq in self.live.values():
            read = [self.content[seq.block_table[i // bs]][i % bs] for i in range(seq.num_tokens)]
            assert read == seq.token_ids, f"seq {seq.seq_id} reads {read}, holds {seq.token_ids}"

    @invariant()
    def sequence_hashes_are_the_content_chain(self):
        bs = self.bs
        for seq in self.live.values():
            if not (self.pool.enable_prefix_caching and seq.is_cacheable):
                assert seq.block_hashes == []
                continue
            expected, parent = [], None
            for i in range(seq.num_tokens // bs):
                block_tokens = seq.token_ids[i * bs : (i + 1) * bs]
                parent = hash_block_tokens(parent, block_tokens, seq.extra_key)
                expected.append(parent)
            assert seq.block_hashes == expected

    @invariant()
    def hashed_blocks_are_canonical(self):
        # A block has a hash only while the hash table names it: a duplicate fill stays unhashed.
        for b, h in enumerate(self.pool.block_hash):
            if h is not None:
                assert self.pool.hash_to_block.get(h) == b, f"block {b} has a stale hash"

    @invariant()
    def every_cached_hash_points_at_matching_content(self):
        # Stronger than waiting for a hit: no registered hash may name a block whose model content
        # differs from the block the hash was computed over.
        for h, b in self.pool.hash_to_block.items():
            assert h in self.hash_meaning, "the pool registered a hash no sequence ever carried"
            _, prefix = self.hash_meaning[h]
            assert self.content[b] == list(prefix[-self.bs :]), (
                f"hash of {prefix[-self.bs:]} points at block {b} holding {self.content[b]}"
            )


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
