"""The sliding-window rule of KV groups: grouping, and no block freed while a query can still read it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.core.kv_groups import (KVGroup, blocks_held, first_readable_position, kv_groups,
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
