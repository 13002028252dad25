"""The FlexAttention backend (`hf_paged.attention.flex_paged`, `HF_PAGED_BACKEND=flex`) against the
naive oracle, on the torch backend's hand-built pools (`test_torch_paged.make_paged_batch`: random
non-contiguous block tables, garbage in every unwritten slot, fp64 oracle).

Every distinct shape compiles a kernel (seconds each on a CPU), so the cases share shapes: rows whose
long runs all pad to one tile bucket, one pool size per block size. fp32, 1e-5 as for the other
backends.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged.attention import dispatch, flex_paged
from tests.attention.test_torch_paged import assert_matches, make_paged_batch, naive_batch

# Empty, decode, verify (4 and 16 queries: still short), a full prefill and chunks over a cached
# prefix (17-60 queries: one 64-row tile each), seq lens that fill a 16-block exactly or leave one.
ROWS = [(54, 0), (17, 4), (1, 1), (16, 16), (97, 1), (40, 40), (54, 20), (32, 1), (77, 17), (60, 60), (16, 0)]


def run(batch, scale, **features):
    plan = flex_paged.FlexPlan(batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.key_cache.shape[1],
                               batch.key_cache.shape[0])
    return flex_paged.paged_attention(batch.query, batch.key_cache, batch.value_cache, plan, scale, **features)


@pytest.mark.parametrize("feature", ["none", "all"])
def test_mixed_step_matches_oracle(feature):
    """Short runs in one call, each long run in its own, GQA 3:1; "all" = a sliding window and softcap
    together, each of which moves the oracle here (sinks: `test_sinks_take_the_torch_path_on_cpu`)."""
    batch = make_paged_batch(ROWS, 16, 6, 2, 32, torch.float32, seed=11, query_scale=3.0)
    scale = 32 ** -0.5
    features = {} if feature == "none" else dict(sliding_window=8, softcap=5.0)
    expected = naive_batch(batch, scale, **features)
    for name in features:
        assert (expected - naive_batch(batch, scale, **{**features, name: None})).abs().max() > 0.05
    assert_matches(run(batch, scale, **features), expected, torch.float32)  # 1e-5


@pytest.mark.parametrize("block_size,num_q_heads,num_kv_heads", [(1, 4, 4), (32, 10, 2)], ids=["b1-1to1", "b32-5to1"])
def test_block_sizes_and_head_layouts(block_size, num_q_heads, num_kv_heads):
    rows = [(33, 1), (5, 1), (70, 3), (64, 1)]
    batch = make_paged_batch(rows, block_size, num_q_heads, num_kv_heads, 32, torch.float32, seed=block_size)
    assert_matches(run(batch, 0.2), naive_batch(batch, 0.2), torch.float32)


def test_shared_prefix_blocks():
    """Two sequences that share their first blocks (prefix caching: the same physical blocks at the
    same positions) and diverge after, both decoding."""
    batch = make_paged_batch([(40, 1), (40, 1)], 16, 6, 2, 32, torch.float32, seed=21)
    # sequence 1 reads sequence 0's first two blocks, and its own third
    batch.block_tables[1, :2] = batch.block_tables[0, :2]
    batch.keys[1][:32] = batch.keys[0][:32]
    batch.values[1][:32] = batch.values[0][:32]
    assert_matches(run(batch, 0.2), naive_batch(batch, 0.2), torch.float32)


def test_dispatch_routes_flex_and_falls_back(monkeypatch):
    """HF_PAGED_BACKEND=flex goes through flex for what it reads; a mixed-dtype cache, a query autograd
    tracks, or sinks on the CPU take the torch path instead (and still match)."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "flex")
    assert dispatch.backend(torch.device("cpu")) == "flex"
    calls = []
    real = flex_paged.paged_attention
    monkeypatch.setattr(flex_paged, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    batch = make_paged_batch(ROWS, 16, 6, 2, 32, torch.float32, seed=11, query_scale=3.0)

    def through_dispatch(b):
        return dispatch.paged_attention(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                        b.cu_seqlens_q, b.max_seqlen_q, b.max_seqlen_k, 0.2)

    assert_matches(through_dispatch(batch), naive_batch(batch, 0.2), torch.float32)
    assert calls == [1]
    half = make_paged_batch(ROWS, 16, 6, 2, 32, torch.float32, seed=12)
    half.key_cache, half.value_cache = half.key_cache.half(), half.value_cache.half()
    half.keys = [k.half().float() for k in half.keys]
    half.values = [v.half().float() for v in half.values]
    assert_matches(through_dispatch(half), naive_batch(half, 0.2), torch.float32)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(2)) * 2 + 4
    assert_matches(dispatch.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                            batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q,
                                            batch.max_seqlen_k, 0.2, sinks=sinks),
                   naive_batch(batch, 0.2, sinks=sinks), torch.float32)
    batch.query.requires_grad_(True)
    assert_matches(through_dispatch(batch).detach(), naive_batch(batch, 0.2), torch.float32)
    assert calls == [1]


def test_compiles_once_per_bucket():
    """A second step of the same bucket (4 query rows padded from 3 and 4, other lengths and tables,
    a pool of the same size, new mask closures) compiles nothing new: torch.compile builds no new graph."""
    from torch._dynamo.utils import counters

    first = make_paged_batch([(30, 1), (45, 1), (12, 1)], 16, 6, 2, 32, torch.float32, seed=31)
    run(first, 0.2)
    graphs, recorded = counters["stats"]["unique_graphs"], dict(flex_paged.compile_seconds)
    second = make_paged_batch([(31, 1), (9, 1), (20, 1), (10, 1)], 16, 6, 2, 32, torch.float32, seed=32)
    assert second.key_cache.shape == first.key_cache.shape  # 6 blocks used + 3 spare in both
    assert_matches(run(second, 0.2), naive_batch(second, 0.2), torch.float32)
    assert counters["stats"]["unique_graphs"] == graphs
    assert flex_paged.compile_seconds == recorded


def test_shapes_past_the_compile_limit_run_on_the_torch_path(monkeypatch, caplog):
    """Past torch.compile's limit flex would run eagerly, which reads the block mask wrongly (it
    attended garbage slots when measured); instead the call returns None and dispatch runs the torch
    path, with one warning."""
    monkeypatch.setattr(flex_paged, "RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(flex_paged, "_warned", [])
    monkeypatch.setenv("HF_PAGED_BACKEND", "flex")
    with caplog.at_level("WARNING", logger="hf_paged.attention.flex_paged"):
        for block_size, heads in ((8, (3, 1)), (8, (4, 2))):  # two new shapes: at most one compiles
            b = make_paged_batch([(21, 1), (9, 3)], block_size, *heads, 32, torch.float32, seed=41)
            out = dispatch.paged_attention(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens,
                                           b.cu_seqlens_q, b.max_seqlen_q, b.max_seqlen_k, 0.2)
            assert_matches(out, naive_batch(b, 0.2), torch.float32)
    assert sum("the most it keeps" in r.message for r in caplog.records) == 1
