"""Layer kinds as specs (`kv_spec`) and the layout built from them (`kv_layout`, re-exported by
`config`): the spec equations against the mask rule and against the old window functions, chunked
local attention (Llama 4) in the block manager (freeing past chunks, the prefix-cache hit rule), shared
K/V (Gemma 3n/4 reuse layers own nothing) and per-layer K/V shapes (Gemma 4: groups balanced by bytes).
Torch-free; the transformers configs are read for their `kv_sharing_modes` / `per_layer_config` only."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from hf_paged.config import (SUPPORTED_LAYER_TYPES, blocks_held, kv_bytes_per_block, kv_bytes_per_token_layer,
                             kv_cache_dtype, kv_layout, kv_scale_bytes_per_token_layer, max_blocks_held,
                             num_freeable_blocks)
from hf_paged.core import BlockManager, BlockPool, KVSequence, NoFreeBlocksError
from hf_paged.core.sequence import NULL_BLOCK
from hf_paged.kv_spec import (CHUNKED, ChunkedLocal, FullAttention, KVShape, MaskRule, SharedKV, SlidingWindow,
                              layer_specs)

SPECS = [FullAttention(), SlidingWindow(window=1), SlidingWindow(window=5), SlidingWindow(window=8),
         ChunkedLocal(chunk=1), ChunkedLocal(chunk=6), ChunkedLocal(chunk=8)]


# ------------------------------------------------------------------------------------------ the equations
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_first_readable_is_the_lower_bound_any_coming_query_reads(spec):
    """first_readable(n, lookback) = the least `mask.lower_bound(p)` over every query p >= n - lookback
    (the mask rule the backends apply), and max_tokens_held bounds what a step's table spans."""
    for n in range(0, 40):
        for lookback in range(0, 4):
            if lookback > n:
                continue
            lowest = min(spec.mask.lower_bound(p) for p in range(n - lookback, n + 30))
            assert spec.first_readable(n, lookback) == lowest, (n, lookback)
            for new in range(1, 6):
                held = n + new - spec.first_readable(n, lookback)
                bound = spec.max_tokens_held(new, lookback)
                assert bound is None or held <= bound
    if spec.reach is not None:  # tight: some length reaches the bound
        assert any(n + 3 - spec.first_readable(n) == spec.max_tokens_held(3) for n in range(40))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), window=st.integers(1, 64), block_size=st.integers(1, 17),
       lookback=st.integers(0, 8), new=st.integers(0, 40))
