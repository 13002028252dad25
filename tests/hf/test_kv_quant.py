"""Quantised KV cache (fp8 e4m3/e5m2, int8): the vocabulary, quantise-on-store / dequantise-on-read on
the torch path, bytes, and every cache operation (copy-on-write, growth, prefix caching, preemption,
speculative rollback, drop-in generate) with one-byte blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hf_paged
from hf_paged import Engine, PagedCache, PagedCacheConfig, SamplingParams
from hf_paged.attention import dispatch, torch_paged
from hf_paged.attention.kv_quant import KVQuant, KVScales, dequantize, quantize
from hf_paged.hf import KVOwner
from hf_paged.config import (KV_CACHE_DTYPE_NAMES, KV_CACHE_DTYPES, kv_bytes_per_token_layer, kv_cache_dtype)
from tests.tiny_models import tiny_model, with_cache

QUANTIZED = ("int8", "fp8_e4m3", "fp8_e5m2")


def quant_of(name: str, scheme: str = "dynamic", **static) -> KVQuant:
    return KVQuant.of(kv_cache_dtype(name), scheme, **static)


# ------------------------------------------------------------------------------------------ vocabulary
def test_one_vocabulary():
    assert KV_CACHE_DTYPE_NAMES == ("auto", "float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "fp8")
    assert kv_cache_dtype("fp8") is KV_CACHE_DTYPES["fp8_e4m3"]
    assert PagedCacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    for name in KV_CACHE_DTYPE_NAMES:
        spec = kv_cache_dtype(name)
        if spec.storage is not None:  # every storage name is a torch dtype of that size
            assert torch.empty(0, dtype=getattr(torch, spec.storage)).element_size() == spec.itemsize
    assert {n for n, d in KV_CACHE_DTYPES.items() if d.is_quantized} == set(QUANTIZED)


# ------------------------------------------------------------------------------------------ quantize
@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("scheme", ["dynamic", "dynamic_token"])
def test_quantize_round_trip_error_is_bounded(name, scheme):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 48, generator=gen) * torch.logspace(-3, 2, 40)[:, None, None]  # rows of all magnitudes
    quant = quant_of(name, scheme)
    q, scales = quantize(x, quant)
    assert q.dtype == quant.dtype and q.shape == x.shape
    assert scales.shape == (40, 3 if scheme == "dynamic" else 1, 1) and scales.dtype == torch.float32
    back = dequantize(q, scales, torch.float32)
    amax = x.abs().amax(dim=(-1,) if scheme == "dynamic" else (-2, -1), keepdim=True)
    # the row maximum maps onto the dtype's largest value: never saturates, never collapses
    assert torch.allclose(scales, amax / quant.qmax)
    err = (back - x).abs()
    if name == "int8":
        assert (err <= scales * 0.5 + 1e-7 * amax).all()  # half a step
    else:
        mantissa = 3 if name == "fp8_e4m3" else 2
        assert (err <= x.abs() * 2.0 ** -(mantissa + 1) + amax * 2.0 ** -9).all()  # rounding to nearest


def test_quantize_edge_rows():
    quant = quant_of("int8")
    x = torch.zeros(3, 2, 8)
    x[1, 0, 3] = float("nan")
    x[2, 1, :] = 5.0
    q, scales = quantize(x, quant)
    back = dequantize(q, scales, torch.float32)
    assert scales[0].eq(1.0).all() and back[0].eq(0).all()  # an all-zero row: scale 1, exact zeros
    assert torch.isnan(scales[1, 0])  # NaN stays visible (the engine's NaN check catches it)
    assert torch.equal(back[2, 1], x[2, 1]) and back[2, 0].eq(0).all()


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_static_and_unit_scales_saturate(name):
    x = torch.tensor([[[0.5, -3.0, 1e6, -1e6]]])
    for quant, scale in ((quant_of(name, key_scale=0.001), 0.001), (quant_of(name, "unit"), 1.0)):
        q, scales = quantize(x, quant, quant.key_scale)
        assert scales.eq(scale).all()
        back = dequantize(q, scales, torch.float32)
        assert torch.isfinite(back).all() and back[0, 0, 2] == quant.qmax * scale and back[0, 0, 3] == -quant.qmax * scale


def test_asymmetric_int8_uses_the_full_range():
    x = torch.linspace(10.0, 11.0, 64).view(1, 1, 64)  # far from zero: symmetric wastes half its codes
    sym = dequantize(*quantize(x, quant_of("int8")), torch.float32)
    asym_q, asym_scales = quantize(x, quant_of("int8", "asymmetric"))
    assert asym_scales.shape == (1, 1, 2) and asym_q.min() == -128 and asym_q.max() == 127
    asym = dequantize(asym_q, asym_scales, torch.float32)
    assert (asym - x).abs().max() <= 1.0 / 255 * 0.5 + 1e-5
    assert (asym - x).abs().max() < (sym - x).abs().max() / 10


# ------------------------------------------------------------------------------------------ torch path
def _random_quantized_cache(name, scheme, num_blocks=12, block_size=4, heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    quant = quant_of(name, scheme)
    rows = torch.randn(num_blocks * block_size, heads, dim, generator=gen) * 3
    groups, channels = quant.scales_shape(heads)
    key_cache = torch.zeros(num_blocks, block_size, heads, dim, dtype=quant.dtype)
    value_cache = torch.zeros_like(key_cache)
    scales = KVScales(torch.zeros(num_blocks, block_size, groups, channels),
                      torch.zeros(num_blocks, block_size, groups, channels), quant)
    slots = torch.randperm(num_blocks * block_size, generator=gen)
    torch_paged.store_kv(rows, rows.flip(0), key_cache, value_cache, slots, scales=scales)
    return key_cache, value_cache, scales


@pytest.mark.parametrize("name,scheme", [("int8", "dynamic"), ("int8", "asymmetric"), ("fp8_e4m3", "dynamic"),
                                         ("fp8_e5m2", "dynamic_token"), ("fp8_e4m3", "unit")])
def test_attention_reads_exactly_the_dequantized_cache(name, scheme):
    """Quantised attention == unquantised attention over the dequantised blocks, on every torch path:
    padded decode buckets, a speculative verify, a prefill chunk, and one sequence on consecutive
    blocks (the zero-copy view)."""
    key_cache, value_cache, scales = _random_quantized_cache(name, scheme)
    k_float = dequantize(key_cache, scales.key, torch.float32)
    v_float = dequantize(value_cache, scales.value, torch.float32)
    gen = torch.Generator().manual_seed(1)
    cases = [  # (block tables, seq_lens, q_lens)
        ([[3, 7, 1], [0, 5, 0], [2, 9, 11]], [10, 5, 12], [1, 1, 1]),  # decode, scattered blocks
        ([[3, 7, 1], [8, 4, 0]], [11, 8], [4, 1]),  # speculative verify + decode
        ([[2, 3, 4]], [12], [12]),  # one sequence, consecutive blocks: the view path
        ([[2, 3, 4]], [9], [1]),  # decode over a view
        ([[6, 2, 10]], [12], [7]),  # prefill chunk with a prefix
    ]
    for tables, lens, q_lens in cases:
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        q = torch.randn(sum(q_lens), 6, 8, generator=gen)
        args = (bt, seq_lens, cu, max(q_lens), max(lens), 8 ** -0.5)
        want = torch_paged.paged_attention(q, k_float, v_float, *args)
        plan = torch_paged.AttentionPlan(bt, seq_lens, cu, max(q_lens), max(lens), 4, torch_paged.Workspace())
        for p in (None, plan):
            got = torch_paged.paged_attention(q, key_cache, value_cache, *args, plan=p, scales=scales)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_store_skips_slot_minus_one_and_writes_scales_in_place():
    quant = quant_of("int8")
    key_cache = torch.zeros(2, 4, 1, 4, dtype=torch.int8)
    value_cache = torch.zeros_like(key_cache)
    scales = KVScales(torch.zeros(2, 4, 1, 1), torch.zeros(2, 4, 1, 1), quant)
    rows = torch.tensor([[[1.0, -2.0, 0.5, 4.0]], [[9.0, 9.0, 9.0, 9.0]]])
    torch_paged.store_kv(rows, rows, key_cache, value_cache, torch.tensor([5, -1]), scales=scales)
    assert scales.key[1, 1, 0, 0] == pytest.approx(4.0 / 127) and scales.key.count_nonzero() == 1
    assert key_cache[1, 1, 0].tolist() == [32, -64, 16, 127] and key_cache.count_nonzero() == 4


# ------------------------------------------------------------------------------------------ the cache
@pytest.mark.parametrize("name", ["auto", "float16", *QUANTIZED])
@pytest.mark.parametrize("scheme", ["dynamic", "dynamic_token", "asymmetric"])
def test_bytes_per_token_is_payload_plus_scales_exactly(name, scheme):
    if scheme == "asymmetric" and name != "int8":
        pytest.skip("asymmetric is int8 only")
    model = tiny_model("qwen3")  # 3 layers, 2 KV heads, head_dim 16
    cache = PagedCache(model.config, block_size=8, kv_cache_dtype=name, kv_quant_scheme=scheme)
    before = cache.bytes_per_block(torch.float32)  # from the config
    model(torch.tensor([[3, 4, 5]]), **with_cache(cache))
    measured = cache.bytes_per_block()  # from the tensors
    spec = kv_cache_dtype(name)
    payload = 3 * 8 * 2 * (16 + 16) * (spec.itemsize or 4)
    groups = 1 if scheme == "dynamic_token" else 2
    scales = 3 * 8 * 2 * groups * 4 * (2 if scheme == "asymmetric" else 1) if spec.is_quantized else 0
    assert measured == before == payload + scales
    assert cache.stats()["bytes_per_token"] * 8 == measured
    assert measured == 8 * 3 * kv_bytes_per_token_layer(2, 16, 16, spec, scheme, 4)


def test_smollm2_shape_fp8_holds_3_5x_the_tokens_of_float32():
    """SmolLM2-135M's KV geometry (30 layers, 3 KV heads, head_dim 64), fp32 weights."""
    fp32 = kv_bytes_per_token_layer(3, 64, 64, kv_cache_dtype("float32"))
    fp8 = kv_bytes_per_token_layer(3, 64, 64, kv_cache_dtype("fp8"))
    assert (fp32, fp8) == (1536, 384 + 24) and fp32 / fp8 >= 3.5


