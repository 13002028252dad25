"""The cache the drop-in `generate` returns (`return_dict_in_generate=True`): a `ReturnedCache` that
continues in the engine from each row's kept K/V when passed back, computing only the new tokens,
and otherwise behaves as the `DynamicCache` stock returns. Every continuation is checked against
stock continuing from its own cache."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import hf_paged
from hf_paged.integrations.returned_cache import ReturnedCache
from tiny_models import STOCK_ATTN, cache_of, left_padded_batch, tiny_model, with_cache

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked

GEN = dict(do_sample=False, pad_token_id=0, return_dict_in_generate=True)


def _extend(out, mask, new_tokens: torch.Tensor):
    """The next turn's inputs: every column so far, then `new_tokens` ([rows, k]), mask extended by ones."""
    ids = torch.cat([out.sequences, new_tokens], dim=1)
    mask = torch.cat([mask, mask.new_ones(mask.shape[0], ids.shape[1] - mask.shape[1])], dim=1)
    return ids, mask


def _turns(model, ids, mask, news, **gen):
    """Generate, then continue from the returned cache once per entry of `news`; returns the outputs."""
    outs, cache = [], None
    for new in [None, *news]:
        if new is not None:
            ids, mask = _extend(outs[-1], mask, new)
        out = model.generate(ids, attention_mask=mask, **GEN, **gen, **(with_cache(cache) if cache is not None else {}))
        assert cache_of(out).get_seq_length() == out.sequences.shape[1] - 1
        outs.append(out)
        cache = cache_of(out)
    return outs


def _news(rows, width=4, turns=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (rows, width), generator=g) for _ in range(turns)]


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mistral"])
def test_continuing_from_the_returned_cache_equals_stock_and_reuses_the_kv(arch, engine_calls):
    ids, mask = left_padded_batch([5, 11, 8], seed=3)
    model = tiny_model(arch, STOCK_ATTN.get(arch, "sdpa"))
    probe = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    eos = int(probe[0, ids.shape[1] + 2])  # row 0 (at least) ends early: stock keeps feeding it pads
    gen = dict(max_new_tokens=7, eos_token_id=eos)
    news = _news(3)
    ref = _turns(model, ids, mask, news, **gen)
    model.set_attn_implementation("hf_paged")
    forwarded = []
    outs = []
    cache = None
    cur_ids, cur_mask = ids, mask
    for t, new in enumerate([None, *news]):
        if new is not None:
            cur_ids, cur_mask = _extend(outs[-1], cur_mask, new)
        out = model.generate(cur_ids, attention_mask=cur_mask, **GEN, **gen, **(with_cache(cache) if cache else {}))
        forwarded.append(model.hf_paged_last_metrics["num_forward_tokens"])
        # updated in place
        assert isinstance(cache_of(out), ReturnedCache) and (cache is None or cache_of(out) is cache)
        assert cache_of(out).get_seq_length() == out.sequences.shape[1] - 1  # stock's: every column fed so far
        outs.append(out)
        cache = cache_of(out)
    assert engine_calls == [True] * 3
    for a, b in zip(ref, outs):
        assert torch.equal(a.sequences, b.sequences)
    # Turn 2 computes, per row, its real columns after the last token the engine fed it (a finished row's
    # end token and the pads stock fed and attends after it, then the new tokens), then its decodes.
    fed_before = mask.sum(1) + torch.tensor(_generated(outs[0], ids.shape[1], eos)) - 1
    width = outs[0].sequences.shape[1] + news[0].shape[1]
    prompt_tokens = int((cur_mask_at(mask, width).sum(1) - fed_before).sum())
    decodes = sum(g - 1 for g in _generated(outs[1], width, eos))
    assert forwarded[1] == prompt_tokens + decodes, (forwarded, prompt_tokens, decodes)
    assert prompt_tokens < 3 * news[0].shape[1] + 3 * gen["max_new_tokens"]  # nothing of turn 1's prompts


def cur_mask_at(mask, width):
    return torch.cat([mask, mask.new_ones(mask.shape[0], width - mask.shape[1])], dim=1)


def _generated(out, width, eos):
    """Each row's generated length, up to and including its end token."""
    rows = out.sequences[:, width:].tolist()
    return [row.index(eos) + 1 if eos in row else len(row) for row in rows]


def test_a_three_turn_chat_on_smollm2_equals_stock_and_computes_only_the_new_tokens(engine_calls):
    pytest.importorskip("gguf")
    from hf_paged.defaults.models import load_default

    model, tokenizer = load_default()
    turns = ["Name a colour of the sky.", "And the colour of grass?", "Say goodbye in French."]

    def chat(m):
        ids = None
        outs, computed, cache = [], [], None
        for text in turns:
            user = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)["input_ids"]
            ids = user if ids is None else torch.cat([outs[-1].sequences, user], dim=1)
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                             return_dict_in_generate=True, **(with_cache(cache) if cache is not None else {}))
            outs.append(out)
            cache = cache_of(out)
            computed.append((ids.shape[1], getattr(m, "hf_paged_last_metrics", {}).get("num_forward_tokens")))
        return outs, computed

    ref, _ = chat(model)
    model.set_attn_implementation("hf_paged")
    try:
        outs, computed = chat(model)
    finally:
        model.set_attn_implementation("sdpa")
    assert engine_calls == [True] * 3
    for a, b in zip(ref, outs):
        assert torch.equal(a.sequences, b.sequences)
    for t in (1, 2):  # the new user turn plus the previous reply's last token, then one token per decode
        width, forwarded = computed[t]
        prompt_new = width - (outs[t - 1].sequences.shape[1] - 1)  # the columns stock's cache lacks too
        generated = outs[t].sequences.shape[1] - width
        assert forwarded == prompt_new + generated - 1, (t, computed)


