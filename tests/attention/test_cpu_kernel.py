"""The native CPU kernel (`hf_paged.attention.cpu_kernel`, the "cpu" backend) against the naive oracle.

The same pools as the torch backend's tests (`test_torch_paged.make_paged_batch`: random
non-contiguous block tables, garbage in every slot nobody wrote, fp64 oracle), through a plan made
with `native=True`, so decode and verify runs go to the kernel and prefill chunks to the torch path
in the same call. Tolerance: fp32, 1e-5 absolute and relative, as for the torch backend.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged.attention import cpu_kernel, dispatch, torch_paged
from tests.attention.test_torch_paged import (
    HEAD_LAYOUTS, MIXED_BATCH, assert_matches, make_paged_batch, naive_batch,
)

pytestmark = pytest.mark.skipif(cpu_kernel.load() is None, reason=f"no CPU kernel: {cpu_kernel.load_error()}")


def native_plan(batch, block_size, workspace=None):
    plan = torch_paged.AttentionPlan(batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q,
                                     batch.max_seqlen_k, block_size, workspace=workspace, native=True)
    assert plan.short_runs is not None
    return plan


def run(batch, scale, plan, **features):
    return torch_paged.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q,
        batch.max_seqlen_q, batch.max_seqlen_k, scale, plan=plan, **features)


class CountCalls:
    """Counts the kernel's launches (wraps `cpu_kernel.attend`)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = cpu_kernel.attend

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(cpu_kernel, "attend", counted)


FEATURES = ["none", "window", "softcap", "sinks", "all"]


def features_for(feature, num_q_heads, seed):
    sinks = torch.randn(num_q_heads, generator=torch.Generator().manual_seed(seed)) * 2 + 4
    return {"none": {}, "window": dict(sliding_window=8), "softcap": dict(softcap=5.0), "sinks": dict(sinks=sinks),
            "all": dict(sliding_window=8, softcap=5.0, sinks=sinks)}[feature]


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEAD_LAYOUTS, ids=["1to1", "3to1", "5to1", "mqa"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_step_matches_oracle(block_size, num_q_heads, num_kv_heads, feature, monkeypatch):
    """A mixed step (empty, decode, verify, prefill and chunk rows): the kernel takes the short runs
    in one launch, the torch path the rest, and every token matches the oracle."""
    head_dim = 32
    batch = make_paged_batch(MIXED_BATCH, block_size, num_q_heads, num_kv_heads, head_dim, torch.float32,
                             seed=block_size * 7 + num_q_heads, query_scale=3.0)
    scale = head_dim ** -0.5
    features = features_for(feature, num_q_heads, seed=num_kv_heads)
    expected = naive_batch(batch, scale, **features)
    counter = CountCalls(monkeypatch)
    out = run(batch, scale, native_plan(batch, block_size, torch_paged.Workspace()), **features)
    assert counter.calls == 1
    assert_matches(out, expected, torch.float32)  # 1e-5


@pytest.mark.parametrize("head_dim", [16, 64, 128, 80])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(9, 3), (8, 1), (12, 4), (2, 2)])
def test_head_widths_and_groups(head_dim, num_q_heads, num_kv_heads):
    """The unrolled paths (D = 64 with up to 4 query heads per KV head, D = 128 in pairs) and the
    generic one, with group sizes that leave a partial set of rows."""
    rows = [(70, 1), (33, 3), (16, 1), (129, 16), (5, 5)]
    batch = make_paged_batch(rows, 16, num_q_heads, num_kv_heads, head_dim, torch.float32, seed=head_dim,
                             query_scale=2.0)
    scale = head_dim ** -0.5
    assert_matches(run(batch, scale, native_plan(batch, 16)), naive_batch(batch, scale), torch.float32)


@pytest.mark.parametrize("feature", ["none", "window", "all"])
@pytest.mark.parametrize("num_seqs,seq_len", [(1, 1000), (3, 517), (2, 16)])
def test_key_splits_merge(num_seqs, seq_len, feature):
    """Few long sequences are cut into key splits (more work items than threads); the merge of the
    partial maxima, denominators and outputs (and the sink) matches the oracle, including splits a
    sliding window leaves empty."""
    rows = [(seq_len, 1)] * num_seqs
    batch = make_paged_batch(rows, 16, 6, 2, 64, torch.float32, seed=seq_len, query_scale=3.0)
    scale = 64 ** -0.5
    features = features_for(feature, 6, seed=1)
    plan = native_plan(batch, 16)
    if seq_len >= 512:
        assert plan.short_runs.num_splits > 1
    assert_matches(run(batch, scale, plan, **features), naive_batch(batch, scale, **features), torch.float32)


def test_scores_that_underflow_and_dominate():
    """Scores far apart (query scale 40): most probabilities underflow to exactly 0 in the kernel's
    exp, one key dominates; the result still matches."""
    batch = make_paged_batch([(200, 1), (64, 4)], 16, 4, 2, 64, torch.float32, seed=5, query_scale=40.0)
    scale = 64 ** -0.5
    assert_matches(run(batch, scale, native_plan(batch, 16)), naive_batch(batch, scale), torch.float32)