def test_engine_admits_3_5x_the_requests_in_fp8_at_a_fixed_budget():
    """At one `max_kv_bytes`, concurrent 1,000-token requests: fp8 >= 3.5x float32, for a model with
    SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64) in fp32, two layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=9, num_key_value_heads=3,
                                         max_position_embeddings=2048)).eval()
    per_request_fp32 = 2 * -(-1000 // 16) * 16 * 3 * 128 * 4
    budget = 4 * per_request_fp32 + 1000  # four float32 requests fit
    running = {}
    for name in ("float32", "fp8"):
        engine = Engine(model, max_kv_bytes=budget, kv_cache_dtype=name, max_num_seqs=64, max_model_len=2048,
                        max_num_batched_tokens=24 * 1000, enable_prefix_caching=False)
        gen = torch.Generator().manual_seed(0)
        for _ in range(24):
            engine.add_request(torch.randint(3, 250, (1000,), generator=gen).tolist(),
                               SamplingParams(max_new_tokens=2))
        engine.step()
        running[name] = len(engine.scheduler.running)
        while engine.has_unfinished_requests():
            engine.step()
    assert running["float32"] == 4
    assert running["fp8"] >= 3.5 * running["float32"], running


@pytest.mark.parametrize("name", QUANTIZED)
def test_copy_on_write_and_growth_move_the_scales(name):
    model = tiny_model("llama")
    cache = PagedCache(model.config, block_size=4, kv_cache_dtype=name)
    model(torch.randint(3, 250, (1, 10)), **with_cache(cache))
    layer = cache.layers[0]
    old = [t.clone() for t in (layer.keys, layer.values, layer.key_scales, layer.value_scales)]
    layer.copy_blocks(torch.tensor([0, 1]), torch.tensor([2, 0]))
    assert torch.equal(layer.key_scales[2], old[2][0]) and torch.equal(layer.keys[2].view(torch.uint8),
                                                                       old[0][0].view(torch.uint8))
    assert torch.equal(layer.value_scales[0], old[3][1])
    n = layer.keys.shape[0]
    copied = [t.clone() for t in (layer.keys, layer.key_scales, layer.value_scales)]
    layer.resize(n + 5)
    assert layer.key_scales.shape[0] == layer.value_scales.shape[0] == layer.keys.shape[0] == n + 5
    assert torch.equal(layer.key_scales[:n], copied[1]) and torch.equal(layer.value_scales[:n], copied[2])
    assert torch.equal(layer.keys[:n].view(torch.uint8), copied[0].view(torch.uint8))
    assert layer.key_scales[n:].eq(0).all()


def _engine_outputs(model, prompts, name, **kwargs):
    params = kwargs.pop("params", SamplingParams(max_new_tokens=12))
    engine = Engine(model, kv_cache_dtype=name, **kwargs)
    return [list(o.token_ids) for o in engine.generate(prompts, params)], engine


@pytest.mark.parametrize("name", QUANTIZED)
def test_engine_prefix_cache_preemption_speculation_and_drop_in_agree(name):
    """With one-byte blocks, every path writes and reads the same K/V: outputs equal across prefix
    hits, preemption (recompute), prompt-lookup speculation with rollback, and drop-in generate."""
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 250, (32,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 250, (n,), generator=gen).tolist() for n in (3, 9, 5, 14)]
    plain, _ = _engine_outputs(model, prompts, name, enable_prefix_caching=False)
    cached, engine = _engine_outputs(model, prompts, name)
    assert cached == plain and engine.cache.pool.num_prefix_hits > 0
    tight, engine = _engine_outputs(model, prompts, name, num_blocks=24, block_size=4, enable_prefix_caching=False)
    assert tight == plain and engine.metrics()["vllm:num_preemptions"] > 0
    spec, _ = _engine_outputs(model, [p + p[:20] for p in prompts], name, speculative_method="ngram",
                              num_speculative_tokens=3)
    base, _ = _engine_outputs(model, [p + p[:20] for p in prompts], name)
    assert spec == base
    model.set_attn_implementation("hf_paged")
    model.hf_paged_cache_config = PagedCacheConfig(kv_cache_dtype=name)
    try:
        for prompt, want in zip(prompts, plain):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert out[0, len(prompt):].tolist() == want
    finally:
        del model.hf_paged_cache_config
        model.set_attn_implementation("sdpa")


def test_prefix_hash_covers_the_kv_dtype():
    model = tiny_model("llama")
    salts = {KVOwner(model.config, kv_cache_dtype=n, kv_quant_scheme=s).sequence_salt()
             for n, s in (("auto", "dynamic"), ("int8", "dynamic"), ("int8", "asymmetric"), ("fp8", "dynamic"),
                          ("fp8_e5m2", "dynamic"))}
    assert len(salts) == 5


def test_auto_is_unchanged():
    model = tiny_model("llama")
    cache = PagedCache(model.config)
    model(torch.tensor([[3, 4, 5]]), **with_cache(cache))
    assert cache.layers[0].scales is None and cache.layers[0].keys.dtype == torch.float32


# ------------------------------------------------------------------------------------------ checkpoint scales
def test_checkpoint_k_v_scales_are_honoured():
    model = tiny_model("llama")
    for i, layer in enumerate(model.model.layers):  # what a compressed-tensors FP8 checkpoint carries
        layer.self_attn.register_buffer("k_scale", torch.tensor(0.01 * (i + 1)))
        layer.self_attn.register_buffer("v_scale", torch.tensor(0.02))
    engine = Engine(model, kv_cache_dtype="fp8")
    engine.generate([[3, 4, 5, 6]], SamplingParams(max_new_tokens=3))
    for i, layer in enumerate(engine.cache.layers):
        assert layer.quant.key_scale == pytest.approx(0.01 * (i + 1)) and layer.quant.value_scale == pytest.approx(0.02)
        written = layer.key_scales[layer.key_scales != 0]
        assert written.numel() > 0 and torch.allclose(written, torch.tensor(0.01 * (i + 1)))
    int8 = Engine(model, kv_cache_dtype="int8")  # int8 keeps its dynamic scales
    assert int8.cache.kv.use_checkpoint_kv_scales(model) == 0
    model.model.layers[0].self_attn.k_scale.fill_(-1.0)
    with pytest.raises(ValueError, match="layer 0: checkpoint k_scale/v_scale must be positive"):
        Engine(model, kv_cache_dtype="fp8")


def test_triton_refuses_asymmetric_scales(monkeypatch):
    monkeypatch.setattr(dispatch, "backend", lambda device: "triton")
    with pytest.raises(ValueError, match="'asymmetric' is implemented on the torch path only"):
        dispatch.check_kv_cache_dtype(torch.float32, torch.int8, torch.device("cpu"), "asymmetric")


def test_generate_with_each_dtype_runs_on_real_gqa_model():
    """Smoke on every architecture family flag that touches attention: sliding windows and softcap."""
    for arch in ("mistral", "gemma2"):
        model = tiny_model(arch, "hf_paged")
        model.hf_paged_cache_config = PagedCacheConfig(kv_cache_dtype="int8")
        out = model.generate(torch.tensor([[3, 4, 5, 6, 7] * 4]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 26)
    assert hf_paged.PagedCacheConfig  # the public name


# ------------------------------------------------------------------------------------------ rotation
@pytest.mark.parametrize("dim,block", [(64, 64), (48, 16), (80, 16), (96, 32), (7, 1)])
def test_rotation_is_an_orthonormal_involution(dim, block):
    from hf_paged.attention.kv_quant import _rotation, rotate

    r = _rotation(dim, torch.device("cpu"), torch.float64)
    torch.testing.assert_close(r @ r, torch.eye(dim, dtype=torch.float64))
    assert torch.equal(r, r.T) and torch.equal(r[:block, block:], torch.zeros(block, dim - block, dtype=r.dtype))
    x = torch.randn(5, 3, dim, dtype=torch.float64)
    torch.testing.assert_close(rotate(rotate(x)), x)


def test_rotation_leaves_attention_unchanged_and_shrinks_int8_error():
    """Through `dispatch` (where the rotation lives): rotated int8 attention is the float attention up
    to quantisation error, with K that has one outlier channel the query shares; the rotation cuts
    that error, and the dense gather hands sdpa un-rotated K/V."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, heads, dim = 8, 4, 2, 64
    k = torch.randn(num_blocks * bs, heads, dim, generator=gen)
    k[..., 5] += 40.0  # a massive channel, as real K has
    v = torch.randn(num_blocks * bs, heads, dim, generator=gen)
    q = torch.randn(3, 4, dim, generator=gen)
    q[..., 5] += 3.0
    bt = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([12, 10, 7], dtype=torch.int32)
    cu = torch.arange(4, dtype=torch.int32)
    slots = torch.arange(num_blocks * bs)
    dense_k, dense_v = k.view(num_blocks, bs, heads, dim), v.view(num_blocks, bs, heads, dim)
    want = dispatch.paged_attention(q, dense_k, dense_v, bt, seq_lens, cu, 1, 12, 0.125)
    errors = {}
    for rotate in (False, True):
        quant = KVQuant.of(kv_cache_dtype("int8"), "dynamic", rotate=rotate)
        kc = torch.zeros(num_blocks, bs, heads, dim, dtype=torch.int8)
        vc = torch.zeros_like(kc)
        scales = KVScales(torch.zeros(num_blocks, bs, heads, 1), torch.zeros(num_blocks, bs, heads, 1), quant)
        dispatch.store_kv(k, v, kc, vc, slots, scales=scales)
        got = dispatch.paged_attention(q, kc, vc, bt, seq_lens, cu, 1, 12, 0.125, scales=scales)
        errors[rotate] = (got - want).abs().max().item()
        step = SimpleNamespace(dense_index={}, num_columns=12, num_padding=torch.tensor([0, 2, 5]),
                               block_tables_of=lambda group: bt)
        gk, gv = torch_paged.gather_dense(kc, vc, step, torch.float32, scales=scales)  # [3, heads, 12, dim]
        torch.testing.assert_close(gk[0].transpose(0, 1), k[:12], atol=0.2, rtol=0.02)
        torch.testing.assert_close(gv[0].transpose(0, 1), v[:12], atol=0.05, rtol=0.05)
    assert errors[True] < 0.05 and errors[True] < errors[False] / 3, errors


