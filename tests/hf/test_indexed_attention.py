"""Indexed sparse attention (DeepSeek V3.2's DSA, GLM-5, HY v4, AXK2) over a `PagedCache`.

Each indexed layer's indexer keeps a small key per token beside the latents (`PagedCache.update_indexer`)
and picks each query's top `index_topk` cached keys; attention reads only those. Paged steps run the
indexer per sequence over keys read through the block table (`hf.indexer`) and attend over the picked
latent rows (`attention.sparse`); dense calls mask every other key, as stock's eager and sdpa do.

The oracle is stock `generate` on the same weights (sdpa; eager for HY v4, which has no sdpa): greedy
tokens identical, with `index_topk` 8 (below every prompt: the sparse selection decides the tokens)
and 4096 (every key: dense-equivalent). Queries are scaled by 10 so that which key a query reads shows.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import hf_paged.attention.interface as interface
from hf_paged import Engine, SamplingParams
from hf_paged.attention.sparse import sparse_latent_attention
from hf_paged.hf import PagedCache
from family_sweep import family_config, sharpen
from layer_kinds import greedy_alone, left_padded, random_rows
from tiny_models import MLA_CONFIGS, with_cache

TOPK = 8
LENGTHS = [20, 57, 90, 33]
NEW = 10
PEAK = 10.0
FP32_ATOL = 1e-5  # fp32 on both sides


def _pair(config, stock_attn: str = "sdpa", sharpen_all: bool = False):
    """(stock, paged) models with the same weights, their queries scaled by PEAK."""
    torch.manual_seed(0)
    # Each its own config: from_config keeps the object, and its attention implementation is the config's.
    stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=stock_attn).eval()
    if sharpen_all:
        sharpen(stock)
    else:
        with torch.no_grad():
            for module in stock.modules():
                if hasattr(module, "kv_b_proj"):
                    module.q_b_proj.weight.mul_(PEAK)
    with torch.no_grad():  # the pad id's embedding is zero at init: a generated pad token would read no input
        stock.get_input_embeddings().weight[config.pad_token_id].normal_(0, config.initializer_range)
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="hf_paged").eval()
    paged.load_state_dict(stock.state_dict())
    assert stock.config._attn_implementation == stock_attn
    return stock, paged


def _v32(topk: int = TOPK):
    config = MLA_CONFIGS["deepseek_v32"]()
    config.index_topk = topk
    return config


_PAIRS: dict = {}


def _v32_pair(topk: int = TOPK):
    if topk not in _PAIRS:
        _PAIRS[topk] = _pair(_v32(topk))
    return _PAIRS[topk]


@pytest.fixture
def sparse_calls(monkeypatch):
    """The packed `indices` [num_tokens, W] of every paged sparse attention call."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[4].clone())
        return sparse_latent_attention(*args, **kwargs)

    monkeypatch.setattr(interface, "sparse_latent_attention", spy)
    return calls


def _assert_sparse_ran(calls, topk: int):
    """Some query chose among more than `topk` keys (its picks are `topk` positions, one past `topk`),
    and some query with fewer keys than the step's width got -1 entries."""
    assert calls
    assert {c.shape[-1] for c in calls} == {topk}
    picks = torch.cat([c.long() for c in calls])
    full = (picks >= 0).all(-1)
    assert bool((full & (picks.max(-1).values >= topk)).any())
    assert bool((picks < 0).any())


def _generate(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kwargs)


def _drop_in_both_ways(paged, ids, mask) -> list[torch.Tensor]:
    """The drop-in `generate` on the engine (one packed row per step), then as stock generation over an
    attached PagedCache (paged steps over the left-padded batch)."""
    outs = [_generate(paged, ids, mask)]
    paged.hf_paged_use_engine = False
    try:
        outs.append(_generate(paged, ids, mask))
    finally:
        del paged.hf_paged_use_engine
    return outs


