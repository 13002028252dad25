"""Hybrid KV memory (sliding-window layers keep only their window), checked against stock transformers.

Every model here mixes sliding and full layers, or slides everywhere (Mistral), with windows of 7 to
11 tokens; prompts and outputs are longer than 3x the window, so the sliding layers really release
blocks. The oracle is stock `generate` with `DynamicCache` (whose sliding layers keep the last
`window - 1` tokens): greedy ids identical, logits within fp32 tolerance. Each test also checks that
the sliding groups hold no more than `config.blocks_held` and that nothing leaks.
"""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import Engine, SamplingParams
from hf_paged.config import blocks_held, kv_layout
from hf_paged.core import BlockManager, BlockPool
from hf_paged.hf.cache import PagedCache
from hf_paged.hf.support import layer_specs_of
from tiny_models import (CONFIGS, STOCK_ATTN, VOCAB, cache_of, left_padded_batch, stock_greedy, tiny_model,
                         with_cache)

HYBRID = ["gemma2", "gemma3", "gpt_oss", "mistral", "qwen2"]
LOGITS_ATOL = 1e-4  # fp32 end to end: only summation order differs
NEW = 40  # > 3x every window


def _window(arch) -> int:
    return max(s.mask.window for s in layer_specs_of(CONFIGS[arch]()) if s.mask.window is not None)


