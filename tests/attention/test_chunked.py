"""Chunked local attention (Llama 4's `attention_chunk_size`) in every backend, against the fp64 oracle.

A query at position p sees keys (p // C) * C .. p (positions per sequence from 0); with a sliding
window too, both lower bounds apply. The pools are the torch backend's hand-built ones
(`test_torch_paged.make_paged_batch`: random non-contiguous block tables, garbage in every slot
nobody wrote), and on top of that every key that no query of the step may see (the blocks of past
chunks, and of the window) is overwritten with large finite values, in the pool and in the oracle's
dense copy: the oracle gives them weight exactly 0, so a backend that reads one is swamped.

Shapes are awkward on purpose: chunks of 8, 13 and 24 over blocks of 1, 16 and 32 (chunks that are
not multiples of the block, blocks that hold two chunks' edges), prompts crossing three to seven
chunks, a prefill chunk whose first query sits inside a chunk, decode (q_len 1) and verify (k + 1
queries) runs at chunk edges, GQA 1:1, 3:1, 5:1 and MQA. Triton runs under its interpreter
(fp32/fp16), so the cases combine the values instead of taking their product.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from hf_paged.attention import cpu_kernel, dispatch, flex_paged, reference, torch_paged
from hf_paged.attention.backend import MaskRule
from tests.attention.test_torch_paged import GARBAGE, assert_matches, make_paged_batch, naive_batch

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="runs the Triton kernels under the interpreter (no CUDA)")
needs_cpu_kernel = pytest.mark.skipif(cpu_kernel.load() is None, reason=f"no CPU kernel: {cpu_kernel.load_error()}")

# id: (rows of (seq_len, q_len), block_size, chunk, num_q_heads, num_kv_heads, head_dim, window)
SHORT = {  # at most 16 queries per sequence: Triton's decode kernel, the CPU kernel's runs
    # decode and verify (k=3) over 7 chunks; p = 7, 8 straddle the first edge; an empty row
    "c8-bs1-3to1": ([(50, 1), (27, 4), (8, 1), (9, 1), (40, 0), (26, 5)], 1, 8, 6, 2, 32, None),
    # p = 12 ends chunk 0, a verify run 10..13 crosses into chunk 1, p = 25 ends chunk 1
    "c13-bs16-5to1": ([(97, 1), (39, 4), (13, 1), (14, 4), (26, 1)], 16, 13, 10, 2, 32, None),
    # chunks shorter than the block: p = 23 / 24 are the last / first of a chunk inside block 0
    "c24-bs32-1to1": ([(72, 1), (48, 4), (25, 1), (24, 1)], 32, 24, 4, 4, 16, None),
    # a window of 5 in chunks of 8: it binds for p % 8 >= 5 (p = 29, 45, 46), the chunk for the rest
    "c8-bs16-win5": ([(60, 3), (33, 1), (18, 2), (30, 1), (47, 3)], 16, 8, 6, 2, 32, 5),
}
LONG = {  # prefill runs (more than 16 queries): Triton's prefill kernel, the torch path's long groups
    # a whole prompt over 5 chunks; a chunk of 20 queries starting at 25, inside chunk [13, 26)
    "c13-bs16-3to1": ([(60, 60), (45, 20), (26, 1), (39, 4)], 16, 13, 6, 2, 32, None),
    # queries 50..79 start inside [48, 72) and cross into [72, 96)
    "c24-bs32-1to1": ([(75, 75), (80, 30), (24, 4)], 32, 24, 4, 4, 16, None),
    # block size 1, MQA, a chunked prefill starting exactly at a chunk edge (8)
    "c8-bs1-mqa": ([(41, 33), (17, 17)], 1, 8, 5, 1, 16, None),
    # blocks of 32 hold parts of three 13-token chunks
    "c13-bs32-3to1": ([(90, 50), (13, 13), (40, 2)], 32, 13, 6, 2, 32, None),
    # a window wider than the chunk: the chunk bound binds everywhere
    "c24-bs16-win30": ([(70, 40), (30, 30)], 16, 24, 6, 2, 32, 30),
}
CASES = {**{f"short-{k}": v for k, v in SHORT.items()}, **{f"long-{k}": v for k, v in LONG.items()}}


def chunked_batch(case_id: str, dtype=torch.float32, seed: int = 0):
    """The case's pool with every key no query of the step may see poisoned; (batch, features)."""
    rows, block_size, chunk, num_q_heads, num_kv_heads, head_dim, window = CASES[case_id]
    batch = make_paged_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, dtype, seed=seed,
                             query_scale=3.0)
    rule = MaskRule(window, chunk)
    gen = torch.Generator().manual_seed(seed + 1)
    tables, cu = batch.block_tables.tolist(), batch.cu_seqlens_q.tolist()
    poisoned = 0
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        if cu[b + 1] == cu[b]:
            continue
        lo = rule.lower_bound(seq_len - (cu[b + 1] - cu[b]))  # the step's first query has the lowest bound
        for cache, dense in ((batch.key_cache, batch.keys[b]), (batch.value_cache, batch.values[b])):
            huge = ((torch.rand(lo, *dense.shape[1:], generator=gen) * 2 - 1) * GARBAGE).to(dtype)
            dense[:lo] = huge
            for p in range(lo):
                cache[tables[b][p // block_size], p % block_size] = huge[p]
        poisoned += lo
    assert poisoned > 0
    return batch, dict(sliding_window=window, chunk_size=chunk)


def expected_of(batch, features):
    expected = naive_batch(batch, 0.2, **features)
    unchunked = naive_batch(batch, 0.2, sliding_window=features["sliding_window"])
    assert (unchunked - expected).abs().max() > 10  # the poison is live: reading it would show
    return expected


def attend(batch, plan=None, **features):
    return dispatch.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                    batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k,
                                    0.2, plan=plan, **features)


def step_plan(batch, name):
    return dispatch.plan(SimpleNamespace(seq_lens=batch.seq_lens), backend=name)


def test_mask_rule_and_oracle_see_exactly_the_chunk():
    """The rule, written out: C = 4 over 11 positions, with and without a window of 3. The oracle
    (values = one-hot positions, so each output row is its query's attention weights) puts weight on
    exactly the visible keys."""
    rule = MaskRule(chunk=4)
    assert [rule.lower_bound(p) for p in range(11)] == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8]
    both = MaskRule(window=3, chunk=4)
    assert [both.lower_bound(p) for p in range(11)] == [0, 0, 0, 1, 4, 4, 4, 5, 8, 8, 8]
    values = torch.eye(11)[:, None, :]  # [seq_len, 1 head, 11]: value j is the one-hot of j
    keys = torch.zeros(11, 1, 4)  # equal scores: uniform weights over the visible keys
    for mask in (rule, both):
        weights = reference.causal_attention(torch.ones(11, 1, 4), keys, values, 1.0, mask.window,
                                             chunk_size=mask.chunk)[:, 0]  # [q, k]
        for p in range(11):
            seen = (weights[p] > 0).nonzero().flatten().tolist()
            assert seen == list(range(mask.lower_bound(p), p + 1))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
            MaskRule(chunk=bad)