# ------------------------------------------------------------------ the sparse attention function
def _reference(query, rows, block_tables, q_lens, seq_lens, indices, scale, latent_dim, sinks=None):
    """Per sequence: its rows gathered position by position; per query, every key it did not pick masked."""
    out = []
    block_size = rows.shape[1]
    first = 0
    for s, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        keys = torch.stack([rows[block_tables[s, p // block_size], p % block_size, 0] for p in range(seq_len)]).float()
        picks = indices[first:first + q_len].long()
        allowed = torch.zeros(q_len, seq_len + 1, dtype=torch.bool)
        allowed.scatter_(1, picks.masked_fill(picks < 0, seq_len), True)
        scores = torch.einsum("qhd,kd->qhk", query[first:first + q_len].float(), keys) * scale
        scores = scores.masked_fill(~allowed[:, None, :seq_len], float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[None, :, None].expand(q_len, -1, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :seq_len]
        out.append(torch.einsum("qhk,kl->qhl", probs, keys[:, :latent_dim]))
        first += q_len
    return torch.cat(out)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads", [1, 3, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_sparse_latent_attention_matches_a_dense_masked_reference(block_size, num_heads, with_sinks):
    """Decode (1 query), verify (k + 1) and prefill chunks over sequences of 1 .. 97 tokens, random
    non-contiguous block tables, strided rows (the indexer keys after them), picks in any order with
    -1 padding, the width above and below the keys a query has."""
    g = torch.Generator().manual_seed(block_size * 10 + num_heads)
    latent, rope, index = 16, 8, 8
    seq_lens = [1, 15, 16, 17, 54, 97]
    q_lens = [1, 4, 16, 1, 54, 13]
    width = 12
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks + 3
    store = torch.randn(num_blocks, block_size, 1, latent + rope + index, generator=g)
    rows = store[..., :latent + rope]  # a strided view, as the pool hands it
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = perm[:len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).int()
    indices = []
    for q_len, seq_len in zip(q_lens, seq_lens):
        for j in range(q_len):
            pos = seq_len - q_len + j
            cand = torch.randperm(pos + 1, generator=g)[:width]
            row = torch.full((width,), -1)
            row[:len(cand)] = cand
            indices.append(row[torch.randperm(width, generator=g)])
    indices = torch.stack(indices).int()
    indices[5] = -1  # a query that picked nothing reads nothing (zeros, not NaN)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_heads, latent + rope, generator=g)
    sinks = torch.randn(num_heads, generator=g) if with_sinks else None
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = sparse_latent_attention(query, rows, block_tables, cu, indices, 0.3, latent, sinks=sinks)
    ref = _reference(query, rows, block_tables, q_lens, seq_lens, indices, 0.3, latent, sinks)
    if not with_sinks:
        ref[5] = 0
        assert torch.equal(out[5], torch.zeros_like(out[5]))
    torch.testing.assert_close(out, ref, atol=FP32_ATOL, rtol=1e-5)


def test_sparse_latent_attention_names_bad_shapes():
    rows = torch.zeros(4, 16, 1, 24)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    tables = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices must be"):
        sparse_latent_attention(torch.zeros(2, 4, 24), rows, tables, cu, torch.zeros(2, 8), 1.0, 16)
    with pytest.raises(ValueError, match="query"):
        sparse_latent_attention(torch.zeros(2, 4, 20), rows, tables, cu, torch.zeros(2, 8, dtype=torch.int32), 1.0, 16)


# ------------------------------------------------------------------ DeepSeek V3.2 against stock
@pytest.mark.parametrize("topk", [TOPK, 4096])
def test_drop_in_generate_on_a_left_padded_batch_matches_stock(topk, sparse_calls):
    """`index_topk` 8 (each query past its 8th key chooses; some have fewer and pad with -1) and 4096
    (every key picked): greedy tokens identical to stock sdpa, every layer through the sparse path."""
    stock, paged = _v32_pair(topk)
    ids, mask = left_padded(random_rows(LENGTHS, seed=5))
    expected = _generate(stock, ids, mask)
    for out in _drop_in_both_ways(paged, ids, mask):
        assert torch.equal(out, expected)
    if topk == TOPK:
        _assert_sparse_ran(sparse_calls, TOPK)
    else:  # dense-equivalent: every query picks all its keys, -1 past them
        assert max(c.shape[-1] for c in sparse_calls) == max(LENGTHS) + NEW - 1
        for picks in sparse_calls:
            assert torch.equal((picks >= 0).sum(-1), picks.max(-1).values + 1)


def test_the_sparse_selection_decides_the_tokens():
    """The premise: stock's tokens with top-8 differ from its tokens with every key."""
    stock, _ = _v32_pair()
    dense = AutoModelForCausalLM.from_config(_v32(4096), attn_implementation="sdpa").eval()
    dense.load_state_dict(stock.state_dict())
    prompts = random_rows(LENGTHS, seed=5)
    assert greedy_alone(stock, prompts, NEW) != greedy_alone(dense, prompts, NEW)


def test_engine_generate_matches_stock_per_prompt(sparse_calls):
    """The engine, prefilling in chunks of 16 (a chunk's queries read every earlier key, none after) and
    speculating n-grams (verify steps of k + 1 queries, rejected drafts rolled back): each prompt's
    greedy tokens are stock's alone."""
    stock, paged = _v32_pair()
    prompts = random_rows(LENGTHS, seed=5)
    expected = greedy_alone(stock, prompts, NEW)
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)
    assert [o.token_ids for o in Engine(paged, block_size=16).generate(prompts, params)] == expected
    engine = Engine(paged, block_size=16, max_num_batched_tokens=16, speculative_method="ngram",
                    num_speculative_tokens=3)
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    assert engine.metrics()["vllm:spec_decode_num_draft_tokens"] > 0
    _assert_sparse_ran(sparse_calls, TOPK)


def test_paged_cache_handed_to_an_sdpa_model_matches_stock(sparse_calls):
    """An sdpa model over a PagedCache: `update_indexer` stores the keys and returns every column's
    (zeros at padding), the model's own masking does the rest; tokens and logits as with DynamicCache."""
    stock, _ = _v32_pair()
    ids, mask = left_padded(random_rows(LENGTHS, seed=5))
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    ref = _generate(stock, ids, mask, **kwargs)
    out = _generate(stock, ids, mask, **kwargs, **with_cache(PagedCache(stock.config, block_size=16)))
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(b, a, atol=FP32_ATOL, rtol=0)
    assert not sparse_calls  # dense: the model's own sdpa


def test_forward_without_a_paged_step_masks_unpicked_keys_as_stock():
    """The "hf_paged" attention outside a paged step (no cache, as training runs; a DynamicCache): the
    indexer's picks mask the other keys exactly as stock sdpa's do."""
    stock, paged = _v32_pair()
    ids, mask = left_padded(random_rows(LENGTHS, seed=6))
    keep = mask.bool()
    with torch.no_grad():
        ref = stock(ids, attention_mask=mask).logits
        torch.testing.assert_close(paged(ids, attention_mask=mask, use_cache=False).logits[keep], ref[keep],
                                   atol=FP32_ATOL, rtol=0)
        out = paged(ids, attention_mask=mask, **with_cache(DynamicCache(config=paged.config))).logits
    torch.testing.assert_close(out[keep], ref[keep], atol=FP32_ATOL, rtol=0)


def test_an_unattached_model_over_a_paged_cache_plans_dense_steps():
    """A forward that no planning hook saw (the cache plans a dense step from the shapes, every column
    stored): prefill then one decode step, logits as stock's with DynamicCache."""
    config = _v32()
    weights = _v32_pair()[0].state_dict()
    models = []
    for _ in range(2):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        model.load_state_dict(weights)
        models.append(model)
    ids = torch.tensor(random_rows([30], seed=7))
    caches = [DynamicCache(config=config), PagedCache(config, block_size=16)]
    with torch.no_grad():
        for step in (ids, ids[:, -1:]):
            ref, out = (m(step, **with_cache(c)).logits for m, c in zip(models, caches))
            torch.testing.assert_close(out, ref, atol=FP32_ATOL, rtol=0)


def test_update_indexer_names_misuse():
    stock, _ = _v32_pair()
    cache = PagedCache(stock.config, block_size=16)
    with pytest.raises(ValueError, match="before its update"):
        cache.update_indexer(torch.zeros(1, 3, 16), 0)
    with torch.no_grad():
        stock(torch.tensor([[5, 6, 7]]), **with_cache(cache))
    with pytest.raises(ValueError, match=r"\[batch, q_len, 16\]"):
        cache.update_indexer(torch.zeros(1, 3, 4), 0)


# ------------------------------------------------------------------ GLM-5, HY v4, AXK2
@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "hy_v4", "axk2"])
def test_other_indexed_families_match_stock(model_type, sparse_calls):
    """Each family's own indexer (HY v4: rotary dims last, fp32 norm, sinks; GLM-5 and HY v4: a second
    layer reusing the first's picks) with top-8: drop-in generate identical to stock, and a forward
    without a cache within fp32 rounding."""
    config = family_config(model_type)
    shared = {"indexer_types": ["full", "shared"]} if hasattr(config, "indexer_types") else {}
    for key, value in dict(index_topk=TOPK, index_n_heads=16, index_head_dim=16, vocab_size=256, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, **shared).items():
        setattr(config, key, value)
    stock, paged = _pair(config, "eager" if model_type == "hy_v4" else "sdpa", sharpen_all=True)
    ids, mask = left_padded(random_rows(LENGTHS, seed=5))
    expected = _generate(stock, ids, mask)
    for out in _drop_in_both_ways(paged, ids, mask):
        assert torch.equal(out, expected)
    _assert_sparse_ran(sparse_calls, TOPK)
    keep = mask.bool()
    with torch.no_grad():
        ref = stock(ids, attention_mask=mask).logits
        out = paged(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(out[keep], ref[keep], atol=FP32_ATOL, rtol=0)
