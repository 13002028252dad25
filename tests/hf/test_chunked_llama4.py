"""Llama 4's chunked local attention served paged, checked against stock transformers (sdpa, DynamicCache).

A tiny Llama 4 text model attends in chunks of 12 tokens on its RoPE layers (0-2) and over everything on
its NoPE layer (3, with attention temperature tuning); prompts of up to 70 tokens cross several chunks.
Its attention names no chunk, so the chunk comes from the layer's spec (`kv_spec.ChunkedLocal`), and a
chunked layer's blocks of past chunks are freed as a sliding layer's are. Greedy ids are compared
exactly; q/k projections are sharpened (x10) so that a wrong chunk boundary changes tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama4 import Llama4TextConfig

from family_sweep import sharpen
from hf_paged import Engine, SamplingParams
from hf_paged.attention.interface import _additive_mask
from hf_paged.hf import PagedCache
from hf_paged.planner.plan import plan
from hf_paged.planner.shape import ModelShape
from layer_kinds import engine_scenario, greedy_alone, left_padded, random_rows
from tiny_models import VOCAB, with_cache

CHUNK = 12
NEW = 16
BLOCK = 4


def _config(**overrides) -> Llama4TextConfig:
    # use_qk_norm=False: Llama 4's weightless q/k norm would undo the sharpening
    return Llama4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            attention_chunk_size=CHUNK, num_local_experts=2, max_position_embeddings=512,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2, use_qk_norm=False, **overrides)


def _model(attn: str, config) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn).eval()
    sharpen(model)
    return model


@pytest.fixture(scope="module")
def models():
    config = _config()
    return _model("sdpa", config), _model("hf_paged", config)


def test_layers_are_chunked_and_the_dense_eager_mask_counts_chunks(models):
    _, paged = models
    cache = PagedCache(paged.config, block_size=BLOCK)
    assert [type(s).__name__ for s in cache.kv.layer_specs] == ["ChunkedLocal"] * 3 + ["FullAttention"]
    # transformers sizes chunked masks from the first layer that says it slides
    assert cache.is_sliding == [True, True, True, False]
    q, k = torch.zeros(1, 1, 5, 8), torch.zeros(1, 1, 30, 8)
    mask = _additive_mask(None, q, k, None, True, CHUNK)[0, 0]  # queries at 25..29 (no padding: positions)
    queries, keys = torch.arange(25, 30)[:, None], torch.arange(30)[None, :]
    assert torch.equal(mask == 0, (keys >= queries // CHUNK * CHUNK) & (keys <= queries))


def test_drop_in_generate_on_a_left_padded_batch_twice_matches_stock(models):
    stock, paged = models
    ids, mask = left_padded(random_rows([40, 13, 29]) + random_rows([40]))
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    expected = stock.generate(ids, attention_mask=mask, **gen)
    assert torch.equal(paged.generate(ids, attention_mask=mask, **gen), expected)
    assert torch.equal(paged.generate(ids, attention_mask=mask, **gen), expected)
    assert paged.hf_paged_last_metrics["vllm:prefix_cache_hits"] >= 40 // BLOCK * BLOCK  # the first call's prompt


@pytest.mark.parametrize("path", ["paged", "dense"])
def test_a_paged_cache_holds_one_chunk_per_sequence_and_what_the_planner_counts(models, path):
    """Stock generate over a PagedCache: attention reads the blocks (paged), or gets K/V gathered (dense:
    sdpa with transformers' chunked mask, released blocks read as zeros it never lets a query see)."""
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
    chunked = [g for g, spec in enumerate(cache.layout.group_specs) if spec.mask.chunk == CHUNK]
    assert len(chunked) == 3
    for seq in cache.seqs:  # after a 1-token step: at most one chunk of tokens, plus one block
        for g in chunked:
            assert len(seq.block_tables[g]) - seq.num_released[g] <= -(-CHUNK // BLOCK) + 1
        assert len(seq.block_tables[3]) == -(-seq.num_tokens // BLOCK)  # the NoPE layer keeps everything
    tensors = {t.data_ptr(): t for layer in cache.kv.storage_layers for t in (layer.keys, layer.values)}
    pool_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert cache.bytes_per_block() == PagedCache(model.config, block_size=BLOCK).bytes_per_block(torch.float32)
    planned = plan(ModelShape.from_config(model.config.to_dict()), kv_budget_bytes=1 << 30, seq_len=64,
                   block_size=BLOCK, kv_dtype="float32")
    assert pool_bytes == cache.pool.num_blocks * cache.bytes_per_block() == cache.pool.num_blocks * planned.bytes_per_block


def test_without_hybrid_kv_every_layer_keeps_everything_and_still_attends_in_chunks(models):
    stock, paged = models
    ids, mask = left_padded(random_rows([40, 13, 29], seed=6))
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    cache = PagedCache(paged.config, block_size=BLOCK, enable_hybrid_kv=False)
    paged.hf_paged_use_engine = False
    try:
        out = paged.generate(ids, attention_mask=mask, **gen, **with_cache(cache))
    finally:
        del paged.hf_paged_use_engine
    assert torch.equal(out, stock.generate(ids, attention_mask=mask, **gen))
    assert len(cache.layout.groups) == 1 and not any(seq.num_released[0] for seq in cache.seqs)


def test_engine_chunked_prefill_preemption_ngram_and_a_shared_prefix_match_stock(models):
    figures = engine_scenario(*models, BLOCK, NEW)
    print(figures)  # the figures (-s)
    assert figures["cached_tokens"] >= 48
    assert figures["preemptions"] > 0 and figures["drafts"] > 0


def test_nope_temperature_tuning_counts_positions_per_sequence_in_packed_steps(models):
    """Llama 4's NoPE layers scale queries by position from `cache.get_seq_length()`; an engine step
    packs several sequences in one row, so each token's own position must be used, as stock alone."""
    stock, paged = models
    prompts = random_rows([23, 9, 31], seed=5)
    modules = [m for model in models for m in model.modules() if hasattr(m, "floor_scale")]
    saved = [(m.floor_scale, m.attn_scale) for m in modules]
    for module in modules:
        module.floor_scale, module.attn_scale = 4, 4.0  # the scale grows every 4 positions, steeply
    try:
        expected = greedy_alone(stock, prompts, NEW)
        outs = Engine(paged, block_size=BLOCK, max_num_batched_tokens=16).generate(
            prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
        # Stock generate over a PagedCache: a NoPE layer asks get_seq_length mid-forward, before its own update
        # (logits compared: a wrong temperature on the last layer need not flip a tiny model's argmax)
        paged.hf_paged_use_engine = False
        gen = dict(do_sample=False, max_new_tokens=4, return_dict_in_generate=True, output_logits=True)
        for p in prompts:
            ids = torch.tensor([p])
            want = stock.generate(ids, attention_mask=torch.ones_like(ids), **gen)
            got = paged.generate(ids, attention_mask=torch.ones_like(ids), **gen,
                                 **with_cache(PagedCache(paged.config, block_size=BLOCK)))
            assert torch.equal(got.sequences, want.sequences)
            torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-4, rtol=1e-4)
    finally:
        paged.__dict__.pop("hf_paged_use_engine", None)
        for module, (floor_scale, attn_scale) in zip(modules, saved):
            module.floor_scale, module.attn_scale = floor_scale, attn_scale
    assert [o.token_ids for o in outs] == expected
