"""The Triton flash-prefill kernel (`hf_paged.attention.triton.prefill`) against `reference.paged_attention`.

Without a GPU the kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`, set by conftest) on
CPU tensors; with a GPU and no interpreter it runs compiled on CUDA. Every case builds a paged pool
whose blocks are a random permutation, where everything a sequence does not own is NaN: unused
block-table columns point at a NaN "poison" block or at other sequences' blocks, and the slots past
a sequence's length in its last block are NaN. Any read the kernel fails to mask (a NaN key gives
a NaN score, a NaN value times probability 0 is still NaN) turns the output NaN. The reference gets
the same data with the NaNs zeroed and the unused columns pointing at block 0, since it gathers
every position up to `max_seqlen_k` and relies on masking alone.

The interpreter is slow per program, so the cases are combined rather than a cartesian product;
each listed value (seq_len, q_len kind, block_size, GQA ratio, feature flag, dtype, head_dim)
appears at least once.
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

from hf_paged.attention import reference
from hf_paged.attention.triton import prefill as triton_prefill
from hf_paged.attention.triton.prefill import flash_prefill

if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    DEVICE = None
needs_kernel = pytest.mark.skipif(
    DEVICE is None, reason="needs TRITON_INTERPRET=1 (set by conftest without CUDA) or a CUDA GPU"
)

# Tolerances by dtype (atol, rtol), both sides computed from the same rounded inputs. fp32: the
# kernel accumulates in fp32 with IEEE dots, so only summation order differs (observed ~1e-6).
# fp16: the reference runs SDPA in fp16 and the kernel rounds P to fp16 before P @ V.
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}

# (seq_len, q_len) rows. q_len == seq_len: full prefill; q_len < seq_len: chunked prefill over a
# cached prefix; 1: decode; 4: speculative verify (k + 1 with k = 3); 0: no tokens this step.
MIXED = [(16, 0), (97, 97), (54, 20), (17, 1), (15, 4), (1, 1), (16, 16), (54, 0)]  # q_len 0 first and last
PREFILL = [(1, 1), (15, 15), (16, 16), (17, 17), (54, 54), (97, 97)]
CHUNKED = [(97, 33), (54, 4), (17, 16), (16, 15), (15, 1), (97, 0)]


def _make_inputs(rows, block_size, num_kv_heads, group, head_dim, dtype, seed, sink_dtype=torch.float32,
                 sliding_window=None, softcap=None, sinks=False):
    """Kernel arguments (NaN-poisoned pool) and reference arguments (same data, NaNs zeroed)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [s for s, _ in rows]
    q_lens = [q for _, q in rows]
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(blocks_per_seq) + 2  # spare columns: never read
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks, the last of the permutation is the poison block
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    poison = int(perm[-1])
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"))
    value_cache = torch.full(shape, float("nan"))

    # Unused columns: the poison block or any other block (another sequence's, a spare), at random.
    garbage = torch.where(torch.rand(len(rows), max_blocks, generator=gen) < 0.5, poison,
                          perm[torch.randint(0, num_blocks, (len(rows), max_blocks), generator=gen)])
    block_tables = garbage.to(torch.int32)
    ref_tables = torch.zeros_like(block_tables)
    start = 0
    for b, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        owned = perm[start:start + n]
        start += n
        block_tables[b, :n] = owned
        ref_tables[b, :n] = owned
        for cache in (key_cache, value_cache):
            filled = torch.randn(n * block_size, num_kv_heads, head_dim, generator=gen)
            filled[seq_len:] = float("nan")  # the unwritten tail of the last block
            cache[owned.long()] = filled.view(n, block_size, num_kv_heads, head_dim)

    num_q_heads = num_kv_heads * group
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(cu_seqlens_q[-1]), num_q_heads, head_dim, generator=gen)
    sink_tensor = (2 * torch.randn(num_q_heads, generator=gen)).to(sink_dtype) if sinks else None

    def put(t):
        return None if t is None else t.to(DEVICE or "cpu")

    common = dict(
        seq_lens=put(torch.tensor(seq_lens, dtype=torch.int32)), cu_seqlens_q=put(cu_seqlens_q),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), scale=head_dim ** -0.5,
        sliding_window=sliding_window, softcap=softcap, sinks=put(sink_tensor),
    )
    kernel_args = dict(query=put(query.to(dtype)), key_cache=put(key_cache.to(dtype)),
                       value_cache=put(value_cache.to(dtype)), block_tables=put(block_tables), **common)
    ref_args = dict(query=put(query.to(dtype)), key_cache=put(key_cache.nan_to_num(0.0).to(dtype)),
                    value_cache=put(value_cache.nan_to_num(0.0).to(dtype)), block_tables=put(ref_tables), **common)
    return kernel_args, ref_args


