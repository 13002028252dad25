"""The native CPU kernel over every dtype it reads besides fp32: bf16 / fp16 queries and K/V, and int8 /
fp8 (e4m3fn, e5m2) K/V dequantised in registers with the pool's per-token scales.

The pools are `test_torch_paged.make_paged_batch`'s (random non-contiguous block tables, garbage in
every slot nobody wrote, the awkward mixed step). A quantised pool is the fp32 pool quantised slot by
slot with `kv_quant.quantize` (garbage included), and its oracle attends, in fp64, over each
sequence's rows dequantised in fp64 from that payload and those scales: what the kernel must
compute, up to fp32 rounding. Every case also runs the torch path (which gathers and dequantises) on
the same tensors, and counts that the kernel really ran.

Tolerances (atol, rtol), by query dtype, beside each use:
* fp32 queries: against the oracle 1e-4 (quantised K/V: the scale multiplies a dot product rather than
  each element, fp32 rounding either way) or 1e-5 (float K/V); against the torch path 1e-5.
* bf16 queries: the output is rounded once to bf16 (2^-9 relative): 1e-2 against the oracle; the
  torch path also rounds K/V and runs SDPA in bf16: 2e-2 against it.
* fp16: rounded once to fp16 (2^-12 relative): 2e-3 against the oracle and the torch path.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hf_paged.attention import cpu_kernel, kv_quant, torch_paged
from hf_paged.attention.kv_quant import KVQuant, KVScales
from hf_paged.config import kv_cache_dtype
from tests.attention.test_cpu_kernel import CountCalls, features_for, native_plan
from tests.attention.test_torch_paged import HEAD_LAYOUTS, MIXED_BATCH, make_paged_batch, naive_batch

pytestmark = pytest.mark.skipif(cpu_kernel.load() is None, reason=f"no CPU kernel: {cpu_kernel.load_error()}")

HEAD_DIM = 32
LAYOUT_IDS = dict(zip(["1to1", "3to1", "5to1", "mqa"], HEAD_LAYOUTS))
# (atol, rtol) against the fp64 oracle, and against the torch path, by query dtype (module docstring)
ORACLE_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3)}
TORCH_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def attend(batch, plan, scales=None, **features):
    return torch_paged.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q,
        batch.max_seqlen_q, batch.max_seqlen_k, batch.scale, plan=plan, scales=scales, **features)


def torch_plan(batch, block_size):
    return torch_paged.AttentionPlan(batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q,
                                     batch.max_seqlen_k, block_size)


def check(batch, block_size, monkeypatch, scales=None, features=None, oracle_tol=None):
    """The kernel (counted: one launch) against the fp64 oracle and the torch path on the same tensors,
    on the tokens of its short runs; the step's prefill tokens (the torch path's in both) equal."""
    features = features or {}
    counter = CountCalls(monkeypatch)
    plan = native_plan(batch, block_size, torch_paged.Workspace())
    out = attend(batch, plan, scales, **features)
    assert counter.calls == 1
    reference = attend(batch, torch_plan(batch, block_size), scales, **features)
    dtype = batch.query.dtype
    assert out.dtype == reference.dtype == dtype and out.shape == reference.shape
    runs = plan.short_runs
    short = torch.ones(out.shape[0], dtype=torch.bool)
    if not runs.is_whole:
        short[:] = False
        short[runs.token_index] = True
    atol, rtol = oracle_tol or ORACLE_TOL[dtype]
    expected = naive_batch(batch, batch.scale, **features)
    torch.testing.assert_close(out[short].double(), expected[short], atol=atol, rtol=rtol)
    atol, rtol = TORCH_TOL[dtype]
    torch.testing.assert_close(out[short].double(), reference[short].double(), atol=atol, rtol=rtol)
    assert torch.equal(out[~short], reference[~short])
    return out


def float_batch(block_size, layout, dtype, seed, query_dtype=None, rows=MIXED_BATCH, head_dim=HEAD_DIM):
    num_q_heads, num_kv_heads = LAYOUT_IDS[layout]
    batch = make_paged_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, dtype, seed=seed,
                             query_scale=3.0)
    batch.scale = head_dim ** -0.5
    if query_dtype is not None:
        batch.query = batch.query.to(query_dtype)
    return batch


def quantize_pool(cache, quant, static_scale):
    """(payload, scales) of every slot of `cache` [num_blocks, block_size, H, D], garbage included."""
    num_blocks, block_size, num_heads, head_dim = cache.shape
    payload, scales = kv_quant.quantize(cache.reshape(-1, num_heads, head_dim), quant, static_scale)
    return payload.view(cache.shape), scales.view(num_blocks, block_size, *scales.shape[1:])


def dequantized_rows(payload, scales, block_tables, seq_lens):
    """Each sequence's rows [seq_len, H, D], dequantised in fp64 (the oracle's K or V)."""
    pool = payload.double() * scales[..., :1].double()
    if scales.shape[-1] == 2:
        pool = pool + scales[..., 1:].double()
    block_size = payload.shape[1]
    return [pool[block_tables[b, :math.ceil(n / block_size)].long()].flatten(0, 1)[:n]
            for b, n in enumerate(seq_lens.tolist())]


def quantized_batch(name, scheme, block_size, layout, query_dtype, seed, static=None, rows=MIXED_BATCH,
                    head_dim=HEAD_DIM):
    """The fp32 pool quantised as `name` / `scheme` (`static`: a checkpoint's scale for K and V), its
    KVScales, and the oracle's K/V dequantised from it."""
    num_q_heads, num_kv_heads = LAYOUT_IDS[layout]
    batch = make_paged_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, torch.float32, seed=seed,
                             query_scale=3.0)
    quant = KVQuant.of(kv_cache_dtype(name), scheme, static, static)
    key, key_scales = quantize_pool(batch.key_cache, quant, quant.key_scale)
    value, value_scales = quantize_pool(batch.value_cache, quant, quant.value_scale)
    batch = dataclasses.replace(
        batch, query=batch.query.to(query_dtype), key_cache=key, value_cache=value,
        keys=dequantized_rows(key, key_scales, batch.block_tables, batch.seq_lens),
        values=dequantized_rows(value, value_scales, batch.block_tables, batch.seq_lens))
    batch.scale = head_dim ** -0.5
    return batch, KVScales(key_scales, value_scales, quant)


