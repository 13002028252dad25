"""Drop-in sampling honours the merged generation config exactly: transformers' defaults
(`top_k=50`), the model's generation config, the pipeline's defaults and explicit settings.

Each case draws the first sampled token of 5,000 identical rows through the engine route of
`model.generate` (a spy checks the engine served it) and compares the counts with stock's own
processed distribution (`output_scores` of stock `generate`, softmaxed) by Pearson's chi-square at
significance 0.001. A deliberately wrong `top_k` must fail the same test. Field-by-field mapping and
fallback reasons are checked on their own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, AutoModelForCausalLM

import hf_paged.integrations.batch_generate as batch_generate
from hf_paged.integrations.generation_config import merged_generation_config, sampling_params_from
from hf_paged.sampling_params import SAMPLING_EPS
from stats import chi2_critical, chi2_statistic
from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked

NUM_DRAWS = 5000
PROMPT = [5, 9, 5, 9, 17, 5, 33]  # repeats, so a repetition penalty changes the distribution


def stock_distribution(model, prompt, **kwargs) -> torch.Tensor:
    """Stock's processed next-token distribution for `prompt` (the scores stock samples from)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, output_scores=True,
                         return_dict_in_generate=True, **kwargs)
    return out.scores[0][0].float().softmax(-1)


def engine_draws(model, prompt, engine_calls, **kwargs) -> torch.Tensor:
    """Counts of the first token sampled by the engine route for NUM_DRAWS copies of `prompt`."""
    ids = torch.tensor([prompt] * NUM_DRAWS)
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, **kwargs)
    assert engine_calls and engine_calls[-1], "the engine did not serve this call"
    return torch.bincount(out[:, len(prompt)], minlength=model.config.vocab_size)


def assert_same_distribution(counts: torch.Tensor, probs: torch.Tensor):
    outside = int(counts[probs == 0].sum())
    assert outside == 0, f"{outside} draws outside stock's support"
    stat, df = chi2_statistic(counts, probs)
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df} critical={chi2_critical(df):.1f}"


def assert_different_distribution(counts: torch.Tensor, probs: torch.Tensor):
    outside = int(counts[probs == 0].sum())
    stat, df = chi2_statistic(counts, probs)
    assert outside > 0 or stat > chi2_critical(df), "the test cannot tell this distribution apart"