def test_crop_select_and_repeat_act_on_the_kept_rows_as_on_stocks_cache():
    ids, mask = left_padded_batch([6, 10], seed=5)
    model = tiny_model("llama")
    new = _news(2, turns=1)[0]

    def run(m):
        out = m.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
        cache = cache_of(out)
        cache.crop(-2)  # forget the last two columns: they are recomputed from the ids
        nxt_ids, nxt_mask = _extend(out, mask, new)
        cont = m.generate(nxt_ids, attention_mask=nxt_mask, max_new_tokens=4, **with_cache(cache), **GEN)
        cache_of(cont).batch_select_indices(torch.tensor([1, 1, 0]))  # rows repeated: shared copy-on-write
        ids3, mask3 = _extend(cont, nxt_mask, torch.full((2, 2), 7))
        ids3, mask3 = ids3[[1, 1, 0]], mask3[[1, 1, 0]]
        return cont, m.generate(ids3, attention_mask=mask3, max_new_tokens=4, **with_cache(cache_of(cont)), **GEN)

    ref = run(model)
    model.set_attn_implementation("hf_paged")
    ours = run(model)
    assert isinstance(cache_of(ours[1]), ReturnedCache) and not cache_of(ours[1]).is_dense
    for a, b in zip(ref, ours):
        assert torch.equal(a.sequences, b.sequences)
    assert cache_of(ours[1]).get_seq_length() == cache_of(ref[1]).get_seq_length()


class _Halve(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores / 2


def test_anything_else_turns_it_into_stocks_dense_cache():
    """A call only stock serves continuing from it, a forward fed it, inputs that rewrite its columns: stock semantics, via the
    dense `DynamicCache` it becomes (its K/V filled by one forward over its columns)."""
    ids, mask = left_padded_batch([7, 4], seed=9)
    model = tiny_model("llama")
    new = _news(2, turns=1)[0]

    def run(m):
        out = m.generate(ids, attention_mask=mask, max_new_tokens=5, **GEN)
        custom_ids, custom_mask = _extend(out, mask, new)
        custom = m.generate(custom_ids, attention_mask=custom_mask, max_new_tokens=4, **with_cache(cache_of(out)),
                            **GEN, logits_processor=LogitsProcessorList([_Halve()]))  # a processor: run in lockstep
        out2 = m.generate(ids, attention_mask=mask, max_new_tokens=5, **GEN)
        with torch.no_grad():
            step = m(input_ids=new[:, :1], attention_mask=torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], 1),
                     **with_cache(cache_of(out2)), use_cache=True).logits
        other = out2.sequences.clone()
        other[:, -3] = 5  # a column the cache holds, rewritten: stock reads the cached K/V regardless
        out3 = m.generate(ids, attention_mask=mask, max_new_tokens=5, **GEN)
        o_ids, o_mask = _extend(type(out3)(sequences=other), mask, new)
        stale = m.generate(o_ids, attention_mask=o_mask, max_new_tokens=4, **with_cache(cache_of(out3)), **GEN)
        return custom.sequences, step, stale.sequences, cache_of(out3)

    ref = run(model)
    model.set_attn_implementation("hf_paged")
    ours = run(model)
    assert torch.equal(ours[0], ref[0])
    torch.testing.assert_close(ours[1], ref[1], atol=1e-4, rtol=0)
    assert torch.equal(ours[2], ref[2])
    assert isinstance(ours[3], DynamicCache) and ours[3].is_dense


def test_kept_blocks_are_freed_when_the_cache_goes():
    ids, mask = left_padded_batch([9, 13], seed=2)
    model = tiny_model("llama", "hf_paged")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GEN)
    engine = model._hf_paged_engine.engine
    assert engine.cache.pool.num_used_blocks > 0  # the two rows' blocks, kept
    del out
    gc.collect()
    engine.drop_unclaimed_kv()
    assert engine.cache.pool.num_used_blocks == 0 and engine.kv.num_kept == 0
    assert hf_paged.release(model) is True and hf_paged.release(tiny_model("llama")) is False