# (block_size, head layout, feature, head_dim): every block size, layout, feature and unrolled path of the
# kernel (D = 64 with 1..4 rows, D = 128 in pairs, the generic loop), without their product
SHAPES = [(16, "1to1", "none", 64), (1, "3to1", "window", 32), (32, "5to1", "softcap", 128),
          (16, "mqa", "sinks", 64), (16, "3to1", "all", 80)]


@pytest.mark.parametrize("block_size,layout,feature,head_dim", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_queries_and_kv(dtype, block_size, layout, feature, head_dim, monkeypatch):
    """bf16 / fp16 queries over a cache of their dtype: the kernel takes the mixed step's short runs,
    the output comes back in the query's dtype, within its rounding of the oracle and the torch path."""
    batch = float_batch(block_size, layout, dtype, seed=block_size + len(layout), head_dim=head_dim)
    check(batch, block_size, monkeypatch, features=features_for(feature, batch.query.shape[1], seed=2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp32_queries_over_a_16_bit_cache(dtype, monkeypatch):
    """An fp32 model with a bf16 / fp16 cache: K/V widened exactly, the output fp32 (1e-5)."""
    batch = float_batch(16, "3to1", dtype, seed=11, query_dtype=torch.float32)
    check(batch, 16, monkeypatch, features=features_for("all", batch.query.shape[1], seed=3),
          oracle_tol=(1e-5, 1e-5))


# (kv dtype, scheme, static scale, block_size, layout, feature): every scheme the torch path reads
QUANTIZED = [
    ("int8", "dynamic", None, 16, "3to1", "none"),
    ("int8", "dynamic_token", None, 1, "5to1", "window"),
    ("int8", "asymmetric", None, 32, "1to1", "softcap"),
    ("fp8_e4m3", "dynamic", None, 16, "mqa", "sinks"),
    ("fp8_e4m3", "dynamic", 0.02, 16, "3to1", "all"),
    ("fp8_e5m2", "dynamic", None, 32, "3to1", "all"),
    ("fp8_e5m2", "unit", None, 1, "1to1", "none"),
]


@pytest.mark.parametrize("name,scheme,static,block_size,layout,feature", QUANTIZED,
                         ids=[f"{c[0]}-{c[1]}{'-static' if c[2] else ''}" for c in QUANTIZED])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_kv(query_dtype, name, scheme, static, block_size, layout, feature, monkeypatch):
    """int8 / fp8 payloads with their scales, read in place: against the oracle over the dequantised
    rows (fp32 queries: 1e-4; bf16: its output rounding, 1e-2) and the torch path's gather."""
    batch, scales = quantized_batch(name, scheme, block_size, layout, query_dtype, seed=block_size * 3 + len(name),
                                    static=static)
    check(batch, block_size, monkeypatch, scales, features_for(feature, batch.query.shape[1], seed=4))


@pytest.mark.parametrize("name,scheme", [("int8", "dynamic"), ("fp8_e4m3", "dynamic"), ("int8", "asymmetric")])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_quantized_head_widths_and_key_splits(name, scheme, head_dim, monkeypatch):
    """The unrolled paths (D = 64 up to 4 rows, D = 128 in pairs) and the generic one, and long
    sequences cut into key splits, whose partial results merge to the oracle's."""
    rows = [(700, 1), (33, 3), (129, 16), (517, 1)]
    batch, scales = quantized_batch(name, scheme, 16, "5to1", torch.float32, seed=head_dim, rows=rows,
                                    head_dim=head_dim)
    check(batch, 16, monkeypatch, scales, features_for("sinks", batch.query.shape[1], seed=5))


def nan_row(batch, scales, seq, position, which):
    """Make the K or V row at `position` of sequence `seq` NaN the way a dynamic cache stores one: its
    scale NaN, whatever its payload."""
    block_size = batch.key_cache.shape[1]
    block = int(batch.block_tables[seq, position // block_size])
    (scales.key if which == "key" else scales.value)[block, position % block_size] = float("nan")


@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_a_nan_row_stays_nan(name, which, monkeypatch):
    """A row holding NaN has a NaN dynamic scale: every query that sees it comes out NaN, as on the
    torch path; every other output is finite and matches (1e-4)."""
    batch, scales = quantized_batch(name, "dynamic", 16, "mqa", torch.float32, seed=21,
                                    rows=[(54, 4), (97, 1), (30, 1)])
    nan_row(batch, scales, seq=0, position=40, which=which)  # seen by all 4 queries of sequence 0
    nan_row(batch, scales, seq=1, position=96, which=which)  # the decode query's own row
    counter = CountCalls(monkeypatch)
    out = attend(batch, native_plan(batch, 16), scales)
    assert counter.calls == 1
    reference = attend(batch, torch_plan(batch, 16), scales)
    expected_nan = torch.tensor([True] * 5 + [False])  # per token: every head (MQA) and column
    assert torch.equal(out.isnan().all(-1).all(-1), expected_nan)
    assert torch.equal(reference.isnan().all(-1).all(-1), expected_nan)
    assert not out[5:].isnan().any()
    torch.testing.assert_close(out[5:], reference[5:], atol=1e-4, rtol=1e-4)


def test_nan_codes_and_infinite_scales_read_nan(monkeypatch):
    """e4m3's NaN codes (s 1111 111) read NaN under a checkpoint's finite scale; an infinite dynamic
    scale (a row holding inf: its finite elements stored as 0) reads NaN, in K (its score) and in V.
    Exactly the torch path's NaN outputs."""
    counter = CountCalls(monkeypatch)
    rows = [(20, 1), (20, 1), (20, 1)]
    coded, static = quantized_batch("fp8_e4m3", "dynamic", 16, "1to1", torch.float32, seed=22, static=0.05,
                                    rows=rows)
    coded.key_cache.view(torch.uint8)[int(coded.block_tables[0, 0]), 3, :, 5] = 0x7F
    infinite, dynamic = quantized_batch("int8", "dynamic", 16, "1to1", torch.float32, seed=22, rows=rows)
    block = int(infinite.block_tables[0, 0])
    infinite.value_cache[block, 5] = 0
    dynamic.value[block, 5] = float("inf")
    dynamic.key[int(infinite.block_tables[1, 1]), 2] = float("inf")
    for batch, scales, nan_tokens in ((coded, static, 1), (infinite, dynamic, 2)):
        native = attend(batch, native_plan(batch, 16), scales)
        reference = attend(batch, torch_plan(batch, 16), scales)
        assert torch.equal(native.isnan(), reference.isnan())
        assert native[:nan_tokens].isnan().all() and native[nan_tokens:].isfinite().all()
    assert counter.calls == 2


def test_a_split_whose_keys_are_all_nan_is_nan():
    """A long sequence cut into key splits, every key of its first split NaN (fp32 cache): that
    split saw only NaN scores and is merged, not skipped as empty, so the output is NaN, as the
    torch path's."""
    batch = float_batch(16, "3to1", torch.float32, seed=23, rows=[(1000, 1)])
    plan = native_plan(batch, 16)
    num_splits, num_blocks = plan.short_runs.num_splits, math.ceil(1000 / 16)
    assert num_splits > 1
    for block in batch.block_tables[0, :math.ceil(num_blocks / num_splits)].tolist():  # the first split's
        batch.key_cache[block] = float("nan")
    assert attend(batch, plan).isnan().all()
    assert attend(batch, torch_plan(batch, 16)).isnan().all()


def strided(cache):
    """`cache` as a byte page's slice: the same blocks, one block stride of two blocks apart."""
    page = torch.full((cache.shape[0], 2, *cache.shape[1:]), 7, dtype=cache.dtype)
    page[:, 0] = cache
    return page[:, 0]


@pytest.mark.parametrize("name", ["float32", "int8"])
def test_a_block_stride_wider_than_a_block(name, monkeypatch):
    """K/V as strided views (block stride two blocks): read in place at that stride."""
    if name == "int8":
        batch, scales = quantized_batch("int8", "dynamic", 16, "3to1", torch.float32, seed=24)
    else:
        batch, scales = float_batch(16, "3to1", torch.float32, seed=24), None
    batch = dataclasses.replace(batch, key_cache=strided(batch.key_cache), value_cache=strided(batch.value_cache))
    batch.scale = HEAD_DIM ** -0.5
    assert not batch.key_cache.is_contiguous()
    check(batch, 16, monkeypatch, scales, features_for("window", 6, seed=6))


def test_what_the_kernel_does_not_read_takes_the_torch_path(monkeypatch):
    """fp16 queries over a bf16 cache, rows not contiguous within a block, float64 scales: the
    torch path runs them (no launch), and the answer still matches the oracle."""
    counter = CountCalls(monkeypatch)
    mixed = float_batch(16, "3to1", torch.bfloat16, seed=25, query_dtype=torch.float16)
    out = attend(mixed, native_plan(mixed, 16))
    torch.testing.assert_close(out.double(), naive_batch(mixed, mixed.scale), atol=2e-2, rtol=2e-2)
    batch, scales = quantized_batch("int8", "dynamic", 16, "3to1", torch.float32, seed=26)
    expected = naive_batch(batch, batch.scale)
    heads_apart = dataclasses.replace(batch, key_cache=batch.key_cache.transpose(1, 2).contiguous().transpose(1, 2))
    heads_apart.scale = batch.scale  # [NB, BS, H, D] stored head-major: rows of a block not contiguous
    torch.testing.assert_close(attend(heads_apart, native_plan(batch, 16), scales).double(), expected,
                               atol=1e-4, rtol=1e-4)
    wide = KVScales(scales.key.double(), scales.value.double(), scales.quant)
    assert not cpu_kernel.can_run(batch.query, batch.key_cache, batch.value_cache, wide)
    assert counter.calls == 0
    assert cpu_kernel.can_run(batch.query, batch.key_cache, batch.value_cache, scales)
