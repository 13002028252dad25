"""The sliding-window rule of KV groups: grouping, and no block freed while a query can still read it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.config import (KVGroup, blocks_held, first_readable_position, kv_groups,
                                     num_freeable_blocks)


def test_layers_group_by_window_in_first_seen_order():
    gemma3 = [512, 512, 512, 512, 512, None] * 2
    assert kv_groups(gemma3) == [KVGroup((0, 1, 2, 3, 4, 6, 7, 8, 9, 10), 512), KVGroup((5, 11), None)]
    assert kv_groups([None, None]) == [KVGroup((0, 1), None)]
    assert kv_groups([]) == []
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="layer 1: sliding window must be a positive integer"):
            kv_groups([None, bad])


def test_the_equation_on_hand_worked_cases():
    # window 8, blocks of 4: after 20 tokens the next query (position 20) reads 13..20
    assert first_readable_position(20, 8) == 13 and num_freeable_blocks(20, 8, 4) == 3
    assert blocks_held(20, 8, 4) == 5 - 3  # blocks 3 (tokens 12-15) and 4 (16-19)
    assert blocks_held(20, 8, 4, new_tokens=6) == 7 - 3  # a 6-token chunk adds blocks 5 and 6
    assert num_freeable_blocks(20, 8, 4, lookback=3) == 2  # rollback of 3: position 17 reads 10..17
    assert blocks_held(20, None, 4) == 5 and num_freeable_blocks(10**6, None, 16) == 0
    assert first_readable_position(5, 8) == 0
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        blocks_held(3, 8, 0)
    with pytest.raises(ValueError, match="lookback must be an integer >= 0"):
        first_readable_position(3, 8, -1)


@settings(max_examples=300, deadline=None)
@given(window=st.integers(1, 40), block_size=st.integers(1, 16), lookback=st.integers(0, 6),
       steps=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 6)), min_size=1, max_size=40))
def test_no_block_is_freed_while_a_query_can_read_it(window, block_size, lookback, steps):
    """A sequence grows by chunks (prefill chunks, verify steps), may roll back up to `lookback`
    tokens of the step it just wrote (rejected drafts: at most chunk - 1), and frees its leading
    blocks by the rule after each step, before the rollback is known. Every key any
    query reads lies in a block still held, the blocks held during a step never exceed
    `blocks_held`, and without rollback the rule is tight (it frees every block nobody reads)."""
    num_tokens, freed = 0, 0  # blocks [0, freed) are gone
    for chunk, rollback in steps:
        held_now = -(-(num_tokens + chunk) // block_size) - freed
        assert held_now <= blocks_held(num_tokens, window, block_size, lookback, new_tokens=chunk)
        for query in range(num_tokens, num_tokens + chunk):
            earliest_key = max(0, query - window + 1)
            assert earliest_key // block_size >= freed, (query, earliest_key, freed)
        num_tokens += chunk
        freed = max(freed, num_freeable_blocks(num_tokens, window, block_size, lookback))
        if lookback == 0:  # tight: the last freed block held a token no later query reads
            assert freed == 0 or freed * block_size - 1 < num_tokens - window + 1
            assert -(-num_tokens // block_size) - freed == blocks_held(num_tokens, window, block_size)
        num_tokens -= min(rollback, lookback, chunk - 1)


# ---------------------------------------------------------------------------- groups in the block manager

from hf_paged.core import BlockManager, BlockPool, KVSequence, NoFreeBlocksError  # noqa: E402
from hf_paged.config import kv_layout  # noqa: E402
from hf_paged.core.sequence import NULL_BLOCK  # noqa: E402

WINDOW_SETS = [(None,), (5,), (None, 3), (4, None, 7), (2, 2)]


class _Simulated:
    """A BlockManager over groups plus a model of the K/V each slot holds: a written slot holds
    (group, every token up to and including its own), which is what real K/V depend on."""

    def __init__(self, windows, block_size, num_blocks):
        self.pool = BlockPool(num_blocks)
        self.manager = BlockManager(self.pool, block_size, windows)
        self.bs = block_size
        self.kv: dict[tuple[int, int], tuple] = {}  # (block, offset) -> (group, tokens[:p + 1])
        self.seqs: list[KVSequence] = []
        self.next_id = 0

    def new_seq(self) -> KVSequence:
        self.next_id += 1
        seq = KVSequence(self.next_id)
        self.seqs.append(seq)
        return seq

    def record(self, seq, start, result):
        for block_src, block_dst in result.copies:
            for off in range(self.bs):
                if (block_src, off) in self.kv:
                    self.kv[block_dst, off] = self.kv[block_src, off]
        for g, slots in enumerate(result.group_slots):
            for i, slot in enumerate(slots):
                if slot >= 0:
                    p = start + i
                    self.kv[slot // self.bs, slot % self.bs] = (g, tuple(seq.token_ids[: p + 1]))

    def check(self):
        pool, manager = self.pool, self.manager
        pool.check_invariants()
        refs = [0] * pool.num_blocks
        for seq in self.seqs:
            for b in seq.live_blocks():
                refs[b] += 1
        assert refs == pool.ref_counts, "a block is leaked or over-freed"
        for seq in self.seqs:
            n = seq.num_tokens
            for g, window in enumerate(manager.windows):
                table, released = seq.block_tables[g], seq.num_released[g]
                assert table[:released] == [NULL_BLOCK] * released and NULL_BLOCK not in table[released:]
                assert len(table) == -(-n // self.bs)
                # every key the next query (at position n, or n - 1 after a one-token rollback) reads is held
                first = 0 if window is None else max(0, n - window)
                assert released <= first // self.bs
                for p in range(first, n):
                    block = table[p // self.bs]
                    assert self.kv.get((block, p % self.bs)) == (g, tuple(seq.token_ids[: p + 1])), \
                        f"group {g} position {p}: wrong K/V"


@settings(max_examples=150, deadline=None)
@given(windows=st.sampled_from(WINDOW_SETS), block_size=st.integers(1, 5), data=st.data())
def test_groups_never_leak_never_free_a_readable_block_and_hit_exactly(windows, block_size, data):
    """Random appends (chunks and one-token decodes), rollbacks of a step's drafts, forks, frees and
    admissions through the prefix cache (`append_cached`, as the scheduler does) over 1-3 groups:
    after every operation no block leaks, every key a coming query can read is held, and every
    held slot holds exactly the K/V of its own group and prefix (prefix hits are exact)."""
    sim = _Simulated(windows, block_size, num_blocks=data.draw(st.integers(8, 60)))
    alphabet = st.integers(0, 2)  # few symbols: prompts repeat, so the prefix cache hits
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["admit", "append", "rollback", "fork", "free"]))
        live = [s for s in sim.seqs if s.num_tokens]
        try:
            if op == "admit" or not live:
                seq = sim.new_seq()
                prompt = data.draw(st.lists(alphabet, min_size=1, max_size=30))
                cached = sim.manager.num_cached_prefix_tokens(seq, prompt[:-1])
                # As the scheduler admits: both appends are sized together before either runs.
                needed = sim.manager.num_blocks_needed(seq, len(prompt) - cached, num_cached_tokens=cached)
                if not sim.pool.can_allocate(needed):
                    sim.seqs.remove(seq)
                    raise NoFreeBlocksError("the scheduler would not admit it now")
                if cached:
                    before = sim.pool.num_prefix_hits
                    hit = sim.manager.append_cached(seq, prompt[:cached])
                    assert hit.num_cached_tokens == cached and sim.pool.num_prefix_hits > before
                start = seq.num_tokens
                sim.record(seq, start, sim.manager.append_tokens(seq, prompt[cached:]))
            elif op == "append":
                seq = data.draw(st.sampled_from(live))
                tokens = data.draw(st.lists(alphabet, min_size=1, max_size=8))
                start = seq.num_tokens
                sim.record(seq, start, sim.manager.append_tokens(seq, tokens))
                if len(tokens) > 1 and data.draw(st.booleans()):  # a verify step's rejected drafts
                    sim.manager.truncate(seq, data.draw(st.integers(1, len(tokens) - 1)))
            elif op == "rollback":
                seq = data.draw(st.sampled_from(live))
                start = seq.num_tokens
                tokens = data.draw(st.lists(alphabet, min_size=2, max_size=6))
                sim.record(seq, start, sim.manager.append_tokens(seq, tokens))
                sim.manager.truncate(seq, len(tokens) - 1)
            elif op == "fork":
                parent = data.draw(st.sampled_from(live))
                sim.next_id += 1
                sim.seqs.append(sim.manager.fork(parent, sim.next_id))
            else:
                seq = data.draw(st.sampled_from(live))
                sim.manager.free(seq)
                sim.seqs.remove(seq)
        except NoFreeBlocksError:
            pass  # all or nothing: the checks below see an unchanged manager
        sim.check()
    for seq in sim.seqs:
        sim.manager.free(seq)
    sim.seqs.clear()
    sim.check()
    assert sim.pool.num_free_blocks == sim.pool.num_blocks


def test_a_sliding_hit_takes_only_the_window_and_truncating_below_it_is_refused():
    pool = BlockPool(40)
    manager = BlockManager(pool, 4, (None, 6))
    a = KVSequence(1)
    manager.append_tokens(a, list(range(24)))
    manager.free(a)  # its 6 full blocks stay cached in both groups
    b = KVSequence(2)
    n = manager.num_cached_prefix_tokens(b, list(range(24)) + [99])
    assert n == 24
    hit = manager.append_cached(b, list(range(24)))
    assert hit.num_cached_tokens == 24 and all(s == [-1] * 24 for s in hit.group_slots)
    # the next query (position 24) reads keys 19..24: the sliding group took blocks 4 and 5 only
    assert b.block_tables[1][:4] == [NULL_BLOCK] * 4 and b.num_released == [0, 4]
    assert len(b.block_tables[0]) == 6 and NULL_BLOCK not in b.block_tables[0]
    manager.append_tokens(b, [99])
    before = [list(t) for t in b.block_tables]
    with pytest.raises(ValueError, match="already released the blocks before token 16"):
        manager.truncate(b, 10)
    assert [list(t) for t in b.block_tables] == before
    manager.truncate(b, 1)
    # A sliding block lost outside the window does not spoil the hit; one inside it shortens it.
    hashes = list(b.block_hashes)
    manager.free(b)

    def lose(key):
        block = pool.acquire_cached(key)
        pool.unregister(block)
        pool.free([block])

    prompt = list(range(24)) + [99]
    lose((1, hashes[1]))
    assert manager.num_cached_prefix_tokens(KVSequence(3), prompt) == 24
    lose((1, hashes[5]))  # 24 tokens now need block 5; 20 tokens need blocks 3 and 4 only
    assert manager.num_cached_prefix_tokens(KVSequence(4), prompt) == 20
    pool.check_invariants()


def test_layout_splits_types_into_equal_groups_sharing_slots():
    layout = kv_layout([512] * 5 + [None] + [512] * 5 + [None])
    assert layout.num_slots == 2 and layout.num_padding_slots == 0 and layout.is_hybrid
    assert [g.sliding_window for g in layout.groups].count(None) == 1
    for g, group in enumerate(layout.groups):
        assert [layout.layer_slot[layer] for layer in group.layers] == list(range(len(group.layers)))
        assert all(layout.layer_group[layer] == g for layer in group.layers)
    uniform = kv_layout([None] * 4)
    assert len(uniform.groups) == 1 and uniform.layer_slot == (0, 1, 2, 3) and not uniform.is_hybrid
    padded = kv_layout([None, 8, 8, 8])  # 1 full layer, 3 sliding: groups of 1, no padding
    assert padded.num_slots == 1 and len(padded.groups) == 4
    uneven = kv_layout([None, None, 8, 8, 8])  # groups of 2: the last sliding group has one slot unused
    assert uneven.num_slots == 2 and uneven.num_padding_slots == 1
