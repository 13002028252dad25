"""One numeric contract for sampling parameters.

* Temperatures below `SAMPLING_EPS` are greedy, wherever greediness is decided: the engine (plain and
  speculative) returns exactly the temperature-0 tokens for 1e-300, 1e-45, 1e-38 and 1e-6 (1e-45 and
  1e-300 used to overflow `logits / temperature` to inf, then NaN, and return token 0 every step).
* `validate` refuses values that leave fp32 once cast (an infinite bias or temperature, a repetition
  penalty that rounds to 0), naming the field.
* For hostile but valid settings (the largest fp32 bias, the smallest normal repetition penalty,
  a temperature of SAMPLING_EPS, a raw logit near the fp32 maximum) no processed row, score or
  logprob is +inf or NaN, and the token is the one the overflow pointed at.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_paged import Engine, SamplingParams
from hf_paged.worker.sampler import Sampler, SampleRow, processed_logits
from hf_paged.sampling_params import FP32_MAX, FP32_TINY, SAMPLING_EPS
from hf_paged.worker.sampling import SamplingState
from tiny_models import VOCAB, tiny_model

TINY_TEMPERATURES = [1e-300, 1e-45, 1e-38, 1e-6]


# ---------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("temperature, greedy", [
    (0.0, True), (1e-300, True), (1e-45, True), (1e-38, True), (1e-6, True), (9.999e-6, True),
    (SAMPLING_EPS, False), (0.01, False), (1.0, False), (FP32_MAX, False),
])
def test_temperatures_below_the_epsilon_are_greedy(temperature, greedy):
    params = SamplingParams(temperature=temperature)
    params.validate()
    assert params.is_greedy is greedy


@pytest.mark.parametrize("field, value", [
    ("temperature", -1e-6), ("temperature", math.inf), ("temperature", math.nan), ("temperature", 1e39),
    ("repetition_penalty", 0.0), ("repetition_penalty", 1e-46), ("repetition_penalty", 1e-40),
    ("repetition_penalty", 1e39), ("repetition_penalty", math.inf),
    ("logit_bias", {5: 1e39}), ("logit_bias", {5: -1e300}), ("logit_bias", {5: math.inf}),
    ("logit_bias", {5: -math.inf}), ("logit_bias", {5: math.nan}),
])
def test_validate_refuses_values_outside_fp32_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate(VOCAB)


@pytest.mark.parametrize("field, value", [
    ("temperature", FP32_MAX), ("repetition_penalty", FP32_TINY), ("repetition_penalty", FP32_MAX),
    ("logit_bias", {5: FP32_MAX, 6: -FP32_MAX}),
])
def test_validate_accepts_the_fp32_extremes(field, value):
    params = SamplingParams(**{field: value})
    params.validate(VOCAB)  # raises for a value it refuses
    assert getattr(params, field) == value  # accepted as given, not clamped


# ---------------------------------------------------------------------------------------------- the sampler
def _state(params: SamplingParams, history=(3, 4, 5, 9), num_prompt=2, seed=0) -> SamplingState:
    params.validate(VOCAB)
    return SamplingState(params, seed, list(history), num_prompt)


def _hostile_cases():
    """(params, raw logits row, the token the overflow points at) for settings `validate` accepts."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(VOCAB, generator=g) * 3
    huge = base.clone()
    huge[17] = 3e38  # a finite raw logit near the fp32 maximum
    positive = base.abs() + 1.0
    positive[[3, 4, 5]] = -1.0  # in the history, multiplied by the tiny penalty
    positive[9] = 50.0  # in the history: divided by the tiny penalty, past the fp32 maximum
    cases = []
    for extra in (dict(), dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(top_k=5, top_p=0.9, min_p=0.1)):
        for temperature in (0.0, SAMPLING_EPS, 0.7):
            common = dict(temperature=temperature, output_scores=True, logprobs=3, **extra)
            cases += [
                (SamplingParams(logit_bias={40: FP32_MAX}, **common), base.clone(), 40),
                (SamplingParams(logit_bias={17: FP32_MAX}, **common), huge.clone(), 17),
                (SamplingParams(repetition_penalty=FP32_TINY, **common), positive.clone(), 9),
                (SamplingParams(repetition_penalty=FP32_TINY, logit_bias={9: FP32_MAX}, presence_penalty=-2.0,
                                frequency_penalty=-2.0, **common), positive.clone(), 9),
                (SamplingParams(**common), huge.clone(), 17),
            ]
    return cases


HOSTILE = _hostile_cases()


def _finite_or_dropped(x: torch.Tensor) -> bool:
    return not bool(torch.isnan(x).any()) and not bool((x == math.inf).any())


def test_hostile_but_valid_settings_never_give_inf_or_nan():
    """Batched: every row's processed scores, logprobs and token, greedy and sampled, all warpers."""
    rows = [SampleRow(_state(p, seed=i)) for i, (p, _, _) in enumerate(HOSTILE)]
    logits = torch.stack([row for _, row, _ in HOSTILE])
    out = Sampler()(logits.clone(), rows)
    for i, (params, raw, expected) in enumerate(HOSTILE):
        what = f"row {i}: {params}"
        assert _finite_or_dropped(out.scores[i]), what
        lp = out.logprobs[i]
        assert not math.isnan(lp.logprob) and all(not math.isnan(v) for _, v in lp.top), what
        # Only the overflowed token keeps any probability: every draw takes it, as argmax does.
        assert out.token_ids[i] == expected == int(out.scores[i].argmax()), what
        assert lp.logprob == 0.0 and lp.rank == 1, what
        # The one-row path agrees.
        single = processed_logits(raw.clone(), _state(params, seed=i))
        assert _finite_or_dropped(single), what
        assert torch.equal(single, out.scores[i]), what


def test_overflow_is_clamped_only_where_it_happens():
    """In range nothing is touched: an ordinary row keeps exactly its divided values."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    for temperature in (SAMPLING_EPS, 0.3):
        params = SamplingParams(temperature=temperature, logit_bias={3: 2.5}, repetition_penalty=1.3)
        ours = processed_logits(row.clone(), _state(params))
        expected = row.clone()
        expected[3] += 2.5
        for t in {3, 4, 5, 9}:
            expected[t] = expected[t] / 1.3 if expected[t] > 0 else expected[t] * 1.3
        assert torch.equal(ours, expected / temperature)


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "hf_paged")


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 17)]


@pytest.mark.parametrize("speculative", [{}, dict(speculative_method="ngram", num_speculative_tokens=3)],
                         ids=["plain", "ngram"])
def test_the_engine_decodes_tiny_temperatures_greedily(model, speculative):
    prompts = _prompts()
    greedy = Engine(model, **speculative).generate(
        prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, output_scores=True))
    engine = Engine(model, **speculative)
    for temperature in TINY_TEMPERATURES:
        params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=temperature, top_k=3, top_p=0.5,
                                seed=7, output_scores=True)
        outs = engine.generate(prompts, params)
        for ours, ref in zip(outs, greedy):
            assert ours.outputs[0].token_ids == ref.outputs[0].token_ids, temperature
            # Greedy scores: the raw logits, no temperature, no warper. fp32 to 1e-5: another engine, so
            # other prefix-cache hits and batch shapes (a divided row would be ~1e5x larger).
            for a, b in zip(ours.outputs[0].scores, ref.outputs[0].scores):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