def test_unsupported_tensors_take_the_torch_path(monkeypatch):
    """What the kernel does not read (fp64 queries, a head width that is not a multiple of 16, a
    query that autograd tracks) runs on the torch path through the same plan, and still matches."""
    counter = CountCalls(monkeypatch)
    wide = make_paged_batch(MIXED_BATCH, 16, 6, 2, 32, torch.float64, seed=3)
    out = run(wide, 0.2, native_plan(wide, 16))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, naive_batch(wide, 0.2), atol=1e-10, rtol=1e-10)  # fp64 throughout
    odd = make_paged_batch(MIXED_BATCH, 16, 6, 2, 40, torch.float32, seed=4)
    assert_matches(run(odd, 0.2, native_plan(odd, 16)), naive_batch(odd, 0.2), torch.float32)
    grad = make_paged_batch(MIXED_BATCH, 16, 6, 2, 32, torch.float32, seed=5)
    grad.query.requires_grad_(True)
    out = run(grad, 0.2, native_plan(grad, 16))
    assert out.requires_grad
    assert_matches(out.detach(), naive_batch(grad, 0.2), torch.float32)
    assert counter.calls == 0


def test_backend_choice(monkeypatch):
    """auto picks the kernel on the CPU; HF_PAGED_BACKEND=cpu asks for it; =torch keeps the torch path
    alone; =cpu on another device is a ValueError naming it."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    assert dispatch.backend(cpu) == "cpu"
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    assert dispatch.backend(cpu) == "torch"
    monkeypatch.setenv("HF_PAGED_BACKEND", "cpu")
    assert dispatch.backend(cpu) == "cpu"
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND=cpu runs on CPU tensors"):
        dispatch.backend(torch.device("meta"))


def test_dispatch_without_a_plan_uses_the_kernel(monkeypatch):
    """A call with no step plan (a caller outside a step) plans for itself with the same backend."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "cpu")
    counter = CountCalls(monkeypatch)
    batch = make_paged_batch(MIXED_BATCH, 16, 6, 2, 32, torch.float32, seed=9)
    out = dispatch.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                   batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, 0.2)
    assert counter.calls == 1
    assert_matches(out, naive_batch(batch, 0.2), torch.float32)


def test_build_failure_falls_back_with_a_reason(monkeypatch, tmp_path, caplog):
    """A compiler that fails: `load()` warns once with the reason and returns None, auto falls back to
    the torch path, and an explicit HF_PAGED_BACKEND=cpu is a ValueError that repeats the reason."""
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    monkeypatch.setenv("HF_PAGED_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exists, and fails on every input
    monkeypatch.setattr(cpu_kernel.shutil, "which", lambda name: "/bin/false")
    with caplog.at_level("WARNING"):
        assert cpu_kernel.load() is None
        assert cpu_kernel.load() is None
    assert sum("could not be built" in r.message for r in caplog.records) == 1
    assert cpu_kernel.load_error()
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    assert dispatch.backend(torch.device("cpu")) == "torch"
    monkeypatch.setenv("HF_PAGED_BACKEND", "cpu")
    with pytest.raises(ValueError, match="could not be built"):
        dispatch.backend(torch.device("cpu"))
    assert not list(tmp_path.glob("*.so"))  # no half-written library left behind


def test_build_is_cached_by_content(monkeypatch, tmp_path):
    """A fresh process state builds once into the cache directory, and a second load reuses the file."""
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    monkeypatch.setenv("HF_PAGED_KERNEL_CACHE", str(tmp_path))
    assert cpu_kernel.load() is not None
    built = list(tmp_path.glob("paged_attention-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    assert cpu_kernel.load() is not None
    assert built[0].stat().st_mtime_ns == stamp


def test_a_block_id_outside_the_pool_is_an_index_error():
    """The kernel reads whatever a block id points at, so an id past the pool is refused before the
    call (IndexError, as the torch path's indexing would raise), never read."""
    batch = make_paged_batch([(40, 1), (20, 1)], 16, 6, 2, 32, torch.float32, seed=8)
    batch.block_tables[1, 0] = batch.key_cache.shape[0]  # one past the last block
    with pytest.raises(IndexError, match="outside the pool"):
        run(batch, 0.2, native_plan(batch, 16))
    batch.block_tables[1, 0] = -1
    with pytest.raises(IndexError, match="outside the pool"):
        run(batch, 0.2, native_plan(batch, 16))


def test_a_table_too_narrow_for_its_sequence_is_a_value_error():
    batch = make_paged_batch([(40, 1)], 16, 6, 2, 32, torch.float32, seed=9)
    narrow = batch.block_tables[:, :2]  # 40 tokens need 3 blocks
    with pytest.raises(ValueError, match="needs 3 blocks"):
        torch_paged.AttentionPlan(narrow, batch.seq_lens, batch.cu_seqlens_q, 1, 40, 16, native=True)