def check_against_reference(kernel_args, ref_args):
    out = flash_prefill(**kernel_args)
    ref = reference.paged_attention(**ref_args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "NaN in the output: the kernel read a slot it should have masked"
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# id: (rows, block_size, num_kv_heads, group, head_dim, dtype, sliding_window, softcap, sinks)
CASES = {
    "mixed-bs16-gqa1:1-d64-fp32": (MIXED, 16, 2, 1, 64, torch.float32, None, None, False),
    "mixed-bs1-gqa3:1-d128-fp32-window-sinks": (MIXED, 1, 2, 3, 128, torch.float32, 13, None, True),
    "mixed-bs32-gqa5:1-d64-fp32-softcap": (MIXED, 32, 1, 5, 64, torch.float32, None, 2.0, False),
    "mixed-bs16-gqa3:1-d64-fp16-window2-softcap": (MIXED, 16, 2, 3, 64, torch.float16, 2, 3.0, False),
    "prefill-bs16-mqa-d128-fp16-all": (PREFILL, 16, 1, 4, 128, torch.float16, 40, 3.0, True),
    "chunked-bs32-gqa5:1-d64-fp16-sinks": (CHUNKED, 32, 2, 5, 64, torch.float16, None, None, True),
    "chunked-bs1-gqa1:1-d128-fp32-all": (CHUNKED, 1, 3, 1, 128, torch.float32, 30, 2.5, True),
}


@needs_kernel
@pytest.mark.parametrize("case_id", CASES)
def test_matches_reference(case_id):
    rows, block_size, num_kv_heads, group, head_dim, dtype, window, softcap, sinks = CASES[case_id]
    kernel_args, ref_args = _make_inputs(rows, block_size, num_kv_heads, group, head_dim, dtype,
                                         seed=zlib.crc32(case_id.encode()),
                                         sliding_window=window, softcap=softcap, sinks=sinks)
    check_against_reference(kernel_args, ref_args)


@needs_kernel
@pytest.mark.parametrize(
    "block_size, block_q, window",
    [(32, 5, 24), (1, 3, None), (16, 1, 1)],
    ids=["bs32>BLOCK_N-window", "bs1-BLOCK_Q3", "bs16-BLOCK_Q1-window1"],
)
def test_small_tiles(monkeypatch, block_size, block_q, window):
    """Force 16x16 tiles, so sequences span many query and key tiles: exercises the tile-to-sequence
    search across many tiles, the causal and sliding-window tile skipping, blocks larger than a key
    tile, and tiles whose rows are only partly filled by whole GQA groups (BLOCK_Q * 3 < 16)."""
    group = 3

    def small_tiles(head_dim, group_, max_seqlen_q):
        return block_q, 16, 16, max(16, 1 << (head_dim - 1).bit_length()), 4

    monkeypatch.setattr(triton_prefill, "_pick_tiles", small_tiles)
    kernel_args, ref_args = _make_inputs(MIXED, block_size, 1, group, 64, torch.float32, seed=block_size,
                                         sliding_window=window, softcap=None, sinks=window is None)
    check_against_reference(kernel_args, ref_args)


@needs_kernel
@pytest.mark.parametrize("head_dim", [80, 96, 256])
def test_padded_head_dims(head_dim):
    """head_dim that is not a power of two runs with a padded, masked BLOCK_D."""
    rows = [(17, 17), (54, 4), (15, 0)]
    kernel_args, ref_args = _make_inputs(rows, 16, 1, 2, head_dim, torch.float16, seed=head_dim,
                                         sliding_window=20, softcap=None, sinks=False)
    check_against_reference(kernel_args, ref_args)


@needs_kernel
def test_strided_query_and_sinks_in_model_dtype():
    """A query that is a view of a fused QKV projection (token stride != heads * head_dim), sinks
    stored in the model dtype rather than fp32, and a `max_seqlen_q` below the true maximum (it only
    sizes the tiles, so the result must not change)."""
    kernel_args, ref_args = _make_inputs(MIXED, 16, 2, 3, 64, torch.float16, seed=7, sink_dtype=torch.float16,
                                         sinks=True)
    query = kernel_args["query"]
    fused = torch.randn(query.shape[0], query.shape[1] + 4, query.shape[2], dtype=query.dtype, device=query.device)
    fused[:, : query.shape[1]] = query
    kernel_args["query"] = fused[:, : query.shape[1]]
    assert not kernel_args["query"].is_contiguous()
    kernel_args["max_seqlen_q"] = 2
    check_against_reference(kernel_args, ref_args)


@needs_kernel
def test_no_tokens():
    kernel_args, _ = _make_inputs([(16, 0), (5, 0)], 16, 1, 1, 64, torch.float32, seed=0)
    kernel_args["max_seqlen_q"] = 0
    out = flash_prefill(**kernel_args)
    assert out.shape == (0, 1, 64)


def _valid_args():
    kernel_args, _ = _make_inputs([(17, 5), (4, 4)], 16, 2, 2, 64, torch.float32, seed=1)
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kernel_args.items()}


