"""Drop-in `generate` with `output_scores` / `output_logits` and `num_return_sequences`, against stock.

Stock is the same weights with sdpa (eager where sdpa lacks softcap/sinks) and `DynamicCache`. A
left-padded batch whose rows end at different steps checks the subtle part: stock keeps feeding a
finished row pad tokens and reports its scores and logits at every later step; the drop-in route
computes those steps afterwards (a teacher-forced forward, stock's processors). Greedy runs must give
stock's sequences exactly and every scores/logits tensor within fp32 tolerance (different kernels)
with the same -inf entries. Sampled runs draw other tokens than stock, so their scores are checked
against stock's processors applied to stock's model teacher-forced on *our* sequences: the scores
are the distributions our tokens were drawn from, as stock defines them.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.transformers_api import stock_penalty_skips_padding
from stats import chi2_critical, chi2_statistic
from tiny_models import STOCK_ATTN, VOCAB, left_padded_batch, tiny_model

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked

ATOL = 1e-4  # fp32 end to end: only kernels and summation order differ
LENGTHS = [3, 7, 5]  # row 0 has 4 pads, row 2 has 2
NEW_TOKENS = 12
PAD = 0


@functools.lru_cache(maxsize=None)
def models(arch: str):
    """(stock, paged): the same weights, stock attention and "hf_paged"."""
    return tiny_model(arch, STOCK_ATTN.get(arch, "sdpa")), tiny_model(arch, "hf_paged")


def _generate(model, input_ids, attention_mask, **kwargs):
    kwargs = {"max_new_tokens": NEW_TOKENS, "pad_token_id": PAD, **kwargs}
    return model.generate(input_ids, attention_mask=attention_mask, **kwargs)


def _early_eos(stock, input_ids, attention_mask, **kwargs) -> list[int]:
    """End-of-sequence ids that end row 0 within 3 tokens and row 2 within 6 (stock's own greedy
    tokens under `kwargs`), so the batch has rows finishing at different steps."""
    seq = _generate(stock, input_ids, attention_mask, eos_token_id=None, **kwargs)
    gen = seq[:, input_ids.shape[1]:]
    return sorted({int(gen[0, 2]), int(gen[2, 5])})


def _lengths(sequences: torch.Tensor, width: int, eos_ids: list[int]) -> list[int]:
    """Tokens each row generated, its end-of-sequence token included."""
    out = []
    for row in sequences[:, width:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos_ids]
        out.append(ends[0] + 1 if ends else len(row))
    return out


def assert_same_outputs(ref, out, width: int):
    assert torch.equal(out.sequences, ref.sequences)
    steps = ref.sequences.shape[1] - width
    for name in ("scores", "logits"):
        a, b = getattr(ref, name), getattr(out, name)
        if a is None:
            assert b is None, name
            continue
        assert isinstance(b, tuple) and len(a) == len(b) == steps, name
        for t, (x, y) in enumerate(zip(a, b)):
            assert y.dtype == x.dtype == torch.float32 and y.shape == x.shape, (name, t)
            assert torch.equal(x == float("-inf"), y == float("-inf")), f"{name} step {t}: -inf entries differ"
            keep = torch.isfinite(x)
            torch.testing.assert_close(y[keep], x[keep], atol=ATOL, rtol=0, msg=lambda m: f"{name} step {t}: {m}")


# ------------------------------------------------------------------------------ greedy scores
@pytest.mark.parametrize("arch, pad_is_eos", [("llama", False), ("llama", True), ("mistral", False),
                                             ("gemma2", False)])
def test_greedy_scores_and_logits_match_stock_when_rows_finish_early(arch, pad_is_eos, engine_calls):
    stock, paged = models(arch)
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=3)
    eos = _early_eos(stock, input_ids, attention_mask, do_sample=False)
    kwargs = dict(do_sample=False, eos_token_id=eos, output_scores=True, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=eos[0] if pad_is_eos else PAD)
    ref = _generate(stock, input_ids, attention_mask, **kwargs)
    out = _generate(paged, input_ids, attention_mask, **kwargs)
    assert engine_calls == [True]
    width = input_ids.shape[1]
    lengths = _lengths(ref.sequences, width, eos)
    assert min(lengths) < len(ref.scores) == max(lengths), f"no row finished early: {lengths}"
    assert_same_outputs(ref, out, width)


@pytest.mark.parametrize("arch, ngram", [("llama", 2), ("qwen3", 3)])
def test_greedy_scores_with_penalty_and_ngram_bans_match_stock(arch, ngram, engine_calls):
    """Stock's repetition penalty skips the left padding, its n-gram ban does not: after a row's end
    its n-grams run over the pads fed since, and over the left padding too."""
    stock, paged = models(arch)
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=3)
    settings = dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=ngram)
    eos = _early_eos(stock, input_ids, attention_mask, **settings)
    kwargs = dict(settings, eos_token_id=eos, output_scores=True, output_logits=True, return_dict_in_generate=True)
    ref = _generate(stock, input_ids, attention_mask, **kwargs)
    out = _generate(paged, input_ids, attention_mask, **kwargs)
    # Before 5.23 stock's penalty counts the padding as seen tokens, which the engine cannot mirror: stock serves it.
    assert engine_calls == [stock_penalty_skips_padding()]
    width = input_ids.shape[1]
    lengths = _lengths(ref.sequences, width, eos)
    assert lengths[0] < len(ref.scores), f"the most padded row did not finish early: {lengths}"
    assert_same_outputs(ref, out, width)


# ------------------------------------------------------------------------------ sampled scores
def _stock_scores_on(stock, sequences, attention_mask, width, processors) -> list[torch.Tensor]:
    """Stock's processed scores at every generated step of `sequences`: stock's model teacher-forced
    on them (stock's mask and positions: prompt mask then ones), stock's processors per step."""
    steps = sequences.shape[1] - width
    mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], steps - 1)], dim=1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        logits = stock(input_ids=sequences[:, :-1], attention_mask=mask, position_ids=positions).logits.float()
    return [processors(sequences[:, : width + t], logits[:, width + t - 1].clone()) for t in range(steps)]


# Warpers; a bias on eos that ends rows at different steps (for torch.manual_seed(0)); samples per prompt.
SAMPLING = {
    "top_k_top_p_min_p": (dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05), 1.0, 1),
    "top_p_whole_vocab": (dict(temperature=1.2, top_k=0, top_p=0.8), 2.0, 1),
    "three_samples_ngram": (dict(temperature=1.0, top_k=30, no_repeat_ngram_size=2), 1.5, 3),
}


@pytest.mark.parametrize("case", sorted(SAMPLING))
def test_sampled_scores_are_stocks_distribution_of_our_tokens(case, engine_calls):
    stock, paged = models("llama")
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=3)
    settings, bias, k = SAMPLING[case]
    eos, min_new, penalty = 2, 2, 1.2
    torch.manual_seed(0)
    out = _generate(paged, input_ids, attention_mask, do_sample=True, eos_token_id=eos, sequence_bias={(eos,): bias},
                    min_new_tokens=min_new, repetition_penalty=penalty, num_return_sequences=k, output_scores=True,
                    return_dict_in_generate=True, **settings)
    if not stock_penalty_skips_padding():  # stock penalises the padding (before 5.23): stock served the call
        assert engine_calls == [False]
        return
    assert engine_calls == [True] and out.logits is None
    width = input_ids.shape[1]
    lengths = _lengths(out.sequences, width, [eos])
    assert min(lengths) < len(out.scores), f"no row finished early: {lengths}"
    mask = attention_mask.repeat_interleave(k, dim=0)
    ngram = settings.get("no_repeat_ngram_size")
    processors = LogitsProcessorList([
        SequenceBiasLogitsProcessor({(eos,): bias}),
        RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=(mask == 0).sum(1)),
        *([NoRepeatNGramLogitsProcessor(ngram)] if ngram else []),
        MinNewTokensLengthLogitsProcessor(width, min_new, eos),
        *([TemperatureLogitsWarper(settings["temperature"])] if settings["temperature"] != 1.0 else []),
        *([TopKLogitsWarper(settings["top_k"])] if settings["top_k"] else []),
        *([TopPLogitsWarper(settings["top_p"])] if "top_p" in settings else []),
        *([MinPLogitsWarper(settings["min_p"])] if "min_p" in settings else []),
    ])
    expected = _stock_scores_on(stock, out.sequences, mask, width, processors)
    assert len(out.scores) == len(expected)
    for t, (x, y) in enumerate(zip(expected, out.scores)):
        assert torch.equal(x == float("-inf"), y == float("-inf")), f"step {t}: kept tokens differ"
        keep = torch.isfinite(x)
        torch.testing.assert_close(y[keep], x[keep], atol=ATOL, rtol=0, msg=lambda m: f"step {t}: {m}")
        for row, n in enumerate(lengths):  # each token was drawn from a distribution that keeps it
            if t < n:
                assert torch.isfinite(y[row, out.sequences[row, width + t]]), (t, row)
    assert any(bool((s > float("-inf")).sum(-1).max() > 1) for s in out.scores)  # real distributions


# ------------------------------------------------------------------------------ num_return_sequences
def test_num_return_sequences_samples_each_prompt_after_one_prefill(engine_calls):
    _, paged = models("llama")
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=3)
    k, width = 3, input_ids.shape[1]
    if hasattr(paged, "hf_paged_last_metrics"):
        del paged.hf_paged_last_metrics
    torch.manual_seed(0)
    out = _generate(paged, input_ids, attention_mask, do_sample=True, num_return_sequences=k, eos_token_id=None,
                    output_scores=True, return_dict_in_generate=True)
    assert engine_calls == [True]
    seq = out.sequences
    assert seq.shape == (len(LENGTHS) * k, width + NEW_TOKENS)
    assert torch.equal(seq[:, :width], input_ids.repeat_interleave(k, dim=0))  # prompt i at rows i*k .. i*k+k-1
    for i in range(len(LENGTHS)):
        rows = [tuple(r) for r in seq[i * k:(i + 1) * k, width:].tolist()]
        assert len(set(rows)) == k, f"prompt {i}: samples repeat each other"
    assert len(out.scores) == NEW_TOKENS and all(s.shape == (len(LENGTHS) * k, VOCAB) for s in out.scores)
    for t, s in enumerate(out.scores):
        assert torch.isfinite(s.gather(1, seq[:, width + t, None])).all()
    metrics = paged.hf_paged_last_metrics
    # Every prompt prefilled once, then one token per sample per step (the last token is never fed).
    assert metrics["vllm:prompt_tokens"] == sum(LENGTHS)
    assert metrics["num_forward_tokens"] == sum(LENGTHS) + len(LENGTHS) * k * (NEW_TOKENS - 1)


def test_num_return_sequences_first_tokens_follow_stocks_distribution(engine_calls):
    """5,000 samples (25 copies of a prompt x 200 samples): their first tokens, forked off shared
    prefills, are independent draws from stock's processed distribution (Pearson's chi-square at
    significance 0.001)."""
    stock, paged = models("llama")
    prompt, settings = [5, 9, 5, 9, 17, 5, 33], dict(do_sample=True, top_k=30, temperature=0.7)
    ids = torch.tensor([prompt])
    probs = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, output_scores=True,
                           return_dict_in_generate=True, **settings).scores[0][0].softmax(-1)
    ids = torch.tensor([prompt] * 25)
    torch.manual_seed(0)
    out = paged.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, num_return_sequences=200,
                         **settings)
    assert engine_calls == [True] and out.shape == (5000, len(prompt) + 1)
    counts = torch.bincount(out[:, len(prompt)], minlength=VOCAB)
    assert int(counts[probs == 0].sum()) == 0
    stat, df = chi2_statistic(counts, probs)
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df} critical={chi2_critical(df):.1f}"


def _error_of(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def test_num_return_sequences_stock_rejects_is_rejected_the_same_way(engine_calls):
    """Stock refuses greedy `num_return_sequences > 1` and assisted generation with it; the drop-in
    route leaves both to stock, which raises its own error."""
    stock, paged = models("llama")
    draft = tiny_model("llama", "sdpa", seed=1)
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=3)
    for kwargs in (dict(do_sample=False, num_return_sequences=2),
                   dict(do_sample=True, num_return_sequences=2, prompt_lookup_num_tokens=3),
                   dict(do_sample=True, num_return_sequences=2, assistant_model=draft)):
        expected = _error_of(lambda: _generate(stock, input_ids, attention_mask, **kwargs))
        engine_calls.clear()
        assert _error_of(lambda: _generate(paged, input_ids, attention_mask, **kwargs)) == expected
        assert engine_calls == [False], kwargs


# ------------------------------------------------------------------------------ newly honoured fields
def test_min_p_bad_words_and_single_token_sequence_bias_greedy_parity(engine_calls):
    stock, paged = models("llama")
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=3)
    width = input_ids.shape[1]
    base = _generate(stock, input_ids, attention_mask, do_sample=False)
    gen = base[:, width:].tolist()
    # Ban a token each row would produce, and a pair that occurs; push one token down, another up.
    bad = [[gen[0][1]], [gen[1][2], gen[1][3]]]
    bias = {(gen[2][1],): -4.0, (gen[0][4],): 2.5}
    for kwargs in (dict(min_p=0.2), dict(bad_words_ids=bad), dict(sequence_bias=bias),
                   dict(bad_words_ids=bad, sequence_bias=bias, min_p=0.1, output_scores=True,
                        return_dict_in_generate=True)):
        engine_calls.clear()
        ref = _generate(stock, input_ids, attention_mask, do_sample=False, **kwargs)
        out = _generate(paged, input_ids, attention_mask, do_sample=False, **kwargs)
        assert engine_calls == [True], kwargs
        if torch.is_tensor(ref):
            assert torch.equal(out, ref), kwargs
        else:
            assert_same_outputs(ref, out, width)
    assert not torch.equal(_generate(stock, input_ids, attention_mask, bad_words_ids=bad), base)


def test_multi_token_sequence_bias_is_served_by_stock(engine_calls):
    stock, paged = models("llama")
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=3)
    gen = _generate(stock, input_ids, attention_mask, do_sample=False)[:, input_ids.shape[1]:].tolist()
    kwargs = dict(do_sample=False, sequence_bias={(gen[0][0], gen[0][1]): -5.0, (7,): 1.0})
    ref = _generate(stock, input_ids, attention_mask, **kwargs)
    out = _generate(paged, input_ids, attention_mask, **kwargs)
    assert engine_calls == [False] and torch.equal(out, ref)


def test_processors_that_see_the_left_padding_are_left_to_stock(engine_calls):
    """Stock's n-gram ban and multi-token bad words read the padded `input_ids`: where the padding
    could change what they ban (see `_padding_visible_to_processors`), stock serves the call."""
    stock, paged = models("llama")
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=3)
    with_pad = input_ids.clone()
    with_pad[1, 3] = PAD  # a real prompt token equal to the pad id (row 1 is not padded)
    with_pad[2, 4] = PAD  # and one in a padded row
    cases = [
        (input_ids, dict(no_repeat_ngram_size=1)),  # bans the pad id from the first step in stock
        (input_ids, dict(bad_words_ids=[[PAD, 5], [9]])),  # a word whose prefix can match the padding
        (with_pad, dict(no_repeat_ngram_size=2)),  # n-grams starting in the padding can match
    ]
    for ids, kwargs in cases:
        engine_calls.clear()
        ref = _generate(stock, ids, attention_mask, do_sample=False, **kwargs)
        out = _generate(paged, ids, attention_mask, do_sample=False, **kwargs)
        assert engine_calls == [False] and torch.equal(out, ref), kwargs
    full = torch.ones_like(input_ids)  # no padding: nothing for the processors to see
    for kwargs in (dict(no_repeat_ngram_size=1), dict(bad_words_ids=[[PAD, 5], [9]])):
        engine_calls.clear()
        ref = _generate(stock, input_ids, full, do_sample=False, **kwargs)
        assert torch.equal(_generate(paged, input_ids, full, do_sample=False, **kwargs), ref)
        assert engine_calls == [True], kwargs


def test_a_penalty_over_padded_rows_runs_stock_where_stock_penalises_the_padding(engine_calls, monkeypatch):
    """Before transformers 5.23 stock's repetition penalty counts a row's left padding as seen tokens:
    the engine never sees the padding, so such a call runs stock generate (an unpadded one still does not)."""
    import hf_paged.integrations.routing as routing

    monkeypatch.setattr(routing, "stock_penalty_skips_padding", lambda: False)
    stock, paged = models("llama")
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=3)
    kwargs = dict(do_sample=False, repetition_penalty=1.3)
    assert torch.equal(_generate(paged, input_ids, attention_mask, **kwargs),
                       _generate(stock, input_ids, attention_mask, **kwargs))
    full = attention_mask.all(dim=1)
    _generate(paged, input_ids[full], attention_mask[full], **kwargs)
    assert engine_calls == [False, True]
