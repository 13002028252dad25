"""Multi-head latent attention (DeepSeek-V2 / DeepSeek-V3) over a `PagedCache`.

These models pass `cache.update` a compressed latent (`kv_lora_rank` wide) as K and the shared
rotary key (`qk_rope_head_dim` wide) as V, one head each, and expand them into per-head K/V inside
their attention module. The cache keeps them as one row per token; paged steps (the Engine, drop-in
generate) attend over the rows with the up-projections absorbed, dense steps (a PagedCache handed to
an sdpa model) return the latents for the module to expand as stock does. A model whose up-projection
cannot be absorbed (a quantised or biased kv_b_proj) is refused by the Engine, naming why, and
generate falls back to stock generation over a PagedCache.

The oracle is stock `generate` (sdpa, DynamicCache): greedy token ids identical, logits within fp32
tolerance (dense: bitwise equal, the same sdpa on the same latents; absorbed: float rounding).
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig

import hf_paged
from hf_paged import Engine
from hf_paged.attention import dispatch, interface
from hf_paged.hf.cache import PagedCache
from hf_paged.planner import sizing
from tiny_models import MLA_CONFIGS, bias_up_projections, cache_of, left_padded_batch, tiny_mla_model, with_cache

ARCHS = sorted(MLA_CONFIGS)
LENGTHS = [5, 17, 33, 16]  # cross block boundaries for block_size 1 and 16
NEW_TOKENS = 12
LOGITS_ATOL = 1e-5  # fp32 on both sides, same sdpa over the same latents
ABSORBED_ATOL = 1e-4  # fp32, the absorbed sums in another order
ENGINE_MESSAGE = r"kv_b_proj is a .*not a plain floating-point nn.Linear without bias.*attn_implementation='sdpa'"


def _generate(model, input_ids, attention_mask, **kwargs):
    return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def _with_logits(model, input_ids, attention_mask, **kwargs):
    # output_logits makes hf_paged's drop-in generate take stock generation (with a PagedCache)
    return _generate(model, input_ids, attention_mask, output_logits=True, return_dict_in_generate=True, **kwargs)


def _assert_same(ref, out, atol=LOGITS_ATOL):
    assert torch.equal(ref.sequences, out.sequences)
    for step, (a, b) in enumerate(zip(ref.logits, out.logits)):
        torch.testing.assert_close(b, a, atol=atol, rtol=0, msg=lambda m: f"step {step}: {m}")


def _latent_bytes_per_token(config, itemsize=4):
    indexed = "indexed_attention" in (getattr(config, "layer_types", None) or [])
    index = config.index_head_dim if indexed else 0  # DeepSeek V3.2's indexer key, in the same row
    return config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim + index) * itemsize


@pytest.fixture
def count_paged_calls(monkeypatch):
    calls = []  # per paged attention call, its latent width (None: plain K/V), or "sparse" (indexed layers)
    original, sparse = dispatch.paged_attention, interface.sparse_latent_attention
    monkeypatch.setattr(dispatch, "paged_attention",
                        lambda *a, **k: calls.append(k.get("latent_dim")) or original(*a, **k))
    monkeypatch.setattr(interface, "sparse_latent_attention", lambda *a, **k: calls.append("sparse") or sparse(*a, **k))
    return calls


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_left_padded_batch_matches_stock(arch, count_paged_calls):
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=1)
    model = tiny_mla_model(arch)
    ref = _with_logits(model, input_ids, attention_mask)
    model.set_attn_implementation("hf_paged")
    for block_size in (1, 16):
        model.hf_paged_cache_config = hf_paged.PagedCacheConfig(block_size=block_size)
        _assert_same(ref, _with_logits(model, input_ids, attention_mask), ABSORBED_ATOL)  # the Engine
        model.hf_paged_use_engine = False  # stock generation over a PagedCache, attached: paged steps
        out = _with_logits(model, input_ids, attention_mask)
        del model.hf_paged_use_engine
        _assert_same(ref, out, ABSORBED_ATOL)
        cache = cache_of(out)
        assert isinstance(cache, PagedCache) and cache.has_latent_kv
        stats = cache.stats()
        # Only real tokens are stored (the last generated token has no K/V yet), at the latents' size.
        assert stats["num_tokens"] == sum(LENGTHS) + len(LENGTHS) * (NEW_TOKENS - 1)
        assert stats["bytes_per_token"] == _latent_bytes_per_token(model.config)
    # attention read the rows in place, absorbed, at the latent's width
    assert len(count_paged_calls) >= 2 * 2 * NEW_TOKENS * model.config.num_hidden_layers
    indexed = "indexed_attention" in (getattr(model.config, "layer_types", None) or [])
    assert set(count_paged_calls) == ({"sparse"} if indexed else {model.config.kv_lora_rank})


@pytest.mark.parametrize("arch", ARCHS)
def test_user_paged_cache_with_sdpa_matches_stock(arch):
    """A PagedCache handed to an sdpa model stores K (latent) and V (rotary key) at their own widths."""
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=2)
    model = tiny_mla_model(arch)
    ref = _with_logits(model, input_ids, attention_mask)
    cache = PagedCache(model.config, block_size=4)
    out = _with_logits(model, input_ids, attention_mask, **with_cache(cache))
    _assert_same(ref, out)
    config = model.config
    for layer in cache.layers:
        assert layer.keys.shape[1:] == (4, 1, config.kv_lora_rank)
        assert layer.values.shape[1:] == (4, 1, config.qk_rope_head_dim)
    assert cache.stats()["num_tokens"] == sum(LENGTHS) + len(LENGTHS) * (NEW_TOKENS - 1)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton store_kv under the interpreter")
def test_generate_with_triton_store_kv_matches_stock(monkeypatch):
    """HF_PAGED_BACKEND=triton: the Triton store_kv writes the 16-wide K and 8-wide V latents."""
    input_ids, attention_mask = left_padded_batch([7, 3], seed=3)
    model = tiny_mla_model("deepseek_v3")
    ref = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, min_new_tokens=3,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    model.set_attn_implementation("hf_paged")
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, min_new_tokens=3,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    _assert_same(ref, out)
    assert dispatch.backend(torch.device("cpu")) == "triton"


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_serves_latent_attention_as_stock(arch):
    """The Engine serves MLA models (packed steps over the rows, absorbed): greedy tokens are stock's."""
    model = tiny_mla_model(arch, "hf_paged")
    input_ids, attention_mask = left_padded_batch([5, 9, 30], seed=5)
    ref = _generate(tiny_mla_model(arch), input_ids, attention_mask)
    assert torch.equal(_generate(model, input_ids, attention_mask), ref)
    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
    outs = Engine(model, block_size=4, num_blocks=64).generate(prompts, hf_paged.SamplingParams(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == [row[input_ids.shape[1]:].tolist() for row in ref]


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_refuses_an_up_projection_it_cannot_absorb_and_generate_falls_back(arch):
    """A kv_b_proj with a bias (or quantised, or any Linear subclass) cannot be folded into the query: the
    Engine refuses the model with a ValueError naming it, and generate() takes stock generation over a
    PagedCache (dense: the module expands the latents itself)."""
    model = tiny_mla_model(arch, "hf_paged")
    stock = tiny_mla_model(arch)
    bias_up_projections(model, stock)
    with pytest.raises(ValueError, match=ENGINE_MESSAGE):
        Engine(model, block_size=4, num_blocks=32)
    input_ids, attention_mask = left_padded_batch([5, 9], seed=5)
    ref = _with_logits(stock, input_ids, attention_mask)
    out = _with_logits(model, input_ids, attention_mask)
    _assert_same(ref, out)
    assert torch.equal(_generate(model, input_ids, attention_mask), ref.sequences)


@pytest.mark.parametrize("arch", ARCHS)
def test_bytes_per_block_from_config_matches_the_tensors(arch):
    model = tiny_mla_model(arch)
    cache = PagedCache(model.config, block_size=16)
    from_config = cache.bytes_per_block(torch.float32)
    assert from_config == 16 * _latent_bytes_per_token(model.config)
    input_ids, attention_mask = left_padded_batch([9, 20], seed=6)
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask, **with_cache(cache))
    assert all(layer.is_initialized for layer in cache.layers)
    assert cache.bytes_per_block() == from_config  # now measured on the allocated blocks


def test_bytes_per_block_agrees_with_the_planner_on_deepseek_v3():
    """The real DeepSeek-V3 config (61 layers, 512-wide latent, 64-wide rotary key): the cache sizes
    its blocks from the config exactly as the torch-free planner does."""
    config = AutoConfig.for_model(**sizing.load_config("deepseek-v3"))
    cache = PagedCache(config, block_size=16)
    result = sizing.plan(sizing.ModelShape.from_config(config), kv_budget_bytes=10**9, seq_len=100, block_size=16,
                         kv_dtype="bfloat16")
    assert cache.bytes_per_block(torch.bfloat16) == result.bytes_per_block == 61 * 16 * (512 + 64) * 2
