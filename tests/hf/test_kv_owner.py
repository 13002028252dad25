"""`KVOwner`'s kept sequences: held until taken, freed, trimmed, forked or evicted, with every block
accounted for after each operation."""

from __future__ import annotations

import pytest

from hf_paged import PagedCache
from hf_paged.hf import KVOwner
from tiny_models import tiny_model


@pytest.fixture
def kv():
    model = tiny_model("llama", "hf_paged")
    return PagedCache(model.config, block_size=4, num_blocks=32).kv


def _sequence(kv: KVOwner, num_tokens: int):
    seq = kv.new_sequence()
    kv.manager.append_tokens(seq, list(range(3, 3 + num_tokens)))
    return seq


def _check(kv: KVOwner):
    kv.pool.check_invariants()


def test_keep_take_free(kv):
    seq = _sequence(kv, 10)
    assert kv.keep(seq, 9) and kv.holds(seq) and seq.num_tokens == 9 and kv.num_kept == 1
    assert kv.take(seq) and not kv.holds(seq) and not kv.take(seq)  # handed over once
    kv.free_sequence(seq)
    assert kv.num_used_blocks == 0
    other = _sequence(kv, 5)
    kv.keep(other, 5)
    kv.free([other, None, other])  # already-freed and None entries are skipped
    assert kv.num_kept == 0 and kv.num_used_blocks == 0
    _check(kv)


def test_trim_fork_and_evict(kv):
    seq = _sequence(kv, 12)
    kv.keep(seq, 12)
    assert kv.trim(seq, 7) and seq.num_tokens == 7
    fork = kv.fork(seq)
    assert fork is not None and kv.holds(fork) and fork.block_tables == seq.block_tables
    assert kv.fork(_sequence(kv, 3)) is None  # not kept here
    assert kv.evict_kept() and kv.num_kept == 0 and not kv.evict_kept()
    _check(kv)


def test_release_later_applies_at_the_next_apply(kv):
    seq = _sequence(kv, 6)
    kv.keep(seq, 6)
    kv.release_later([seq])
    assert kv.holds(seq)
    kv.apply_releases()
    assert not kv.holds(seq) and kv.num_used_blocks == 0
    _check(kv)


def test_export_needs_a_kept_sequence(kv):
    with pytest.raises(ValueError, match="keeps"):
        kv.export(_sequence(kv, 4))
