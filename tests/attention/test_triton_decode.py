"""The Triton split-KV decode kernel and the Triton store kernel against the naive torch reference (`hf_paged.attention.reference`).

These run under Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, set by conftest.py when
there is no GPU). Every batch is built by `triton_store_kv.store_kv` into a pool full of large
garbage (checked bitwise against `reference.store_kv`), and read through block tables whose unused
entries are garbage too: out-of-range and negative block ids that the kernel must never follow. The
reference gets the same table with those entries replaced by valid ids (it gathers them, then
masks). The oracle is `reference.paged_attention` in fp32 on the same (already rounded) inputs.

The interpreter is slow, so the cases below combine the awkward values instead of taking their
product; each listed value (query lengths, sequence lengths, block sizes, head layouts, features,
dtypes, split counts) appears in at least one case.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="interpreter tests of the Triton kernels: need TRITON_INTERPRET=1 (conftest sets it without CUDA)",
)

triton = pytest.importorskip("triton")

from hf_paged.attention import reference  # noqa: E402
from hf_paged.attention.triton.decode import default_num_splits, paged_decode  # noqa: E402
from hf_paged.attention.triton.store_kv import store_kv  # noqa: E402

GARBAGE = 1e4  # never-written pool slots; fits fp16, and any unmasked read of one swamps the output
NUM_SPARE_BLOCKS = 3

# Tolerances (atol, rtol) by dtype against the fp32 reference on the same inputs. fp32: both sides
# accumulate in fp32 in a different order (observed ~4e-7). fp16: the kernel rounds the softmax
# weights to fp16 for the P @ V product and rounds the output (observed ~1e-3).
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2)}

# (seq_len, q_len) rows.
# Decode rows of all the awkward lengths in one batch: 1, 15/16/17 around a 16-block edge, 54, 97.
DECODE = [(97, 1), (1, 1), (15, 1), (16, 1), (17, 1), (54, 1)]
# Speculative verify (k=3, q_len 4) mixed with decode, with q_len 0 rows first and last, and a
# sequence that is nothing but its 4 new tokens.
VERIFY = [(54, 0), (17, 4), (97, 4), (1, 1), (4, 4), (16, 4), (33, 0)]
# Longer query runs (k=15, and a short prefill chunk). With a 12:1 group only 10 query tokens fit
# in one program's 128 rows, so a sequence spans two query tiles (10 + 6).
LONG_VERIFY = [(40, 16), (16, 16), (97, 3), (0, 0)]


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, width] int32, garbage past each sequence
    ref_block_tables: torch.Tensor  # same, with the garbage replaced by valid block ids
    seq_lens: torch.Tensor  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int


def scattered_block_tables(seq_lens, block_size, num_spare_blocks, gen):
    """(num_blocks, block_tables, ref_block_tables): each sequence's blocks are a random permutation of
    the pool; table entries past a sequence's blocks are garbage ids (any int32) in `block_tables` and
    valid ids in `ref_block_tables` (for the torch reference, which gathers them)."""
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + num_spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = max(blocks_per_seq) + 2
    block_tables = torch.randint(-2**31, 2**31 - 1, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    ref_block_tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = ref_block_tables[b, :n] = perm[start:start + n]
        start += n
    return num_blocks, block_tables, ref_block_tables


def make_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, dtype, seed, query_scale=3.0,
               hnd_cache=False, strided_query=False):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [s for s, _ in rows]
    q_lens = [q for _, q in rows]
    num_blocks, block_tables, ref_block_tables = scattered_block_tables(seq_lens, block_size, NUM_SPARE_BLOCKS, gen)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    garbage = [((torch.rand(*shape, generator=gen) * 2 - 1) * GARBAGE).to(dtype) for _ in range(2)]
    if hnd_cache:  # [num_blocks, num_kv_heads, block_size, head_dim] in memory: strided slot/head dims
        caches = [g.transpose(1, 2).contiguous().transpose(1, 2) for g in garbage]
    else:
        caches = [g.clone() for g in garbage]
    key_cache, value_cache = caches

    # Every position of every sequence, plus slot -1 tokens whose rows must land nowhere.
    tables = block_tables.tolist()
    slots = [tables[b][p // block_size] * block_size + p % block_size
             for b, s in enumerate(seq_lens) for p in range(s)]
    num_skipped = 5
    slots += [-1] * num_skipped
    num_writes = len(slots)
    keys = torch.randn(num_writes, num_kv_heads, head_dim, generator=gen).to(dtype)
    values = torch.randn(num_writes, num_kv_heads, head_dim, generator=gen).to(dtype)
    keys[-num_skipped:], values[-num_skipped:] = -7.0, 7.0
    order = torch.randperm(num_writes, generator=gen)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)[order]
    keys, values = keys[order], values[order]

    expected_k, expected_v = garbage[0].clone(), garbage[1].clone()
    reference.store_kv(keys, values, expected_k, expected_v, slot_mapping)
    store_kv(keys, values, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k)  # a copy: bitwise
    assert torch.equal(value_cache, expected_v)

    num_tokens = sum(q_lens)
    query = (torch.randn(num_tokens, num_q_heads + 3, head_dim, generator=gen) * query_scale).to(dtype)
    query = query[:, 1:num_q_heads + 1] if strided_query else query[:, :num_q_heads].contiguous()
    return Batch(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
        ref_block_tables=ref_block_tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens),
    )


def run_reference(batch, scale, **features):
    sinks = features.get("sinks")
    features = {**features, "sinks": None if sinks is None else sinks.float()}
    return reference.paged_attention(
        batch.query.float(), batch.key_cache.float(), batch.value_cache.float(), batch.ref_block_tables,
        batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, scale, **features,
    )


def run_triton(batch, scale, num_splits=None, **features):
    return paged_decode(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, scale, num_splits=num_splits, **features,
    )


# id: rows, block_size, (num_q_heads, num_kv_heads), head_dim, dtype, sliding_window, softcap, sinks,
# num_splits, layout extras. Splits: None (auto, 1 here), 1, 2, 3, and 8 > the 1-2 key tiles of 64.
CASES = {
    "decode-bs16-1to1-fp32": (DECODE, 16, (2, 2), 64, torch.float32, None, None, False, 1, {}),
    "decode-bs1-3to1-win-fp32-3splits": (DECODE, 1, (6, 2), 64, torch.float32, 8, None, False, 3, {}),
    "decode-bs32-mqa-cap-sinks-fp16-auto": (DECODE, 32, (4, 1), 128, torch.float16, None, 5.0, True, None,
                                            {"strided_query": True}),
    "decode-bs16-3to1-d80-sinks-fp16-2splits": (DECODE, 16, (6, 2), 80, torch.float16, None, None, True, 2,
                                                {"hnd_cache": True}),
    "verify-bs32-5to1-cap-sinks-fp32-8splits": (VERIFY, 32, (10, 2), 128, torch.float32, None, 5.0, True, 8, {}),
    "verify-bs16-mqa-win-cap-sinks-fp16-auto": (VERIFY, 16, (5, 1), 64, torch.float16, 16, 5.0, True, None, {}),
    "verify-bs1-1to1-win3-fp32-1split": (VERIFY, 1, (2, 2), 64, torch.float32, 3, None, False, 1,
                                         {"hnd_cache": True}),
    "verify-bs16-3to1-d256-win-sinks-fp32-3splits": (VERIFY, 16, (3, 1), 256, torch.float32, 6, None, True, 3,
                                                     {"strided_query": True}),
    "long-verify-bs16-12to1-fp32-2splits": (LONG_VERIFY, 16, (24, 2), 64, torch.float32, None, None, False, 2, {}),
    "long-verify-bs32-mqa-win-cap-fp16-1split": (LONG_VERIFY, 32, (4, 1), 96, torch.float16, 20, 5.0, False, 1, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_paged_decode_matches_reference(case):
    rows, block_size, (num_q_heads, num_kv_heads), head_dim, dtype, window, softcap, use_sinks, num_splits, extra = \
        CASES[case]
    batch = make_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, dtype, seed=len(case), **extra)
    scale = head_dim ** -0.5
    sinks = None
    if use_sinks:
        sinks = torch.randn(num_q_heads, generator=torch.Generator().manual_seed(3)) * 2
    features = dict(sliding_window=window, softcap=softcap, sinks=sinks)

    out = run_triton(batch, scale, num_splits=num_splits, **features)
    expected = run_reference(batch, scale, **features)
    assert out.dtype == dtype and out.shape == expected.shape
    atol, rtol = TOLERANCES[dtype]  # fp32 1e-5, fp16 1e-2
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)

    # Each feature switched on must change the answer here, or a kernel ignoring it would pass.
    for name, value in features.items():
        if value is not None:
            without = run_reference(batch, scale, **{**features, name: None})
            assert (expected - without).abs().max() > 0.05, f"{name} does not change case {case}"


def test_split_counts_agree():
    # 1 split (direct write), a few, and far more splits than key tiles (most of them empty): all the
    # same answer, with sinks applied exactly once on either path.
    batch = make_batch(VERIFY, 16, 6, 2, 64, torch.float32, seed=5)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(4))
    outs = [run_triton(batch, 0.125, num_splits=n, sinks=sinks, softcap=5.0) for n in (1, 2, 5, 16)]
    expected = run_reference(batch, 0.125, sinks=sinks, softcap=5.0)
    for out in outs:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)  # fp32


def test_only_empty_queries_and_empty_batch():
    batch = make_batch([(17, 0), (54, 0)], 16, 6, 2, 64, torch.float32, seed=6)
    assert run_triton(batch, 0.125).shape == (0, 6, 64)
    empty = torch.zeros(0, dtype=torch.int32)
    out = paged_decode(torch.zeros(0, 6, 64), batch.key_cache, batch.value_cache, batch.block_tables[:0],
                       empty, torch.zeros(1, dtype=torch.int32), 0, 0, 0.125)
    assert out.shape == (0, 6, 64)


def test_store_kv_casts_skips_and_reads_strided_rows():
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(3, 4, 2, 40, generator=gen).half()
    value_cache = torch.randn(3, 4, 2, 40, generator=gen).half()
    before_k, before_v = key_cache.clone(), value_cache.clone()
    # fp32 rows into an fp16 cache, from a fused [tokens, heads, 2 * head_dim] tensor (strided rows).
    fused = torch.randn(4, 2, 80, generator=gen)
    key, value = fused[..., :40], fused[..., 40:]
    slot_mapping = torch.tensor([5, -1, 11, -1])
    store_kv(key, value, key_cache, value_cache, slot_mapping)
    reference.store_kv(key, value, before_k, before_v, slot_mapping)
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)  # bitwise
    assert torch.equal(key_cache[1, 1], key[0].half()) and torch.equal(value_cache[2, 3], value[2].half())
    store_kv(key, value, key_cache, value_cache, torch.full((4,), -1))  # all skipped: untouched
    store_kv(key[:0], value[:0], key_cache, value_cache, slot_mapping[:0])  # empty: untouched
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)


def test_default_num_splits():
    cpu = torch.device("cpu")  # counts 8 SMs off-GPU, so the target is 16 programs
    # One long sequence on one KV head: split until 16 programs, 256+ keys each.
    assert default_num_splits(1, 1, 8, 128, 1, 100_000, cpu) == 16
    assert default_num_splits(1, 1, 8, 128, 1, 1_000, cpu) == 4  # capped by keys per split
    assert default_num_splits(64, 8, 32, 128, 1, 100_000, cpu) == 1  # plenty of programs already
    assert default_num_splits(1, 1, 8, 128, 1, 100_000, cpu, sliding_window=512) == 2  # the window caps the keys
    assert default_num_splits(1, 1, 8, 128, 1, 1, cpu) == 1


@pytest.mark.parametrize("change, message", [
    (dict(block_tables=lambda b: b.block_tables.long()), "block_tables must be int32"),
    (dict(seq_lens=lambda b: b.seq_lens.long()), "seq_lens must be int32"),
    (dict(cu_seqlens_q=lambda b: b.cu_seqlens_q.long()), "cu_seqlens_q must be int32"),
    (dict(query=lambda b: b.query.half()), "share a dtype"),
    (dict(query=lambda b: b.query.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous in its last"),
    (dict(query=lambda b: b.query[:, :5]), "multiple of num_kv_heads"),
    (dict(max_seqlen_k=lambda b: 10_000), "fewer than max_seqlen_k"),
    (dict(sinks=lambda b: torch.zeros(5)), "sinks must be"),
    (dict(num_splits=lambda b: 0), "num_splits"),
])
def test_paged_decode_rejects_bad_inputs(change, message):
    batch = make_batch([(17, 1)], 16, 6, 2, 64, torch.float32, seed=8)
    args = dict(query=batch.query, key_cache=batch.key_cache, value_cache=batch.value_cache,
                block_tables=batch.block_tables, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q,
                max_seqlen_q=1, max_seqlen_k=17, scale=0.125)
    args.update({name: make(batch) for name, make in change.items()})
    with pytest.raises(ValueError, match=message):
        paged_decode(**args)


def test_store_kv_rejects_bad_inputs():
    cache = torch.zeros(2, 4, 2, 8)
    key = torch.ones(3, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        store_kv(key, key, cache, cache.clone(), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="per slot"):
        store_kv(torch.ones(3, 1, 8), torch.ones(3, 1, 8), cache, cache.clone(), torch.zeros(3, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------- #
# K and V of different head widths, and a 16-bit KV cache under an fp32 query


def make_unequal_kv_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, head_dim_v, dtype, seed, **extra):
    """V rows `head_dim_v` wide: K and the query from one `make_batch`, V from another with the same
    seed (the block tables are drawn before anything head_dim-sized, so they agree)."""
    k_batch = make_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, dtype, seed, **extra)
    v_batch = make_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim_v, dtype, seed, **extra)
    assert torch.equal(k_batch.block_tables, v_batch.block_tables)
    k_batch.value_cache = v_batch.value_cache
    return k_batch


# id: rows, block_size, (num_q_heads, num_kv_heads), head_dim, head_dim_v, window, softcap, sinks, num_splits
UNEQUAL_CASES = {
    "decode-bs16-3to1-k64-v32-3splits": (DECODE, 16, (6, 2), 64, 32, None, None, False, 3),
    "verify-bs1-mqa-k48-v80-win-cap-sinks-1split": (VERIFY, 1, (4, 1), 48, 80, 6, 5.0, True, 1),
    "verify-bs32-1to1-k16-v24-sinks-2splits": (VERIFY, 32, (2, 2), 16, 24, None, None, True, 2),
}


@pytest.mark.parametrize("case", list(UNEQUAL_CASES))
def test_paged_decode_unequal_kv_head_dims(case):
    """The accumulator, the split partials and the merge run at V's width (padded, masked BLOCK_DV)."""
    rows, block_size, (num_q_heads, num_kv_heads), head_dim, head_dim_v, window, softcap, use_sinks, num_splits = \
        UNEQUAL_CASES[case]
    batch = make_unequal_kv_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, head_dim_v, torch.float32,
                                  seed=len(case))
    sinks = torch.randn(num_q_heads, generator=torch.Generator().manual_seed(5)) * 2 if use_sinks else None
    features = dict(sliding_window=window, softcap=softcap, sinks=sinks)
    out = run_triton(batch, head_dim ** -0.5, num_splits=num_splits, **features)
    expected = run_reference(batch, head_dim ** -0.5, **features)
    assert out.shape == expected.shape == (batch.query.shape[0], num_q_heads, head_dim_v)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)  # fp32


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_fp16_kv_cache_under_fp32_query(num_splits):
    """kv_cache_dtype="float16" for an fp32 model: K/V tiles are upcast on load and every dot runs in
    fp32 (IEEE), so the only error is summation order. The 1e-2 bound is the fp16 budget; the
    upcast is exact, so in practice this agrees to fp32 accuracy."""
    batch = make_batch(VERIFY, 16, 6, 2, 64, torch.float16, seed=12)
    batch.query = batch.query.float() * 1.5  # fp32 queries that fp16 could not hold exactly
    assert batch.key_cache.dtype == batch.value_cache.dtype == torch.float16
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(6))
    out = run_triton(batch, 0.125, num_splits=num_splits, softcap=5.0, sinks=sinks)
    expected = run_reference(batch, 0.125, softcap=5.0, sinks=sinks)  # fp32 reference on the fp16 K/V values
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)  # no fp16 rounding inside the kernel