@pytest.mark.parametrize("case_id", list(CASES))
def test_torch_backend(case_id):
    """The torch path: short runs bucketed, long runs alone, masks memoised per (window, chunk)."""
    batch, features = chunked_batch(case_id)
    plan = torch_paged.AttentionPlan(batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q,
                                     batch.max_seqlen_k, batch.key_cache.shape[1])
    out = torch_paged.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                      batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k,
                                      0.2, plan=plan, **features)
    assert_matches(out, expected_of(batch, features), torch.float32)  # 1e-5
    assert {key for group in plan.groups for key in group._masks} <= {(features["sliding_window"],
                                                                      features["chunk_size"])}


@pytest.mark.parametrize("case_id", ["short-c13-bs16-5to1", "long-c13-bs16-3to1"])
def test_torch_backend_fp16_and_through_dispatch(case_id):
    batch, features = chunked_batch(case_id, torch.float16, seed=3)
    assert_matches(attend(batch, step_plan(batch, "torch"), **features), expected_of(batch, features),
                   torch.float16)  # 1e-2


@needs_cpu_kernel
@pytest.mark.parametrize("case_id", list(CASES))
def test_cpu_kernel(case_id, monkeypatch):
    """The native kernel takes every short run (one launch, given the chunk), the torch path the long ones."""
    calls = []
    real = cpu_kernel.attend
    monkeypatch.setattr(cpu_kernel, "attend", lambda *a, **k: calls.append(a[14]) or real(*a, **k))
    batch, features = chunked_batch(case_id, seed=5)
    out = attend(batch, step_plan(batch, "cpu"), **features)
    assert_matches(out, expected_of(batch, features), torch.float32)  # 1e-5
    has_short_runs = any(0 < q <= 16 for _, q in CASES[case_id][0])
    assert calls == ([features["chunk_size"]] if has_short_runs else [])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_triton_kernels(case_id, dtype, monkeypatch):
    """Short steps through the split-KV decode kernel (up to 16 queries per sequence), the others
    through the prefill kernel; each with a plan whose key names the chunk."""
    from hf_paged.attention.triton import decode, prefill

    launches = []
    for module, name in ((decode, "paged_decode"), (prefill, "flash_prefill")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: launches.append(
            (_name, k["chunk_size"])) or _real(*a, **k))
    batch, features = chunked_batch(case_id, dtype, seed=7)
    plan = step_plan(batch, "triton")
    out = attend(batch, plan, **features)
    assert_matches(out, expected_of(batch, features), dtype)  # fp32 1e-5, fp16 1e-2
    kernel = "paged_decode" if case_id.startswith("short") else "flash_prefill"
    assert launches == [(kernel, features["chunk_size"])]
    assert [key[-1] for key in plan._triton] == [MaskRule(features["sliding_window"], features["chunk_size"])]


@needs_interpreter
def test_triton_decode_splits_skip_past_chunks():
    """A long decode run split along the keys: splits before the chunk start hold nothing, the merge
    still matches (and the default split count is capped by the chunk, as by a window)."""
    from hf_paged.attention.triton.decode import default_num_splits, paged_decode

    assert default_num_splits(1, 2, 6, 32, 1, 4000, torch.device("cpu"), chunk_size=24) == 1
    batch = make_paged_batch([(300, 1), (170, 4)], 16, 6, 2, 32, torch.float32, seed=9, query_scale=3.0)
    features = dict(sliding_window=None, chunk_size=13)
    out = paged_decode(batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
                       batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, 0.2, num_splits=3, **features)
    assert_matches(out, naive_batch(batch, 0.2, **features), torch.float32)


def test_flex_backend():
    """FlexAttention's block mask lists only the chunk's blocks and its mask_mod applies the bound
    (two prefill runs of one padded shape: one compile, which costs seconds on the CPU)."""
    batch, features = chunked_batch("long-c8-bs1-mqa", seed=11)
    plan = flex_paged.FlexPlan(batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.key_cache.shape[1],
                               batch.key_cache.shape[0])
    out = flex_paged.paged_attention(batch.query, batch.key_cache, batch.value_cache, plan, 0.2,
                                     features["sliding_window"], chunk_size=features["chunk_size"])
    assert_matches(out, expected_of(batch, features), torch.float32)  # 1e-5
