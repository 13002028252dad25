"""The Triton kernels compiled for real on a CUDA GPU, bf16 included (the interpreter cannot check bf16),
and quantised int8 / fp8 caches, whose fp8 store the interpreter cannot check (it mis-rounds fp32 ->
fp8 casts; see `test_triton_kv_quant.py`). Skipped on machines without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from hf_paged.attention import reference, torch_paged
from hf_paged.attention.kv_quant import KVQuant, KVScales, quantize
from hf_paged.config import kv_cache_dtype

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                       reason="needs a CUDA GPU with compiled Triton"),
]

# Tolerances by dtype: fp32 accumulation everywhere, so the inputs' precision dominates.
ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _paged_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, dtype, seed=0):
    """Random paged K/V for `rows` of (seq_len, q_len), non-contiguous block tables."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s, _ in rows]
    num_blocks = sum(blocks_per_seq) + 7
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    value_cache = torch.randn_like(key_cache)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    tables = torch.zeros(len(rows), max(blocks_per_seq) + 1, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[start:start + n].int()
        start += n
    q_lens = [q for _, q in rows]
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    query = torch.randn(int(cu[-1]), num_q_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    seq_lens = torch.tensor([s for s, _ in rows], dtype=torch.int32, device="cuda")
    return query, key_cache, value_cache, tables, seq_lens, cu, max(q_lens), max(s for s, _ in rows)


MIXED = [(1, 1), (15, 1), (16, 4), (17, 17), (54, 1), (97, 4), (97, 40), (33, 0)]


# Each block size (1, 16, 32), GQA ratio (1:1, 3:1, 5:1, 8:1) and head_dim (64, 128) appears, each
# with every dtype and kernel: the full cross product would be 144 cases (432 compiles with the
# window/softcap variants) for little more coverage; every case is a new Triton specialisation, and
# the GPU session has minutes. The interpreter tests take the semantics through the full product.
SHAPES = [(1, (8, 8), 64), (16, (12, 4), 128), (32, (10, 2), 64), (16, (8, 1), 64), (32, (12, 4), 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size, heads, head_dim", SHAPES)
@pytest.mark.parametrize("kernel", ["paged_decode", "flash_prefill"])
def test_kernels_match_reference(kernel, head_dim, heads, block_size, dtype):
    from hf_paged.attention.triton.decode import paged_decode
    from hf_paged.attention.triton.prefill import flash_prefill

    fn = paged_decode if kernel == "paged_decode" else flash_prefill
    rows = [r for r in MIXED if kernel == "flash_prefill" or r[1] <= 4]
    batch = _paged_batch(rows, block_size, heads[0], heads[1], head_dim, dtype)
    for window, softcap in [(None, None), (8, None), (None, 20.0)]:
        args = (*batch, head_dim ** -0.5)
        out = fn(*args, sliding_window=window, softcap=softcap)
        ref = reference.paged_attention(*args, sliding_window=window, softcap=softcap)
        torch.testing.assert_close(out, ref, atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_kv_matches_reference(dtype):
    from hf_paged.attention.triton.store_kv import store_kv

    cache = torch.randn(9, 16, 4, 128, device="cuda", dtype=dtype)
    expected_k, expected_v = cache.clone(), cache.clone()
    got_k, got_v = cache.clone(), cache.clone()
    key = torch.randn(20, 4, 128, device="cuda", dtype=dtype)
    slots = torch.randperm(9 * 16, device="cuda")[:20]
    slots[::3] = -1
    reference.store_kv(key, -key, expected_k, expected_v, slots)
    store_kv(key, -key, got_k, got_v, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)


def _load_default_or_skip(dtype):
    from hf_paged.defaults.models import DefaultModelNotInstalledError, load_default

    try:
        return load_default(dtype=dtype, device="cuda")
    except DefaultModelNotInstalledError as exc:  # a GPU machine the weights did not reach
        pytest.skip(f"SmolLM2's weights are not installed here: {exc}")


def _assert_greedy_equal_up_to_near_ties(out, ref, width: int, gap: float) -> None:
    """Every row equal to stock's, except that a row may leave stock's path at a step where stock's own
    logits put the two tokens within `gap` of each other (a near-tie that rounding may flip; both
    continuations are then right). At least half the rows must be equal to the end."""
    equal = 0
    for row in range(ref.sequences.shape[0]):
        a, b = ref.sequences[row, width:], out.sequences[row, width:]
        differ = (a != b).nonzero()
        if len(differ) == 0:
            equal += 1
            continue
        step = int(differ[0])
        logits = ref.logits[step][row].float()
        tie = abs(float(logits[a[step]] - logits[b[step]]))
        assert tie <= gap, f"row {row} leaves stock's tokens at step {step} with a logit gap of {tie:.3f} (> {gap})"
    assert equal >= (ref.sequences.shape[0] + 1) // 2, f"only {equal} rows equal to stock's to the end"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_on_gpu_matches_stock(dtype):
    """SmolLM2 greedy generate with "hf_paged" (the Triton kernels, CUDA graphs for decode) against
    stock sdpa in the same dtype: fp32 token-identical with logits within 1e-3; bf16 identical except
    where a near-tie in stock's own logits (gap <= 0.5, the bf16 logits tolerance below) explains
    a flip, and the first step's logits close."""
    from hf_paged.defaults.prompts import chat_inputs

    model, tokenizer = _load_default_or_skip(dtype)
    inputs = chat_inputs(tokenizer).to("cuda")
    # min_new_tokens: every row stays live for all 32 steps. A row past its EOS feeds pad tokens, whose
    # logits stock's own eager and sdpa already disagree on by ~6e-4 (measured on CPU, fp32).
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    ref = model.generate(**inputs, **kwargs)
    model.set_attn_implementation("hf_paged")
    out = model.generate(**inputs, **kwargs)
    width = inputs["input_ids"].shape[1]
    if dtype == torch.float32:
        worst = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))
        assert torch.equal(out.sequences, ref.sequences)
        assert worst < 1e-3
    else:
        _assert_greedy_equal_up_to_near_ties(out, ref, width, gap=0.5)
        torch.testing.assert_close(out.logits[0], ref.logits[0], atol=0.5, rtol=0.05)


# ---------------------------------------------------------------------------------------------- #
# Quantised (int8 / fp8) caches: the Triton store and attention against the torch backend's quantised
# path on the same GPU.

QUANT_NAMES = ["int8", "fp8_e4m3", "fp8_e5m2"]


def _skip_without_fp8e4nv(name):
    if name == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8_e4m3fn needs compute capability 8.9+ in Triton")


def _payload_units(t):
    """int8 as is; fp8 bit patterns as ordered integers (neighbours differ by 1, -0 == +0)."""
    if not t.dtype.is_floating_point:
        return t.int()
    bits = t.view(torch.uint8).int()
    return torch.where(bits >= 128, -(bits - 128), bits)


def _assert_payload_close(got, expected, max_fraction=1e-3):
    # At most one unit / ulp apart on a tiny fraction of elements (a division rounded differently).
    diff = (_payload_units(got) - _payload_units(expected)).abs()
    assert int(diff.max()) <= 1 and (diff > 0).float().mean().item() <= max_fraction


@pytest.mark.parametrize("row_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scheme, static", [("dynamic", (None, None)), ("dynamic_token", (None, None)),
                                            ("dynamic", (0.02, None)), ("dynamic_token", (1e-3, 0.5)),
                                            ("unit", (None, None))],
                         ids=["dynamic", "dynamic_token", "static-k", "static-saturating-token", "unit"])
@pytest.mark.parametrize("name", QUANT_NAMES)
def test_store_kv_quantized_matches_torch(name, scheme, static, row_dtype):
    from hf_paged.attention.triton.store_kv import store_kv

    _skip_without_fp8e4nv(name)
    quant = KVQuant.of(kv_cache_dtype(name), scheme, *static)
    num_blocks, block_size, num_kv_heads, head_dim, head_dim_v = 9, 16, 4, 128, 80
    groups, _ = quant.scales_shape(num_kv_heads)
    g = torch.Generator(device="cuda").manual_seed(0)
    caches = [torch.randint(-128, 128, (num_blocks, block_size, num_kv_heads, d), device="cuda", generator=g,
                            dtype=torch.int8).view(quant.dtype) for d in (head_dim, head_dim_v)]
    scales = KVScales(torch.full((num_blocks, block_size, groups, 1), -1.0, device="cuda"),
                      torch.full((num_blocks, block_size, groups, 1), -1.0, device="cuda"), quant)
    expected = [c.clone() for c in caches] + [KVScales(scales.key.clone(), scales.value.clone(), quant)]
    rows = []
    for d in (head_dim, head_dim_v):  # per-row magnitudes over orders of magnitude, one all-zero token
        r = torch.randn(40, num_kv_heads, d, device="cuda", generator=g)
        r = r * torch.exp(2 * torch.randn(40, num_kv_heads, 1, device="cuda", generator=g))
        r[5] = 0
        rows.append(r.to(row_dtype))
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=g)[:40]
    slots[::7] = -1
    torch_paged.store_kv(rows[0], rows[1], expected[0], expected[1], slots, scales=expected[2])
    store_kv(rows[0], rows[1], caches[0], caches[1], slots, scales=scales)
    _assert_payload_close(caches[0], expected[0])
    _assert_payload_close(caches[1], expected[1])
    torch.testing.assert_close(scales.key, expected[2].key, rtol=1e-6, atol=0)
    torch.testing.assert_close(scales.value, expected[2].value, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_store_kv_fp8_keeps_non_finite_rows_non_finite(name):
    """As `kv_quant.quantize`: a NaN in a row gives that row a NaN scale (and NaN payload); an inf gives
    scale inf, so both rows read back non-finite."""
    from hf_paged.attention.triton.store_kv import store_kv

    _skip_without_fp8e4nv(name)
    quant = KVQuant.of(kv_cache_dtype(name), "dynamic")
    caches = [torch.zeros(2, 4, 2, 32, device="cuda").to(quant.dtype) for _ in range(2)]
    scales = KVScales(torch.zeros(2, 4, 2, 1, device="cuda"), torch.zeros(2, 4, 2, 1, device="cuda"), quant)
    expected = [c.clone() for c in caches] + [KVScales(scales.key.clone(), scales.value.clone(), quant)]
    key = torch.randn(3, 2, 32, device="cuda")
    key[0, 0, 3] = float("nan")
    key[1, 1, 7] = float("inf")
    slots = torch.tensor([0, 5, 6], device="cuda")
    torch_paged.store_kv(key, -key, expected[0], expected[1], slots, scales=expected[2])
    store_kv(key, -key, caches[0], caches[1], slots, scales=scales)
    torch.testing.assert_close(scales.key, expected[2].key, rtol=1e-6, atol=0, equal_nan=True)
    for got, want in zip(caches[:2], expected[:2]):
        assert torch.equal(got.float().isnan(), want.float().isnan())
        finite = ~want.float().isnan()
        _assert_payload_close(got[finite], want[finite])


# Every (shape, scheme, query dtype) pairing below covers each shape, scheme and query dtype twice;
# each runs for every payload dtype and kernel (36 cases where the cross product has 108).
QUANT_CASES = [((16, (12, 4), 128), "dynamic", torch.float32), ((16, (12, 4), 128), "dynamic_token", torch.bfloat16),
               ((1, (8, 1), 80), "dynamic", torch.float16), ((1, (8, 1), 80), "dynamic_token", torch.float32),
               ((32, (10, 2), 64), "dynamic", torch.bfloat16), ((32, (10, 2), 64), "dynamic_token", torch.float16)]


@pytest.mark.parametrize("name", QUANT_NAMES)
@pytest.mark.parametrize("shape, scheme, query_dtype", QUANT_CASES)
@pytest.mark.parametrize("kernel", ["paged_decode", "flash_prefill"])
def test_kernels_read_quantized_cache(kernel, shape, scheme, query_dtype, name):
    """Decode and prefill over an int8 / fp8 cache against `torch_paged.paged_attention(..., scales=)` on
    the same payload and scales: both dequantise to the query's dtype the same way, so the tolerance is
    the query dtype's."""
    from hf_paged.attention.triton.decode import paged_decode
    from hf_paged.attention.triton.prefill import flash_prefill

    block_size, heads, head_dim = shape
    _skip_without_fp8e4nv(name)
    fn = paged_decode if kernel == "paged_decode" else flash_prefill
    rows = [r for r in MIXED if kernel == "flash_prefill" or r[1] <= 4]
    query, key_cache, value_cache, *rest = _paged_batch(rows, block_size, heads[0], heads[1], head_dim,
                                                        torch.float32)
    quant = KVQuant.of(kv_cache_dtype(name), scheme)
    payloads, scale_tensors = [], []
    for cache in (key_cache, value_cache):  # every slot quantised as the torch store would
        payload, row_scales = quantize(cache.flatten(0, 1), quant)
        payloads.append(payload.view(cache.shape))
        scale_tensors.append(row_scales.view(*cache.shape[:2], *row_scales.shape[1:]))
    scales = KVScales(scale_tensors[0], scale_tensors[1], quant)
    args = (query.to(query_dtype), payloads[0], payloads[1], *rest, head_dim ** -0.5)
    for window, softcap in [(None, None), (8, None), (None, 20.0)]:
        out = fn(*args, sliding_window=window, softcap=softcap, scales=scales)
        ref = torch_paged.paged_attention(*args, sliding_window=window, softcap=softcap, scales=scales)
        assert out.dtype == query_dtype
        torch.testing.assert_close(out.float(), ref.float(), atol=ATOL[query_dtype], rtol=ATOL[query_dtype])


def test_fp8_e4m3_refused_before_ada():
    from hf_paged.attention.triton.store_kv import store_kv

    if torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU converts float8_e4m3fn")
    quant = KVQuant.of(kv_cache_dtype("fp8_e4m3"), "dynamic")
    cache = torch.zeros(1, 4, 1, 16, device="cuda").to(quant.dtype)
    scales = KVScales(torch.zeros(1, 4, 1, 1, device="cuda"), torch.zeros(1, 4, 1, 1, device="cuda"), quant)
    key = torch.randn(1, 1, 16, device="cuda")
    with pytest.raises(ValueError, match="8.9"):
        store_kv(key, key, cache, cache.clone(), torch.tensor([0], device="cuda"), scales=scales)