def test_static_checkpoint_scales_turn_the_rotation_off():
    quant = KVQuant.of(kv_cache_dtype("fp8"), "dynamic", 0.5, 0.5, rotate=True)
    assert not quant.rotate and KVQuant.of(kv_cache_dtype("fp8"), "dynamic", rotate=True).rotate


def test_rotation_built_in_inference_mode_still_serves_autograd():
    from hf_paged.attention.kv_quant import rotate

    with torch.inference_mode():
        rotate(torch.randn(2, 112))  # first use of this width: the matrix is built and cached here
    x = torch.randn(2, 112, requires_grad=True)
    rotate(x).sum().backward()
    assert x.grad is not None


def test_one_byte_blocks_without_scales_are_refused_not_misread():
    key_cache, value_cache, _ = _random_quantized_cache("int8", "dynamic")
    args = (torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 1, 5, 0.3)
    with pytest.raises(ValueError, match="quantised\\) cache needs its scales"):
        torch_paged.paged_attention(torch.randn(1, 4, 8), key_cache, value_cache, *args)


def test_draft_model_pool_stores_kv_like_the_target():
    target, draft = tiny_model("llama"), tiny_model("llama", seed=1)
    engine = Engine(target, draft_model=draft, kv_cache_dtype="int8", kv_quant_rotation=False)
    cfg = engine.proposer.cache.cache_config
    assert (cfg.kv_cache_dtype, cfg.kv_quant_rotation) == ("int8", False)
    out = engine.generate([[3, 4, 5, 6, 7, 8]], SamplingParams(max_new_tokens=8))
    assert len(out[0].token_ids) == 8 and engine.proposer.cache.layers[0].scales is not None


def test_non_scalar_checkpoint_scales_fall_back_to_dynamic(caplog):
    model = tiny_model("llama")
    attn = model.model.layers[1].self_attn
    attn.register_buffer("k_scale", torch.ones(2))
    attn.register_buffer("v_scale", torch.ones(2))
    cache = PagedCache(model.config, kv_cache_dtype="fp8")
    with caplog.at_level("WARNING"):
        assert cache.kv.use_checkpoint_kv_scales(model) == 0
    assert "layer 1's checkpoint k_scale/v_scale are not per-tensor" in caplog.text


def test_fast_e4m3_dequantize_is_exact_and_keeps_nan_rows_nan():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).view(16, 1, 16)
    scales = torch.full((16, 1, 1), 0.37)
    want = codes.float() * 0.37
    got = dequantize(codes, scales, torch.float32, nan_scaled=True)
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])  # every finite code, subnormals included, bit for bit
    q, row_scales = quantize(torch.tensor([[[1.0, float("nan"), 2.0]]]), quant_of("fp8_e4m3"))
    assert dequantize(q, row_scales, torch.float32, nan_scaled=True).isnan().all()
