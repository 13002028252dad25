"""The inputs stock transformers' own generation tests feed `generate`, with "hf_paged" as the
attention: right-padded masks, static caches, `inputs_embeds`, beam search and beam sampling, and
`logits_to_keep`. Each must give stock's output (nothing stock accepts is refused)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_paged  # noqa: F401  (installs the generate patch)
from tiny_models import STOCK_ATTN, VOCAB, cache_of, left_padded_batch, tiny_model, with_cache

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked

ARCHS = ["llama", "qwen2", "mistral", "gemma2"]
LOGITS_ATOL = 1e-4


def _pair(arch):
    """(stock model, the same weights with the hf_paged attention)."""
    return tiny_model(arch, STOCK_ATTN.get(arch, "sdpa")), tiny_model(arch, "hf_paged")


def _right_padded(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0  # torch.tril-style: real tokens, then padding
    mask[2, 11:] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("arch", ARCHS)
def test_right_padded_batch_gives_stocks_output(arch):
    stock, ours = _pair(arch)
    ids, mask = _right_padded()
    gen = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    ref = stock.generate(ids, attention_mask=mask, **gen)
    out = ours.generate(ids, attention_mask=mask, **gen)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(b, a, atol=LOGITS_ATOL, rtol=0)
    cache = cache_of(out)
    assert cache.stores_padding and cache.stats()["num_tokens"] == 3 * (14 + 9)  # padding stored, masked


@pytest.mark.parametrize("arch", ARCHS)
def test_static_cache_runs_stock_attention_with_one_warning(arch):
    stock, ours = _pair(arch)
    ids, mask = left_padded_batch([5, 12, 9])
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    ref = stock.generate(ids, attention_mask=mask, **gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ours.generate(ids, attention_mask=mask, **gen)
    assert torch.equal(out, ref)
    assert ours.config._attn_implementation == "hf_paged"  # restored after the call
    from hf_paged.integrations import generate as patch

    assert any("static (compileable) cache" in m for m in patch._warned[ours])
    assert all("LazyMask" not in str(w.message) for w in caught)


@pytest.mark.parametrize("arch", ARCHS)
def test_inputs_embeds_gives_stocks_output(arch):
    stock, ours = _pair(arch)
    ids, mask = left_padded_batch([6, 11], seed=2)
    embeds = stock.get_input_embeddings()(ids)
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = stock.generate(inputs_embeds=embeds, attention_mask=mask, **gen)
    out = ours.generate(inputs_embeds=embeds, attention_mask=mask, **gen)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search_and_beam_sampling_give_stocks_output(arch):
    stock, ours = _pair(arch)
    ids, mask = left_padded_batch([7, 13], seed=4)
    beams = dict(max_new_tokens=9, num_beams=3, num_return_sequences=2, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, attention_mask=mask, **beams), stock.generate(ids, attention_mask=mask, **beams))
    sampling = dict(max_new_tokens=9, num_beams=2, do_sample=True, top_k=0, pad_token_id=0)
    torch.manual_seed(7)
    ref = stock.generate(ids, attention_mask=mask, **sampling)
    torch.manual_seed(7)
    out = ours.generate(ids, attention_mask=mask, **sampling)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_to_keep_gives_stocks_logits(arch):
    stock, ours = _pair(arch)
    ids, mask = left_padded_batch([9, 4], seed=5)
    with torch.no_grad():
        for keep in (1, 3, 0):
            ref = stock(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
            out = ours(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
            torch.testing.assert_close(out, ref, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_masks_built_outside_generate_are_tensors_the_model_accepts(arch):
    """Code that pre-builds masks through `create_masks_for_generate` (as generate does for static
    caches) gets sdpa's own mask, never a `LazyMask`, and a forward fed that mask gives stock's logits."""
    from transformers import StaticCache
    from transformers.masking_utils import create_masks_for_generate

    stock, ours = _pair(arch)
    ids, mask = left_padded_batch([5, 12, 9], seed=6)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = []
    for model in (stock, ours):
        cache = StaticCache(config=model.config, max_cache_len=32)
        embeds = model.get_input_embeddings()(ids)
        built = create_masks_for_generate(config=model.config, inputs_embeds=embeds, attention_mask=mask,
                                          **with_cache(cache), position_ids=positions)
        masks = built.values() if isinstance(built, dict) else [built]
        assert all(m is None or isinstance(m, torch.Tensor) for m in masks), type(built)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=built, position_ids=positions, use_cache=True,
                        **with_cache(cache))
        logits.append(out.logits)
    torch.testing.assert_close(logits[1], logits[0], atol=LOGITS_ATOL, rtol=0)


def test_the_eager_form_of_an_absent_mask_is_causal_only_for_causal_modules():
    """sdpa's mask is None where nothing needs masking beyond causality (or nothing at all, for a
    non-causal module); the eager path (softcap, sinks, attention weights) must rebuild exactly that."""
    from hf_paged.attention.interface import _additive_mask

    q, k = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 5, 4)
    causal = _additive_mask(None, q, k, None, causal=True)
    assert causal.shape == (1, 1, 3, 5)
    assert bool((causal[0, 0, 0, :3] == 0).all()) and bool((causal[0, 0, 0, 3:] < -1e30).all())
    windowed = _additive_mask(None, q, k, 2, causal=True)
    assert bool((windowed[0, 0, 2, :3] < -1e30).all()) and bool((windowed[0, 0, 2, 3:] == 0).all())
    assert _additive_mask(None, q, k, None, causal=False) is None
    bool_mask = torch.tensor([[[[True, False, True, True, True]]]]).expand(1, 1, 3, 5)
    assert torch.equal(_additive_mask(bool_mask, q, k, None) == 0, bool_mask)


def test_trainer_keywords_labels_and_synced_gpus_are_served_as_stock_serves_them(engine_calls):
    """`Seq2SeqTrainer(predict_with_generate=True)` calls `generate(**batch, synced_gpus=False)` with its
    `labels` in the batch: stock ignores both, so the engine serves the call; `synced_gpus=True`
    (ZeRO-3/FSDP lockstep) goes to stock generate."""
    stock, ours = _pair("llama")
    ids, mask = left_padded_batch([5, 12, 9])
    labels = torch.full((3, 4), -100)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = stock.generate(ids, attention_mask=mask, **gen)
    out = ours.generate(input_ids=ids, attention_mask=mask, labels=labels, synced_gpus=False, **gen)
    assert torch.equal(out, ref) and engine_calls == [True]
    with pytest.raises(ValueError, match="process group") as expected:  # stock: no process group here
        stock.generate(ids, attention_mask=mask, synced_gpus=True, **gen)
    with pytest.raises(ValueError, match="process group") as raised:
        ours.generate(ids, attention_mask=mask, synced_gpus=True, **gen)
    assert str(raised.value) == str(expected.value) and engine_calls == [True, False]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generate_under_bf16_autocast_matches_stock_under_it(arch, engine_calls):
    """TRL and accelerate's mixed precision run generate inside `torch.autocast`: attention then
    returns bf16 for fp32 queries, and the engine's output buffer must take that dtype."""
    stock, ours = _pair(arch)
    ids, mask = left_padded_batch([5, 12, 9])
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = stock.generate(ids, attention_mask=mask, **gen)
        out = ours.generate(ids, attention_mask=mask, **gen)
    assert engine_calls == [True]
    first_ref, first_out = ref.logits[0].float(), out.logits[0].float()
    torch.testing.assert_close(first_out, first_ref, atol=0.05, rtol=0.05)  # bf16 rounding
    agree = (out.sequences == ref.sequences).all(dim=1)
    assert agree.float().mean() >= 2 / 3, (out.sequences, ref.sequences)