def test_sliding_spec_is_the_window_rule_it_replaces(n, window, block_size, lookback, new):
    """The spec answers what the window functions answered (the window, an int, is still accepted)."""
    spec = SlidingWindow(window=window)
    first = max(0, n - lookback - window + 1)  # the window equation, as config had it before specs
    assert spec.first_readable(n, lookback) == first
    assert spec.max_tokens_held(new, lookback) == window - 1 + new + lookback
    for rule in (spec, window):
        assert num_freeable_blocks(n, rule, block_size, lookback) == first // block_size
        assert blocks_held(n, rule, block_size, lookback, new) == -(-(n + new) // block_size) - first // block_size
    old_max = min(-(-n // block_size), -(-(window - 1 + lookback + max(new, 1)) // block_size) + 1)
    assert max_blocks_held(spec, n, block_size, max(new, 1), lookback) == old_max
    assert max_blocks_held(None, n, block_size, new, lookback) == -(-n // block_size)


def test_chunked_rule_on_vllms_example_and_on_chunks_not_a_multiple_of_the_block():
    c8 = ChunkedLocal(chunk=8)  # vLLM's test: chunk 8, blocks of 4
    assert c8.first_readable(15) == 8 and num_freeable_blocks(15, c8, 4) == 2  # query 15 reads 8..15
    assert c8.first_readable(16) == 16 and num_freeable_blocks(16, c8, 4) == 4  # a new chunk: nothing before
    assert c8.first_readable(16, lookback=1) == 8  # a rollback of one token lands back in chunk 1
    assert blocks_held(15, c8, 4, new_tokens=1) == 2 and blocks_held(16, c8, 4, new_tokens=1) == 1
    assert c8.max_tokens_held(1) == 8 and max_blocks_held(c8, 10**6, 4, 1) == 3  # one chunk + one block
    c6 = ChunkedLocal(chunk=6)  # chunks straddle blocks of 4
    assert [num_freeable_blocks(n, c6, 4) for n in (5, 6, 11, 12, 13, 18)] == [0, 1, 1, 3, 3, 4]
    assert c6.mask == MaskRule(chunk=6) and c6.mask.lower_bound(13) == 12
    with pytest.raises(ValueError, match="attention chunk size must be a positive integer"):
        ChunkedLocal(chunk=0)
    assert "chunked_attention" in SUPPORTED_LAYER_TYPES


# ------------------------------------------------------------------------------------------ specs from configs
def _sources(specs):
    return [s.source if isinstance(s, SharedKV) else None for s in specs]


@pytest.mark.parametrize("model_type, shared", [("gemma3n_text", 15), ("gemma3n_text", 5), ("gemma4_text", 12)])
def test_reuse_layers_read_the_store_layer_of_their_type_as_transformers_says(model_type, shared):
    config = AutoConfig.for_model(model_type, num_hidden_layers=35 if model_type == "gemma3n_text" else 30,
                                  num_kv_shared_layers=shared)
    specs = layer_specs(config.to_dict())
    modes, types = config.kv_sharing_modes, config.layer_types
    for i, spec in enumerate(specs):
        if modes[i] == "reuse":
            assert isinstance(spec, SharedKV) and modes[spec.source] == "store"
            assert types[spec.source] == types[i] and spec.reads.kind == types[i] and not spec.owns_kv
            assert spec.kv_elements_per_token == 0 and spec.max_tokens_held(5) == 0
        else:
            assert spec.owns_kv and spec.kind == types[i]


def test_gemma3n_layout_reuse_layers_map_to_their_sources_and_own_nothing():
    specs = layer_specs(AutoConfig.for_model("gemma3n_text").to_dict())  # E4B: 35 layers, last 15 reuse
    layout = kv_layout(specs)
    owning = [i for i, s in enumerate(specs) if s.owns_kv]
    assert owning == list(range(20)) and sorted(l for g in layout.groups for l in g.layers) == owning
    assert [(g.spec.kind, len(g.layers)) for g in layout.groups] == [("sliding_attention", 4), ("full_attention", 4)] \
        + [("sliding_attention", 4)] * 3
    for i in range(20, 35):
        source = 19 if specs[i].reads.kind == "full_attention" else 18
        assert specs[i].source == source
        assert (layout.layer_group[i], layout.layer_slot[i]) == (layout.layer_group[source], layout.layer_slot[source])
        assert layout.layer_offset_k[i] == layout.layer_offset_k[source]
    assert layout.uniform_shape and layout.windows == (512, None, 512, 512, 512)
    # storage: 4 slots of 2 heads x 256 (K and V), not 35 layers' worth
    assert layout.bytes_per_block(16, 2) == 16 * 4 * 2 * 2 * 256 * 2
    with pytest.raises(ValueError, match="reads the K/V of layer 3, which stores none"):
        kv_layout([FullAttention(), SharedKV(source=3), FullAttention(), SharedKV(source=1)])


GEMMA4_31B = dict(num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16, head_dim=256,
                  global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024)


def _check_pages(layout, specs):
    for group in layout.groups:
        spans = sorted((layout.layer_offset_k[l], layout.layer_offset_k[l] + specs[l].shape.num_kv_heads
                        * specs[l].shape.head_dim) for l in group.layers)
        assert spans[0][0] == 0 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # no overlap
        assert spans[-1][1] <= layout.page_k


def test_gemma4_per_layer_shapes_give_groups_balanced_by_bytes():
    config = AutoConfig.for_model("gemma4_text", **GEMMA4_31B)
    specs = layer_specs(config.to_dict())
    full, sliding = KVShape(4, 512, 512), KVShape(16, 256, 256)
    assert {s.shape for s in specs if s.kind == "full_attention"} == {full}
    assert {s.shape for s in specs if s.kind == "sliding_attention"} == {sliding}
    layout = kv_layout(specs)
    assert not layout.uniform_shape
    # 10 full layers of 4,096 elements per token, 50 sliding of 8,192: one group of 10 and ten of 5,
    # each a page of 40,960 elements (K 20,480 + V 20,480), nothing padded
    assert sorted(len(g.layers) for g in layout.groups) == [5] * 10 + [10]
    assert layout.page_k == layout.page_v == 20_480 and layout.num_padding_elements == 0
    assert layout.bytes_per_block(16, 2) == 16 * 40_960 * 2
    _check_pages(layout, specs)
    assert sum(len(g.layers) * g.spec.kv_elements_per_token for g in layout.groups) == 10 * 4096 + 50 * 8192
    # tensor parallelism splits each layer's heads; 8 ranks cannot split 4 global KV heads
    assert {s.shape for s in layer_specs(config.to_dict(), 2)} == {KVShape(2, 512, 512), KVShape(8, 256, 256)}
    with pytest.raises(ValueError, match="must divide .* layer 5's 4 KV heads"):
        layer_specs(config.to_dict(), 8)


def test_per_layer_shapes_that_do_not_divide_pad_each_group_to_the_page():
    full, sliding = FullAttention(KVShape(4, 512, 512)), SlidingWindow(KVShape(16, 256, 256), window=8)
    specs = [sliding, full, sliding, full, sliding, sliding, full, sliding]  # 3 x 4,096 and 5 x 8,192
    layout = kv_layout(specs)
    # page = the rarest kind's bytes (3 x 4,096 = 12,288): one group of 3 full layers, five of 1 sliding,
    # each sliding group leaving 4,096 elements of its page unused
    assert [len(g.layers) for g in layout.groups] == [1, 3, 1, 1, 1, 1]
    assert layout.page_k + layout.page_v == 12_288 and layout.num_padding_elements == 5 * 4096
    _check_pages(layout, specs)


def test_llama4_layout_has_chunked_and_full_groups_and_no_window():
    specs = layer_specs(AutoConfig.for_model("llama4_text").to_dict())  # Scout: 48 layers, chunk 8192
    assert [s.kind for s in specs[:4]] == [CHUNKED] * 3 + ["full_attention"]
    layout = kv_layout(specs)
    assert [(g.spec.kind, len(g.layers)) for g in layout.groups] == [(CHUNKED, 12), ("full_attention", 12),
                                                                        (CHUNKED, 12), (CHUNKED, 12)]
    assert layout.group_specs[0] == ChunkedLocal(KVShape(8, 128, 128), chunk=8192) and layout.is_hybrid
    with pytest.raises(ValueError, match="chunked_attention group has no sliding window"):
        layout.windows  # noqa: B018  a chunk must never be read as a window
    # the same config without layer_types (an older config.json): RoPE layers chunked, every 4th full
    legacy = {k: v for k, v in AutoConfig.for_model("llama4_text").to_dict().items() if k != "layer_types"}
    assert [s.kind for s in layer_specs(legacy)] == [s.kind for s in specs]
    flat = kv_layout(specs, enable_hybrid_kv=False)
    assert len(flat.groups) == 1 and not flat.is_hybrid and flat.layer_specs[0].mask == MaskRule(chunk=8192)


def test_bytes_per_block_is_what_the_pages_hold():
    """`config.kv_bytes_per_block`: the K/V pages plus a quantised cache's scales; with one shape, the
    formula the cache allocated by before (num_slots slots of `kv_bytes_per_token_layer`)."""
    gemma3 = kv_layout([SlidingWindow(KVShape(4, 256, 256), window=8)] * 5 + [FullAttention(KVShape(4, 256, 256))])
    for name in ("bfloat16", "fp8", "int8"):
        dtype = kv_cache_dtype(name)
        per_slot = kv_bytes_per_token_layer(4, 256, 256, dtype)
        assert kv_bytes_per_block(gemma3, 16, dtype) == 16 * gemma3.num_slots * per_slot
    assert gemma3.num_slots == 1  # 1 full layer, 5 sliding: groups of 1
    assert kv_bytes_per_block(gemma3, 16, kv_cache_dtype("auto"), model_itemsize=4) == 16 * 4 * 512 * 4
    gemma4 = kv_layout(layer_specs(AutoConfig.for_model("gemma4_text", **GEMMA4_31B).to_dict()))
    fp8 = kv_cache_dtype("fp8")
    scales = max(5 * kv_scale_bytes_per_token_layer(16, fp8), 10 * kv_scale_bytes_per_token_layer(4, fp8))
    assert kv_bytes_per_block(gemma4, 16, fp8) == 16 * (40_960 + scales)
    with pytest.raises(ValueError, match="built from windows alone"):
        kv_layout([None, 8]).bytes_per_block(16, 2)


# ------------------------------------------------------------------------------------------ block manager
def test_a_chunked_sequence_frees_past_chunks_as_it_grows():
    for chunk, bs in ((8, 4), (6, 4), (5, 2)):
        spec = ChunkedLocal(chunk=chunk)
        pool = BlockPool(64)
        manager = BlockManager(pool, bs, (None, spec))
        seq = KVSequence(1)
        for n in range(60):
            manager.append_tokens(seq, [n])
            live = len(seq.block_tables[1]) - seq.num_released[1]
            assert seq.num_released[1] == spec.first_readable(n) // bs  # released before this step
            assert live <= -(-(chunk - 1 + 1) // bs) + 1  # one chunk plus one block
            assert live == blocks_held(n, spec, bs, new_tokens=1)
            assert len(seq.block_tables[0]) == n // bs + 1  # the full group keeps everything
        assert manager.max_blocks_for(60, 1) == 60 // bs + -(-chunk // bs) + 1
        start = spec.first_readable(59)  # the last chunk's first token: rolling back to it is fine, not below
        with pytest.raises(ValueError, match=f"chunked-attention layers \\(chunk {chunk}\\) already released"):
            manager.truncate(seq, 60 - (start - 1))
        manager.truncate(seq, 60 - start)
        manager.free(seq)
        assert pool.num_free_blocks == 64


def test_a_chunked_hit_takes_only_the_current_chunks_blocks():
    pool = BlockPool(40)
    manager = BlockManager(pool, 4, specs=(FullAttention(), ChunkedLocal(chunk=8)))
    a = KVSequence(1)
    manager.append_tokens(a, list(range(20)))
    hashes = list(a.block_hashes)
    manager.free(a)
    prompt = list(range(20)) + [99]
    assert manager.num_cached_prefix_tokens(KVSequence(2), prompt) == 20
    b = KVSequence(3)
    manager.append_cached(b, list(range(20)))
    # the next query (position 20) reads 16..20: the chunked group took block 4 only
    assert b.block_tables[1][:4] == [NULL_BLOCK] * 4 and b.num_released == [0, 4]
    manager.free(b)
    lost = pool.acquire_cached((1, hashes[1]))  # a block of a past chunk: the hit stays whole
    pool.unregister(lost)
    pool.free([lost])
    assert manager.num_cached_prefix_tokens(KVSequence(4), prompt) == 20
    lost = pool.acquire_cached((1, hashes[4]))  # the current chunk's: 16 tokens start a new chunk, need none
    pool.unregister(lost)
    pool.free([lost])
    assert manager.num_cached_prefix_tokens(KVSequence(5), prompt) == 16
    pool.check_invariants()


def test_block_manager_takes_specs_or_the_old_windows():
    pool = BlockPool(4)
    assert BlockManager(pool, 4, (None, 6)).group_specs == (FullAttention(), SlidingWindow(window=6))
    assert BlockManager(pool, 4, windows=(None, 6)).windows == (None, 6)
    assert BlockManager(pool, 4).group_specs == (FullAttention(),)
    with pytest.raises(ValueError, match="chunked_attention group has no sliding window"):
        BlockManager(pool, 4, (ChunkedLocal(chunk=8),)).windows  # noqa: B018
    with pytest.raises(ValueError, match="SharedKV stores no K/V"):
        BlockManager(pool, 4, (SharedKV(source=0),))
    with pytest.raises(TypeError, match="not both"):
        BlockManager(pool, 4, (None,), windows=(None,))


@settings(max_examples=100, deadline=None)
@given(specs=st.sampled_from([(ChunkedLocal(chunk=6),), (None, ChunkedLocal(chunk=5)),
                              (ChunkedLocal(chunk=3), None, SlidingWindow(window=4))]),
       block_size=st.integers(1, 4), data=st.data())
def test_chunked_groups_never_leak_never_free_a_readable_block_and_hit_exactly(specs, block_size, data):
    """Random admissions through the prefix cache, appends, rollbacks of a step's drafts and frees: no
    block leaks, every key a coming query reads is held, and every held slot holds its own prefix."""
    pool = BlockPool(data.draw(st.integers(8, 40)))
    manager = BlockManager(pool, block_size, specs)
    kv: dict[tuple[int, int], tuple] = {}
    seqs: list[KVSequence] = []

    def record(seq, start, result):
        for g, slots in enumerate(result.group_slots):
            for i, slot in enumerate(slots):
                if slot >= 0:
                    kv[slot // block_size, slot % block_size] = (g, tuple(seq.token_ids[: start + i + 1]))

    for step in range(data.draw(st.integers(1, 20))):
        op = data.draw(st.sampled_from(["admit", "append", "free"]))
        live = [s for s in seqs if s.num_tokens]
        try:
            if op == "admit" or not live:
                seq = KVSequence(step)
                prompt = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=24))
                cached = manager.num_cached_prefix_tokens(seq, prompt[:-1])
                if not pool.can_allocate(manager.num_blocks_needed(seq, len(prompt) - cached, cached)):
                    raise NoFreeBlocksError("not admitted now")
                seqs.append(seq)
                if cached:
                    manager.append_cached(seq, prompt[:cached])
                record(seq, cached, manager.append_tokens(seq, prompt[cached:]))
            elif op == "append":
                seq = data.draw(st.sampled_from(live))
                tokens = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=6))
                start = seq.num_tokens
                record(seq, start, manager.append_tokens(seq, tokens))
                for g, spec in enumerate(manager.group_specs):  # during the step: its tokens + reach, + 1 block
                    live = len(seq.block_tables[g]) - seq.num_released[g]
                    assert live <= max_blocks_held(spec, seq.num_tokens, block_size, len(tokens))
                if len(tokens) > 1 and data.draw(st.booleans()):
                    manager.truncate(seq, data.draw(st.integers(1, len(tokens) - 1)))
            else:
                seq = data.draw(st.sampled_from(live))
                manager.free(seq)
                seqs.remove(seq)
        except NoFreeBlocksError:
            pass
        pool.check_invariants()
        refs = [0] * pool.num_blocks
        for seq in seqs:
            for b in seq.live_blocks():
                refs[b] += 1
        assert refs == pool.ref_counts
        for seq in seqs:
            n = seq.num_tokens
            for g, spec in enumerate(manager.group_specs):
                table, released = seq.block_tables[g], seq.num_released[g]
                assert NULL_BLOCK not in table[released:] and len(table) == -(-n // block_size)
                for p in range(spec.first_readable(n, 1) if n else 0, n):  # the next query, or one rolled back
                    assert kv.get((table[p // block_size], p % block_size)) == (g, tuple(seq.token_ids[: p + 1]))