def _prompts(lengths, seed=0, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _stock(arch, prompts):
    return stock_greedy(arch, prompts, max_new_tokens=NEW, min_new_tokens=NEW)


def _assert_windowed(cache: PagedCache, new_tokens: int = 1):
    """Every sequence's groups hold at most what the shared equation says for the step that wrote
    its last `new_tokens` tokens (they are released at the next append)."""
    manager = cache.manager
    for seq in cache.seqs:
        for g, window in enumerate(manager.windows):
            held = len(seq.block_tables[g]) - seq.num_released[g]
            bound = blocks_held(seq.num_tokens - new_tokens, window, cache.block_size, manager.lookback, new_tokens)
            assert held <= bound, (g, window, held, bound)
        assert any(seq.num_released[g] for g, w in enumerate(manager.windows) if w is not None)


@pytest.mark.parametrize("arch", HYBRID)
def test_drop_in_generate_matches_stock_and_keeps_only_the_window(arch):
    window = _window(arch)
    lengths = [3 * window + 5, 3 * window + 17, 4 * window]
    input_ids, attention_mask = left_padded_batch(lengths)
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    model = tiny_model(arch, STOCK_ATTN.get(arch, "sdpa"))
    ref = model.generate(input_ids, attention_mask=attention_mask, **gen)
    model.set_attn_implementation("hf_paged")
    model.hf_paged_use_engine = False  # the PagedCache route of stock generate
    for block_size in (1, 4, 16):
        model.hf_paged_cache_config = hf_paged.PagedCacheConfig(block_size=block_size)
        out = model.generate(input_ids, attention_mask=attention_mask, **gen)
        assert torch.equal(out.sequences, ref.sequences), (arch, block_size)
        for step, (a, b) in enumerate(zip(ref.logits, out.logits)):
            torch.testing.assert_close(b, a, atol=LOGITS_ATOL, rtol=0, msg=lambda m: f"step {step}: {m}")
        cache = cache_of(out)
        _assert_windowed(cache)
        # A one-table cache would hold every token in every layer: this one holds far fewer blocks.
        full = sum(-(-seq.num_tokens // block_size) for seq in cache.seqs) * len(cache.layers)
        assert cache.stats()["num_used_blocks"] * cache.layout.num_slots < full
    model.hf_paged_use_engine = True  # the engine route (the default)
    model.hf_paged_cache_config = None
    out = model.generate(input_ids, attention_mask=attention_mask, **{**gen, "output_logits": False})
    assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("arch", HYBRID)
def test_engine_chunked_prefill_and_preemption_match_stock(arch):
    window = _window(arch)
    prompts = _prompts([3 * window + 2, 4 * window + 1, 1, 3 * window + 9, 2 * window])
    stock = _stock(arch, prompts)
    model = tiny_model(arch, "hf_paged")
    # A pool a few blocks above what the longest request ever holds at once: requests must preempt.
    tight = BlockManager(BlockPool(0), 4, kv_layout(layer_specs_of(model.config)).windows)
    setups = {
        "chunked": dict(max_num_batched_tokens=window + 2, block_size=4),
        "preempting": dict(num_blocks=tight.max_blocks_for(max(map(len, prompts)) + NEW, 16) + 2, block_size=4,
                           max_num_batched_tokens=16),
        "block_size_1": dict(block_size=1, max_num_batched_tokens=5, num_blocks=400),
    }
    for name, kwargs in setups.items():
        engine = Engine(model, **kwargs)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
        assert [o.token_ids for o in outs] == stock, f"{arch}/{name}"
        pool = engine.cache.pool
        assert pool.num_free_blocks == pool.num_blocks
        pool.check_invariants()
        if name == "preempting":
            assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", HYBRID)
def test_prefix_hits_longer_than_the_window_are_exact(arch):
    window = _window(arch)
    shared = _prompts([3 * window + 6], seed=5)[0]
    prompts = _prompts([7, 19, 1], seed=6, prefix=shared)
    stock = _stock(arch, prompts)
    engine = Engine(tiny_model(arch, "hf_paged"), block_size=4, max_num_batched_tokens=64)
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)
    first = engine.generate(prompts[:1], params)
    rest = engine.generate(prompts[1:], params)  # later requests hit the first one's blocks
    assert [o.token_ids for o in first + rest] == stock
    cached = [o.metrics.num_cached_tokens for o in rest]
    assert all(c >= len(shared) - 4 for c in cached), cached
    # The sliding groups took only the last window's blocks of the hit: the prefix cache kept the rest.
    assert engine.cache.pool.num_free_blocks == engine.cache.pool.num_blocks


@pytest.mark.parametrize("arch", HYBRID)
def test_prompt_lookup_speculation_matches_stock(arch):
    window = _window(arch)
    motif = _prompts([window + 3], seed=9)[0]
    prompts = [motif * 4, motif[:5] * 7 + motif]
    stock = _stock(arch, prompts)
    engine = Engine(tiny_model(arch, "hf_paged"), speculative_method="ngram", num_speculative_tokens=4,
                    block_size=4)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
    assert [o.token_ids for o in outs] == stock
    assert engine.metrics()["vllm:spec_decode_num_draft_tokens"] > 0


def test_draft_model_speculation_with_a_sliding_draft_matches_stock():
    arch = "gemma3"
    prompts = _prompts([30, 41])
    stock = _stock(arch, prompts)
    engine = Engine(tiny_model(arch, "hf_paged"), draft_model=tiny_model(arch, "hf_paged", seed=1),
                    num_speculative_tokens=4, block_size=4)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
    assert [o.token_ids for o in outs] == stock


def test_crop_below_the_kept_window_is_refused_and_changes_nothing():
    model = tiny_model("gemma3", "hf_paged")
    model.hf_paged_use_engine = False
    model.hf_paged_cache_config = hf_paged.PagedCacheConfig(block_size=2)
    ids = torch.tensor([_prompts([30])[0]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True)
    cache = cache_of(out)
    before = ([list(t) for t in cache.seqs[0].block_tables], cache.get_seq_length())
    with pytest.raises(ValueError, match="sliding-window layers"):
        cache.crop(-20)
    assert ([list(t) for t in cache.seqs[0].block_tables], cache.get_seq_length()) == before
    cache.crop(-2)  # inside the window: fine
    assert cache.get_seq_length() == before[1] - 2


def test_layers_share_storage_slots_across_groups():
    model = tiny_model("gemma3", "hf_paged")
    cache = PagedCache(model.config, block_size=4)
    assert cache.layout.num_slots == 1 and len(cache.layout.groups) == 3
    model.hf_paged_use_engine = False
    ids = torch.tensor([_prompts([20])[0]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False,
                         return_dict_in_generate=True)
    cache = cache_of(out)
    keys = {id(layer.keys) for layer in cache.layers}
    assert len(keys) == 1  # one tensor: a block id is the same bytes in every group
    assert cache.bytes_per_block() == cache.layers[0].bytes_per_block()


def test_attention_window_wider_than_the_kept_blocks_is_refused_and_none_means_the_kept_one():
    from hf_paged.attention.interface import paged_attention_forward
    from hf_paged.attention.metadata import build_packed_metadata

    meta = build_packed_metadata(q_lens=[1], seq_lens=[1], copies=[], device=torch.device("cpu"),
                                 group_slots=[[[0]], [[4]]], group_block_tables=[[[0]], [[1]]],
                                 layer_group=(0, 1), group_windows=(None, 4))
    module = type("Attn", (torch.nn.Module,), {})()
    module.layer_idx = 1
    q = torch.zeros(1, 2, 1, 8)
    k = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="kept for a window of 4"):
        paged_attention_forward(module, q, k, k, None, sliding_window=5, paged_metadata=meta)
    # A layer the config slides whose attention names no window (PhiMoE) attends over the kept window.
    out, _ = paged_attention_forward(module, q, k, k, None, sliding_window=None, paged_metadata=meta)
    assert out.shape == (1, 1, 2, 8)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_dense_attention_over_a_hybrid_paged_cache_matches_stock(arch):
    """sdpa/eager over a PagedCache get gathered K/V; released sliding positions come back as zeros,
    which the model's own sliding mask never lets a query see."""
    window = _window(arch)
    input_ids, attention_mask = left_padded_batch([3 * window + 4, 4 * window], seed=3)
    model = tiny_model(arch, STOCK_ATTN.get(arch, "sdpa"))
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    ref = model.generate(input_ids, attention_mask=attention_mask, **gen)
    cache = PagedCache(model.config, block_size=4)
    out = model.generate(input_ids, attention_mask=attention_mask, **gen, **with_cache(cache))
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(b, a, atol=LOGITS_ATOL, rtol=0)
    _assert_windowed(cache)


def test_beam_search_on_a_hybrid_model_matches_stock():
    """Beam reordering forks and frees rows (copy-on-write in every group)."""
    input_ids, attention_mask = left_padded_batch([25, 31], seed=4)
    model = tiny_model("gemma3")
    gen = dict(max_new_tokens=30, num_beams=3, do_sample=False, early_stopping=True)
    ref = model.generate(input_ids, attention_mask=attention_mask, **gen)
    model.set_attn_implementation("hf_paged")
    model.hf_paged_cache_config = hf_paged.PagedCacheConfig(block_size=4)
    out = model.generate(input_ids, attention_mask=attention_mask, **gen)
    assert torch.equal(out, ref)


def test_released_entries_read_the_rows_own_blocks():
    from hf_paged.attention.metadata import build_packed_metadata

    meta = build_packed_metadata(q_lens=[1, 1], seq_lens=[9, 2], copies=[], device=torch.device("cpu"),
                                 group_slots=[[[40], [12]], [[41], [13]]],
                                 group_block_tables=[[[7, 8, 10], [3]], [[-1, -1, 10], [4]]],
                                 layer_group=(0, 1), group_windows=(None, 3))
    assert meta.block_tables_of(1).tolist() == [[10, 10, 10], [4, 0, 0]]


def test_a_refused_crop_changes_no_row():
    """Row 0 could roll back 5 tokens, row 1 (long, its early blocks released) cannot: nothing moves."""
    cache = PagedCache(tiny_model("gemma3").config, block_size=4)
    cache.kv.grow_to(64)
    manager = cache.manager
    from hf_paged.core import KVSequence

    rows = [KVSequence(1), KVSequence(2)]
    for seq, n in zip(rows, (6, 30)):
        manager.append_tokens(seq, list(range(3, 3 + n)))
        manager.append_tokens(seq, [99])
    cache.seqs, cache._num_columns = rows, 31
    before = [(list(s.token_ids), [list(t) for t in s.block_tables]) for s in rows]
    with pytest.raises(ValueError, match="already released"):
        cache.crop(-5)
    assert [(list(s.token_ids), [list(t) for t in s.block_tables]) for s in rows] == before
    assert cache.get_seq_length() == 31