BAD_INPUTS = {
    "int64-block-tables": (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must be int32"),
    "int64-seq-lens": (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be int32"),
    "int64-cu-seqlens": (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q must be int32"),
    "cache-dtype": (lambda a: a.update(key_cache=a["key_cache"].half()), "share a dtype"),
    "query-last-dim-strided": (lambda a: a.update(query=a["query"].transpose(1, 2).contiguous().transpose(1, 2)),
                               "contiguous in its last"),
    "cache-last-dim-strided": (lambda a: a.update(value_cache=a["value_cache"].transpose(2, 3).contiguous()
                                                  .transpose(2, 3)), "contiguous in its last"),
    "head-dim-mismatch": (lambda a: a.update(query=a["query"][..., :32]), "head_dim"),
    "gqa-not-divisible": (lambda a: a.update(query=a["query"][:, :3]), "multiple of num_kv_heads"),
    "seq-lens-length": (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "inconsistent batch"),
    "cu-seqlens-length": (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:-1]), "inconsistent batch"),
    "table-too-narrow": (lambda a: a.update(max_seqlen_k=10_000), "block-table capacity"),
    "window-zero": (lambda a: a.update(sliding_window=0), "sliding_window"),
    "softcap-negative": (lambda a: a.update(softcap=-1.0), "softcap"),
    "sinks-shape": (lambda a: a.update(sinks=torch.zeros(3)), "sinks"),
}


@pytest.mark.parametrize("mutate, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_rejects_bad_inputs(mutate, message):
    """The launcher validates before launching, so these run without the interpreter too."""
    args = _valid_args()
    mutate(args)
    with pytest.raises(ValueError, match=message):
        flash_prefill(**args)


# ---------------------------------------------------------------------------------------------- #
# K and V of different head widths, and a 16-bit KV cache under an fp32 query


def _make_unequal_kv_inputs(rows, block_size, num_kv_heads, group, head_dim, head_dim_v, seed, **features):
    """V `head_dim_v` wide: everything from one `_make_inputs`, the value caches from another with the
    same seed (the permutation and block tables are drawn before anything head_dim-sized)."""
    kernel_args, ref_args = _make_inputs(rows, block_size, num_kv_heads, group, head_dim, torch.float32, seed,
                                         **features)
    kernel_v, ref_v = _make_inputs(rows, block_size, num_kv_heads, group, head_dim_v, torch.float32, seed, **features)
    assert torch.equal(kernel_args["block_tables"], kernel_v["block_tables"])
    kernel_args["value_cache"], ref_args["value_cache"] = kernel_v["value_cache"], ref_v["value_cache"]
    return kernel_args, ref_args


@needs_kernel
@pytest.mark.parametrize("rows, block_size, num_kv_heads, group, head_dim, head_dim_v, window, softcap, sinks", [
    (MIXED, 16, 2, 3, 64, 32, None, None, False),
    (CHUNKED, 1, 1, 4, 48, 80, 13, 2.5, True),
], ids=["mixed-bs16-gqa3:1-k64-v32", "chunked-bs1-mqa-k48-v80-all"])
def test_unequal_kv_head_dims(rows, block_size, num_kv_heads, group, head_dim, head_dim_v, window, softcap, sinks):
    """The accumulator and the output run at V's width (padded, masked BLOCK_DV); fp32 tolerance."""
    kernel_args, ref_args = _make_unequal_kv_inputs(rows, block_size, num_kv_heads, group, head_dim, head_dim_v,
                                                    seed=head_dim_v, sliding_window=window, softcap=softcap,
                                                    sinks=sinks)
    out = flash_prefill(**kernel_args)
    assert out.shape == (kernel_args["query"].shape[0], num_kv_heads * group, head_dim_v)
    check_against_reference(kernel_args, ref_args)


@needs_kernel
def test_fp16_kv_cache_under_fp32_query():
    """kv_cache_dtype="float16" for an fp32 model: K/V tiles are upcast on load and the dots run in
    fp32 (IEEE). The 1e-2 bound is the fp16 budget; since the upcast is exact the result in fact
    agrees to fp32 accuracy, which the second assertion pins."""
    kernel_args, ref_args = _make_inputs(MIXED, 16, 2, 3, 64, torch.float16, seed=11, sliding_window=20,
                                         softcap=3.0, sinks=True)
    for args in (kernel_args, ref_args):
        args["query"] = args["query"].float() * 1.5  # fp32 queries that fp16 could not hold exactly
    ref_args["key_cache"], ref_args["value_cache"] = ref_args["key_cache"].float(), ref_args["value_cache"].float()
    assert kernel_args["key_cache"].dtype == kernel_args["value_cache"].dtype == torch.float16
    out = flash_prefill(**kernel_args)
    ref = reference.paged_attention(**ref_args)
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)  # TOLERANCES[fp32]: no fp16 rounding inside


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(query=a["query"].half()), "or be a float32 query over a float16/bfloat16 cache"),
    (lambda a: a.update(key_cache=a["key_cache"].bfloat16(), value_cache=a["value_cache"].bfloat16(),
                        query=a["query"].half()), "HF_PAGED_BACKEND=torch"),
    (lambda a: a.update(value_cache=a["value_cache"][:, :, :1]), "head_dim_v"),
], ids=["fp16-query-fp32-cache", "fp16-query-bf16-cache", "value-heads-mismatch"])
def test_rejects_kv_it_cannot_read(mutate, message):
    args = _valid_args()
    mutate(args)
    with pytest.raises(ValueError, match=message):
        flash_prefill(**args)