@pytest.mark.parametrize("row_dtype, cache_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32)])
def test_store_kv_unequal_kv_head_dims_casts_on_store(row_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(9)
    key_cache = torch.randn(3, 4, 2, 40, generator=gen).to(cache_dtype)
    value_cache = torch.randn(3, 4, 2, 24, generator=gen).to(cache_dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    key = torch.randn(5, 2, 40, generator=gen).to(row_dtype)
    value = torch.randn(5, 2, 24, generator=gen).to(row_dtype)
    slot_mapping = torch.tensor([7, -1, 0, 11, -1])
    store_kv(key, value, key_cache, value_cache, slot_mapping)
    reference.store_kv(key, value, expected_k, expected_v, slot_mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)  # bitwise
    assert torch.equal(value_cache[2, 3], value[3].to(cache_dtype))
    with pytest.raises(ValueError, match="value rows are"):
        store_kv(key, value, key_cache, key_cache.clone(), slot_mapping)


@pytest.mark.parametrize("query_dtype, key_dtype, value_dtype, message", [
    (torch.float16, torch.float32, torch.float32, "or be a float32 query over a float16/bfloat16 cache"),
    (torch.float16, torch.bfloat16, torch.bfloat16, "HF_PAGED_BACKEND=torch"),
    (torch.float32, torch.float16, torch.float32, "key_cache and value_cache must share a dtype"),
])
def test_paged_decode_refuses_kv_dtypes_it_cannot_read_exactly(query_dtype, key_dtype, value_dtype, message):
    batch = make_batch([(17, 1)], 16, 6, 2, 64, torch.float32, seed=13)
    with pytest.raises(ValueError, match=message):
        paged_decode(batch.query.to(query_dtype), batch.key_cache.to(key_dtype), batch.value_cache.to(value_dtype),
                     batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, 1, 17, 0.125)


def test_fp32_model_with_fp16_kv_cache_generates_through_triton(monkeypatch):
    """`PagedCacheConfig(kv_cache_dtype="float16")` for an fp32 model runs through the Triton kernels
    (store casts down, attention upcasts on load) and agrees with the torch backend reading the same
    fp16 cache: greedy ids exactly, logits to fp32 accumulation-order error."""
    import hf_paged
    from tiny_models import left_padded_batch, tiny_model

    model = tiny_model("llama", "hf_paged")
    model.hf_paged_cache_config = hf_paged.PagedCacheConfig(block_size=16, kv_cache_dtype="float16")
    input_ids, attention_mask = left_padded_batch([5, 19], seed=2)
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    outs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_PAGED_BACKEND", name)
        outs[name] = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    assert torch.equal(outs["triton"].sequences, outs["torch"].sequences)
    for a, b in zip(outs["torch"].logits, outs["triton"].logits):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)  # fp32 compute on both sides
