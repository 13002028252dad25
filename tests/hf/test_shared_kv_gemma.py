"""Layers that reuse another layer's K/V (Gemma 3n, Gemma 4) and per-layer K/V shapes (Gemma 4), served
paged and checked against stock transformers (sdpa, DynamicCache).

Both tiny models alternate sliding (window 8) and full layers over 6 layers; the last 2 reuse the K/V of
layers 2 and 3 (`num_kv_shared_layers`): they own no blocks and no tensors, their attention reads their
source's blocks with their own mask. Gemma 4's full layers keep 1 KV head of 64 (`global_head_dim`,
`num_global_key_value_heads`, keys doubling as values) and its sliding layers 2 heads of 16: one pool of
byte pages holds both, balanced by bytes (a block holds one full layer or two sliding ones). Greedy ids
are compared exactly; q/k projections and norms are sharpened (x10).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.gemma3n import Gemma3nTextConfig
from transformers.models.gemma4 import Gemma4TextConfig

from family_sweep import sharpen
from hf_paged import Engine, SamplingParams
from hf_paged.config import PagedCacheConfig
from hf_paged.hf import PagedCache
from hf_paged.hf.kv_owner import KVOwner
from hf_paged.hf.layer import SharedLayer
from hf_paged.planner.plan import plan
from hf_paged.planner.shape import ModelShape
from layer_kinds import GEMMA4_FULL_LAYERS, GEMMA_TEXT, GEMMA_WINDOW, engine_scenario, left_padded, random_rows
from tiny_models import with_cache

NEW = 16
BLOCK = 4
WINDOW = GEMMA_WINDOW
CONFIGS = {
    "gemma3n": lambda: Gemma3nTextConfig(**GEMMA_TEXT, activation_sparsity_pattern=[0.0] * 6, laurel_rank=4,
                                         altup_num_inputs=2),
    "gemma4": lambda: Gemma4TextConfig(**GEMMA_TEXT, **GEMMA4_FULL_LAYERS),
}


def _model(attn: str, config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn).eval()
    sharpen(model)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request):
    config = CONFIGS[request.param]()
    return _model("sdpa", config), _model("hf_paged", config)


def test_drop_in_generate_on_a_left_padded_batch_twice_matches_stock(models):
    stock, paged = models
    ids, mask = left_padded(random_rows([40, 13, 29]) + random_rows([40]))
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    expected = stock.generate(ids, attention_mask=mask, **gen)
    assert torch.equal(paged.generate(ids, attention_mask=mask, **gen), expected)
    assert torch.equal(paged.generate(ids, attention_mask=mask, **gen), expected)
    assert paged.hf_paged_last_metrics["vllm:prefix_cache_hits"] >= 40 // BLOCK * BLOCK  # the first call's prompt


@pytest.mark.parametrize("path", ["paged", "dense"])
def test_reusing_layers_hold_nothing_and_the_pool_is_what_the_planner_counts(models, path):
    """Stock generate over a PagedCache, attention reading the blocks (paged) or gathered K/V (dense);
    Gemma 4 keeps only the last query in its reusing layers (`logits_to_keep`) while prefilling."""
    stock, paged = models
    model = paged if path == "paged" else stock
    ids, mask = left_padded(random_rows([40, 13, 29], seed=1))
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    expected = stock.generate(ids, attention_mask=mask, **gen)
    cache = PagedCache(model.config, block_size=BLOCK)
    model.hf_paged_use_engine = False
    try:
        out = model.generate(ids, attention_mask=mask, **gen, **with_cache(cache))
    finally:
        del model.hf_paged_use_engine
    assert torch.equal(out, expected)
    shared = [layer for layer in cache.layers if isinstance(layer, SharedLayer)]
    assert [layer.source for layer in shared] == [2, 3] and cache.is_dummy == [False] * 4 + [True] * 2
    assert all(layer.keys is None and layer.values is None for layer in shared)
    for layer in cache.kv.storage_layers:  # each layer's K/V as its config gives it (Gemma 4: per kind)
        full = layer.spec.kind == "full_attention"
        heads, dim = (1, 64) if full and "Gemma4" in type(model.config).__name__ else (2, 16)
        assert layer.keys.shape[1:] == (BLOCK, heads, dim)
    if cache.kv.pages is not None:
        buffers = [cache.kv.pages.keys, cache.kv.pages.values]
    else:
        buffers = list({t.data_ptr(): t for layer in cache.kv.storage_layers for t in (layer.keys, layer.values)}.values())
    pool_bytes = sum(t.numel() * t.element_size() for t in buffers)
    assert cache.bytes_per_block() == PagedCache(model.config, block_size=BLOCK).bytes_per_block(torch.float32)
    planned = plan(ModelShape.from_config(model.config.to_dict()), kv_budget_bytes=1 << 30, seq_len=64,
                   block_size=BLOCK, kv_dtype="float32")
    assert pool_bytes == cache.pool.num_blocks * cache.bytes_per_block() == cache.pool.num_blocks * planned.bytes_per_block
    sliding = [g for g, spec in enumerate(cache.layout.group_specs) if spec.mask.window == WINDOW]
    for seq in cache.seqs:
        for g in sliding:
            assert len(seq.block_tables[g]) - seq.num_released[g] <= -(-WINDOW // BLOCK) + 1


def test_engine_chunked_prefill_preemption_ngram_and_a_shared_prefix_match_stock(models):
    figures = engine_scenario(*models, BLOCK, NEW)
    print(figures)  # the figures (-s)
    assert figures["cached_tokens"] >= 48
    assert figures["preemptions"] > 0 and figures["drafts"] > 0


def test_quantised_kv_reusing_layers_read_their_sources_scales():
    """int8 blocks: a reusing layer's attention dequantises with its source layer's scales."""
    model = _model("hf_paged", CONFIGS["gemma3n"]())
    shared = random_rows([24], seed=6)[0]
    prompts = random_rows([3, 11], seed=7, prefix=shared)
    params = SamplingParams(max_new_tokens=8, min_new_tokens=8)
    plain = Engine(model, kv_cache_dtype="int8", block_size=BLOCK, enable_prefix_caching=False).generate(prompts, params)
    engine = Engine(model, kv_cache_dtype="int8", block_size=BLOCK)
    cached = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain] and cached[1].metrics.num_cached_tokens >= 24


def test_per_layer_shapes_refuse_what_they_cannot_serve_yet():
    config = CONFIGS["gemma4"]()
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' with per-layer K/V shapes"):
        KVOwner(config, PagedCacheConfig(kv_cache_dtype="int8"))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide .* layer 1's 1 KV heads"):
        KVOwner(config, PagedCacheConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="differ in K/V shape"):
        KVOwner(config, PagedCacheConfig(num_blocks=4, enable_hybrid_kv=False)).check_transferable()


def test_a_forward_keeping_the_last_logits_matches_sdpa(models):
    """No cache (training, scoring): Gemma 4 slices its KV-sharing layers' queries to `logits_to_keep` for
    hf_paged (stock keeps them all under sdpa); the kept queries are the last positions, not the first."""
    stock, paged = models
    ids = torch.tensor(random_rows([20, 20], seed=8))
    with torch.no_grad():
        for keep in (1, 4):
            torch.testing.assert_close(paged(ids, logits_to_keep=keep).logits, stock(ids, logits_to_keep=keep).logits,
                                       atol=1e-4, rtol=1e-4)


def test_the_chosen_backend_runs_the_kv_sharing_layers_too(models, monkeypatch):
    """Gemma 4's KV-sharing layers attend over a view of the step (their last queries only); the view keeps
    the step's backend: `attention_backend` wins over HF_PAGED_BACKEND there as everywhere."""
    from hf_paged.attention import dispatch

    stock, paged = models
    monkeypatch.setenv("HF_PAGED_BACKEND", "cpu")
    seen = []
    real = dispatch.run
    monkeypatch.setattr(dispatch, "run", lambda call, plan=None: seen.append(plan.backend) or real(call, plan))
    ids, mask = left_padded(random_rows([20, 9], seed=9))
    gen = dict(max_new_tokens=3, do_sample=False)
    cache = PagedCache(paged.config, PagedCacheConfig(block_size=BLOCK, attention_backend="torch"))
    paged.hf_paged_use_engine = False
    try:
        out = paged.generate(ids, attention_mask=mask, **gen, **with_cache(cache))
    finally:
        del paged.hf_paged_use_engine
    assert torch.equal(out, stock.generate(ids, attention_mask=mask, **gen))
    assert seen and set(seen) == {"torch"}


def test_kv_transfer_of_a_pool_of_two_shapes_is_refused_before_any_handshake(models):
    stock, paged = models
    engine = Engine(paged, block_size=BLOCK, num_blocks=64)
    engine.generate([random_rows([9])[0]], SamplingParams(max_new_tokens=2))
    if engine.kv.layout.uniform_shape:  # Gemma 3n: one shape, transferable as any pool
        assert engine.kv_transfer_info()["kv_numel_per_token"] > 0
    else:
        with pytest.raises(ValueError, match="differ in K/V shape"):
            engine.kv_transfer_info()