def test_a_fixed_pool_evicts_kept_rows_for_new_requests_and_continuing_recomputes_them():
    from hf_paged import PagedCacheConfig

    ids, mask = left_padded_batch([30, 26], seed=4)
    other_ids, other_mask = left_padded_batch([31, 29], seed=5)
    model = tiny_model("llama")
    model.hf_paged_cache_config = PagedCacheConfig(num_blocks=12, block_size=8)  # room for one call's rows
    new = _news(2, turns=1)[0]

    def run(m):
        first = m.generate(ids, attention_mask=mask, max_new_tokens=8, **GEN)
        other = m.generate(other_ids, attention_mask=other_mask, max_new_tokens=8, **GEN)  # needs the room
        c_ids, c_mask = _extend(first, mask, new)
        return other, m.generate(c_ids, attention_mask=c_mask, max_new_tokens=4, **with_cache(cache_of(first)), **GEN)

    ref = run(model)
    model.set_attn_implementation("hf_paged")
    ours = run(model)
    assert all(torch.equal(a.sequences, b.sequences) for a, b in zip(ref, ours))
    assert isinstance(cache_of(ours[1]), ReturnedCache)


def test_sampled_rows_and_rows_stopped_by_criteria_continue_from_what_they_kept(engine_calls):
    """`num_return_sequences` rows (each sample's own K/V) and rows a stop string cut short (the K/V
    the engine computed past the stop dropped): continuing gives stock's greedy continuation of the
    same sequences."""
    ids, mask = left_padded_batch([6, 10], seed=8)
    model = tiny_model("llama", "hf_paged")
    new = _news(4, turns=1)[0]
    sampled = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=2,
                             pad_token_id=0, return_dict_in_generate=True)
    assert cache_of(sampled).get_seq_length() == sampled.sequences.shape[1] - 1
    mask2 = mask.repeat_interleave(2, dim=0)
    c_ids, c_mask = _extend(sampled, mask2, new)
    ours = model.generate(c_ids, attention_mask=c_mask, max_new_tokens=5, **with_cache(cache_of(sampled)), **GEN)
    probe = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    stop = int(probe[1, ids.shape[1] + 2])

    class StopAt:  # stops a row once it emits `stop` (row 1 at its third token): stock pads it after
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop

    from transformers import StoppingCriteriaList

    cut = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=1, **GEN,
                         stopping_criteria=StoppingCriteriaList([StopAt()]))
    c2_ids, c2_mask = _extend(cut, mask, new[:2])
    ours2 = model.generate(c2_ids, attention_mask=c2_mask, max_new_tokens=5, **with_cache(cache_of(cut)), **GEN)
    assert engine_calls == [True] * 5
    model.set_attn_implementation("sdpa")
    ref = model.generate(c_ids, attention_mask=c_mask, max_new_tokens=5, **GEN)  # every column recomputed
    ref2 = model.generate(c2_ids, attention_mask=c2_mask, max_new_tokens=5, **GEN)
    assert torch.equal(ours.sequences, ref.sequences) and torch.equal(ours2.sequences, ref2.sequences)


def test_a_deep_copy_continues_on_its_own_and_frees_only_its_own_rows():
    """transformers' prompt-reuse recipe: one cache deep-copied per continuation."""
    import copy

    ids, mask = left_padded_batch([7, 12], seed=11)
    model = tiny_model("llama")
    news = _news(2, turns=2, seed=3)

    def run(m):
        out = m.generate(ids, attention_mask=mask, max_new_tokens=5, **GEN)
        results = []
        for new in news:
            c_ids, c_mask = _extend(out, mask, new)
            copied = with_cache(copy.deepcopy(cache_of(out)))
            results.append(m.generate(c_ids, attention_mask=c_mask, max_new_tokens=4, **copied,
                                      **GEN).sequences)
        return results, out

    ref, _ = run(model)
    model.set_attn_implementation("hf_paged")
    ours, out = run(model)
    assert all(torch.equal(a, b) for a, b in zip(ref, ours))
    engine = model._hf_paged_engine.engine
    held = [s for s in cache_of(out)._kept.seqs if s is not None]
    assert held and all(engine.holds(s) for s in held)  # the original kept its rows through both copies
    mask_rows = cache_of(out)
    mask_rows.batch_select_indices(torch.tensor([False, True]))  # a row mask keeps row 1 only
    assert mask_rows.batch_size == 1 and mask_rows._kept.seqs[0] is held[1]
    del out, mask_rows
    gc.collect()
    engine.drop_unclaimed_kv()
    assert engine.cache.pool.num_used_blocks == 0  # every copy and the original freed their blocks


def test_release_during_a_call_never_waits_and_takes_effect_after_it():
    from hf_paged.integrations.batch_generate import model_engine

    model = tiny_model("llama", "hf_paged")
    ids, mask = left_padded_batch([5], seed=1)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    slot = model._hf_paged_engine
    kwargs = dict(max_num_seqs=1, block_size=16, num_blocks=None, max_kv_bytes=None, kv_cache_dtype="auto",
                  kv_quant_scheme="dynamic", kv_quant_rotation=True, enable_prefix_caching=True,
                  enable_hybrid_kv=True, cache_salt=None, max_model_len=64)
    with model_engine(model, kwargs, {}, [2]):
        assert hf_paged.release(model) is True  # the lock is held here: it must not wait for it
        assert slot.engine is not None
    assert slot.engine is None and not slot.release_pending