CASES = {
    "model_defaults": dict(do_sample=True),  # transformers' top_k=50, temperature 1
    "top_k": dict(do_sample=True, top_k=20),
    "top_p": dict(do_sample=True, top_p=0.8),
    "temperature": dict(do_sample=True, temperature=0.6),
    "repetition_penalty": dict(do_sample=True, repetition_penalty=1.8, temperature=0.5),
    "all_together": dict(do_sample=True, top_k=30, top_p=0.9, temperature=0.7, repetition_penalty=1.3),
    "min_p": dict(do_sample=True, top_k=0, min_p=0.05, temperature=1.3),
    "bias_and_bans": dict(do_sample=True, top_k=40, sequence_bias={(5,): 2.0, (33,): -1.0},
                          bad_words_ids=[[9], [33, 40]]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_sampled_token_follows_stock_processed_distribution(case, engine_calls):
    kwargs = CASES[case]
    probs = stock_distribution(tiny_model("llama", "sdpa"), PROMPT, **kwargs)
    counts = engine_draws(tiny_model("llama", "hf_paged"), PROMPT, engine_calls, **kwargs)
    assert_same_distribution(counts, probs)


def test_a_wrong_top_k_fails_the_same_test(engine_calls):
    """The reported bug: sampling from the whole vocabulary where stock keeps the top 50."""
    probs = stock_distribution(tiny_model("llama", "sdpa"), PROMPT, do_sample=True)
    assert (probs > 0).sum() == 50  # the default top_k really is in force on the stock side
    for wrong_k in (0, 40):
        counts = engine_draws(tiny_model("llama", "hf_paged"), PROMPT, engine_calls, do_sample=True, top_k=wrong_k)
        assert_different_distribution(counts, probs)


def test_the_models_own_generation_config_is_honoured(engine_calls):
    stock, paged = tiny_model("llama", "sdpa"), tiny_model("llama", "hf_paged")
    for model in (stock, paged):
        model.generation_config = GenerationConfig(do_sample=True, temperature=0.8, top_p=0.85, top_k=100,
                                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    assert_same_distribution(engine_draws(paged, PROMPT, engine_calls), stock_distribution(stock, PROMPT))


def test_pipeline_defaults_reach_the_engine_and_sample_like_stock(monkeypatch, engine_calls):
    """`pipeline("text-generation")` adds do_sample=True, temperature=0.7 and max_new_tokens=256 to
    transformers' defaults. Its call is served by the engine; the same generate arguments then give
    stock's distribution."""
    from transformers import pipeline

    from hf_paged.defaults.models import load_default_tokenizer

    tokenizer = load_default_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="hf_paged").eval()
    stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    stock.load_state_dict(paged.state_dict())
    seen = []
    original = batch_generate.try_engine_generate

    def record(model, inputs, generation_config, kwargs):
        seen.append({k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")})
        return original(model, inputs, generation_config, kwargs)

    monkeypatch.setattr(batch_generate, "try_engine_generate", record)
    pipe = pipeline("text-generation", model=paged, tokenizer=tokenizer)
    text = pipe("Hello, my name is", max_new_tokens=3)[0]["generated_text"]
    assert text.startswith("Hello, my name is") and seen
    generate_kwargs = {k: v for k, v in seen[-1].items() if k != "max_new_tokens"}
    gc = merged_generation_config(paged, generate_kwargs.pop("generation_config", None), generate_kwargs)
    assert gc.do_sample and gc.temperature == 0.7 and gc.top_k == 50  # the pipeline's and transformers' defaults
    monkeypatch.undo()
    prompt = tokenizer("Hello, my name is")["input_ids"]
    counts = engine_draws(paged, prompt, [True], **generate_kwargs)
    probs = stock_distribution(stock, prompt, **generate_kwargs)
    assert_same_distribution(counts, probs)


# ------------------------------------------------------------------------------------ field by field
def _merged(**kwargs):
    return merged_generation_config(tiny_model("llama", "hf_paged"), None, kwargs)


def test_defaults_map_field_by_field():
    params = sampling_params_from(_merged(do_sample=True), input_width=7)
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (1.0, 50, 1.0, 1.0)
    assert (params.min_p, params.n, params.logit_bias, params.bad_words_ids, params.no_repeat_ngram_size) == (
        0.0, 1, None, None, 0)
    assert not params.output_scores and not params.output_logits
    explicit = sampling_params_from(_merged(max_length=20), input_width=7)
    assert explicit.max_new_tokens == 20 - 7  # an explicit max_length counts the (padded) prompt, as stock does
    greedy = sampling_params_from(_merged(top_k=5, temperature=0.3, min_p=0.5), input_width=7)
    assert greedy.is_greedy and greedy.top_k == 0 and greedy.min_p == 0  # stock applies no warper without do_sample
    # Stock: min_new_tokens takes precedence over min_length (it rewrites min_length to match).
    both = sampling_params_from(_merged(min_length=12, min_new_tokens=2, max_new_tokens=9), input_width=7)
    assert (both.min_new_tokens, both.max_new_tokens) == (2, 9)
    only_length = sampling_params_from(_merged(min_length=12, max_new_tokens=9), input_width=7)
    assert only_length.min_new_tokens == 5


def test_a_default_max_length_means_twenty_new_tokens_as_in_stock(engine_calls):
    """Stock turns a `max_length` nobody set into 20 new tokens, whatever the prompt's length."""
    model = tiny_model("llama", "hf_paged")
    ids = torch.tensor([PROMPT])
    gc = merged_generation_config(model, None, {}, input_ids=ids)
    assert sampling_params_from(gc, input_width=len(PROMPT)).max_new_tokens == 20
    kwargs = dict(attention_mask=torch.ones_like(ids), eos_token_id=None)
    out = model.generate(ids, **kwargs)
    assert engine_calls == [True]
    assert torch.equal(out, tiny_model("llama", "sdpa").generate(ids, **kwargs))
    assert out.shape[1] == len(PROMPT) + 20


def test_a_missing_attention_mask_is_inferred_from_pad_tokens_as_in_stock(engine_calls):
    """Without `attention_mask`, stock masks the pad tokens (when the pad id is no eos id)."""
    ids = torch.tensor([[0, 0, 0] + PROMPT[:4], PROMPT])
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = tiny_model("llama", "hf_paged").generate(ids, **kwargs)
    assert engine_calls == [True]
    assert torch.equal(out, tiny_model("llama", "sdpa").generate(ids, **kwargs))


def test_newly_honoured_fields_map_onto_sampling_params():
    params = sampling_params_from(_merged(
        do_sample=True, min_p=0.1, no_repeat_ngram_size=3, bad_words_ids=[[5], [6, 7]],
        sequence_bias={(5,): 1.5, (9,): -2.0}, num_return_sequences=4, output_scores=True, output_logits=True,
        return_dict_in_generate=True), input_width=4)
    assert (params.min_p, params.no_repeat_ngram_size, params.bad_words_ids) == (0.1, 3, [[5], [6, 7]])
    assert params.logit_bias == {5: 1.5, 9: -2.0} and params.n == 4
    assert params.output_scores and params.output_logits
    listed = sampling_params_from(_merged(sequence_bias=[[[5], 1.5]]), input_width=4)  # stock's list form
    assert listed.logit_bias == {5: 1.5}
    # Scores and logits are only returned inside a dict, as in stock.
    bare = sampling_params_from(_merged(output_scores=True, output_logits=True), input_width=4)
    assert not bare.output_scores and not bare.output_logits


@pytest.mark.parametrize("field, value", [
    ("typical_p", 0.9), ("epsilon_cutoff", 0.01), ("suppress_tokens", [5]), ("sequence_bias", {(5, 6): 1.0}),
    ("num_beams", 2), ("forced_eos_token_id", 2), ("output_attentions", True),
    ("bad_words_ids", [[5, -1]]), ("bad_words_ids", [[VOCAB]]), ("sequence_bias", {(VOCAB,): 1.0}),
    ("no_repeat_ngram_size", 2.5), ("prompt_lookup_num_tokens", 3),
])
def test_an_unsupported_setting_falls_back_with_its_reason(field, value):
    """A processor the engine lacks, a multi-token sequence bias, a value stock's processors reject
    (stock then raises its own error), and `num_return_sequences` with assisted generation."""
    extra = {"num_return_sequences": 2} if field == "prompt_lookup_num_tokens" else {}
    reason = sampling_params_from(_merged(do_sample=True, **extra, **{field: value}), input_width=4,
                                  vocab_size=VOCAB)
    assert isinstance(reason, str) and (field in reason or "beam" in reason or "num_return" in reason), reason


def test_an_unsupported_setting_is_served_by_stock_with_stock_output(engine_calls):
    ids = torch.tensor([PROMPT])
    kwargs = dict(max_new_tokens=6, do_sample=False, suppress_tokens=[5, 9])
    out = tiny_model("llama", "hf_paged").generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    ref = tiny_model("llama", "sdpa").generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert engine_calls == [False] and torch.equal(out, ref)


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-38, 1e-6])
def test_a_sampling_temperature_below_the_engines_epsilon_falls_back(temperature):
    """The engine decodes temperatures below SAMPLING_EPS greedily; stock with `do_sample` samples from
    logits / temperature (or from NaNs, where that overflows): its scores and draws differ, so stock
    serves the call. Without `do_sample` stock ignores the temperature: greedy on both sides."""
    reason = sampling_params_from(_merged(do_sample=True, temperature=temperature), input_width=4)
    assert isinstance(reason, str) and "temperature" in reason, reason
    greedy = sampling_params_from(_merged(temperature=temperature), input_width=4)
    assert greedy.is_greedy and greedy.temperature == 0.0
    at_eps = sampling_params_from(_merged(do_sample=True, temperature=SAMPLING_EPS), input_width=4)
    assert at_eps.temperature == SAMPLING_EPS and not at_eps.is_greedy


@pytest.mark.parametrize("field, value", [
    ("temperature", 1e39), ("repetition_penalty", 1e-40), ("sequence_bias", {(5,): 1e39}),
])
def test_a_value_outside_fp32_falls_back(field, value):
    """Values the engine's `validate` refuses (they leave fp32 once cast) are stock's to serve."""
    reason = sampling_params_from(_merged(do_sample=True, **{field: value}), input_width=4, vocab_size=VOCAB)
    assert isinstance(reason, str), reason


def test_a_tiny_sampling_temperature_is_served_by_stock_with_stock_output(engine_calls):
    ids = torch.tensor([PROMPT])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True, temperature=1e-6,
                  return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(0)
    out = tiny_model("llama", "hf_paged").generate(ids, **kwargs)
    torch.manual_seed(0)
    ref = tiny_model("llama", "sdpa").generate(ids, **kwargs)
    assert engine_calls == [False] and torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):  # logits / 1e-6, not the engine's greedy (undivided) rows
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 / 1e-6)
