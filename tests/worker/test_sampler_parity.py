"""The batched sampler against transformers' own logits processors, parameter by parameter.

The reference for every setting is the `LogitsProcessorList` transformers' `generate` builds for it,
in `GenerationMixin._get_logits_processor`'s order: SequenceBias (our `logit_bias`, one-token
sequences), RepetitionPenalty, [presence/frequency: not in transformers, `PresenceFrequencyPenalty`
below, OpenAI/vLLM semantics, placed right after the repetition penalty as we order it],
NoRepeatNGram, NoBadWords (eos filtered), MinNewTokensLength, then, only when sampling, Temperature,
TopK, TopP, MinP. Covered:

* parity of `processed_logits` and of the batched `Sampler` (many rows with different settings in
  one call, `SamplerOutput.scores`) with that list: the same -inf mask exactly, finite values to 1e-6,
  on vocabularies of 1000, 3001 (not a multiple of 64), 5000 (top-p's 1024-candidate fast path, and
  its full-sort fallback on flat logits), 32000 and 151936;
* ties: top-k keeps every tie at the k-th value, min-p with tied values, greedy argmax on ties;
* speculative rows: `SampleRow(state, extra)` processes as if `extra` were generated outputs;
* mutations: a deliberately wrong version of each setting (or of the processor order) is reported by
  the very comparison the parity tests use;
* logprobs (processed and raw, greedy and sampled, support-form and full-vocabulary rows) and
  `logprobs_of`;
* draws: each token is the inverse CDF of softmax(reference) at `uniform(seed, position)` (tokens in
  id order), chi-square over many seeds (with a power check against wrong distributions), and the same
  (seed, position) draws the same token whatever else shares the call.

Top-p parity is only checked on logits without ties: with ties at the nucleus boundary transformers'
own choice depends on its (unstable) sort order.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, replace

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.worker.sampler import TOP_P_CANDIDATES, Sampler, SampleRow, logprobs_of, processed_logits
from hf_paged.sampling_params import SamplingParams
from hf_paged.worker.sampling import SamplingState, uniform
from stats import chi2_critical, chi2_statistic

EOS = [2, 7]  # the model's end-of-sequence ids (a lone eos in bad_words_ids is not banned)
END = [2, 7, 11]  # what min_new_tokens masks: eos and a stop token
# fp32 elementwise maths on both sides (same operations, possibly another summation order in softmax)
ATOL = RTOL = 1e-6


# ---------------------------------------------------------------------------------------------- reference
class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI/vLLM penalties (transformers has none): logit -= frequency * count + presence * (count > 0),
    counting generated tokens only (the prompt's do not count)."""

    def __init__(self, presence: float, frequency: float, num_prompt: int, count_prompt: bool = False,
                 frequency_as_presence: bool = False):
        self.presence, self.frequency, self.num_prompt = presence, frequency, num_prompt
        self.count_prompt, self.frequency_as_presence = count_prompt, frequency_as_presence

    def __call__(self, input_ids, scores):
        vocab = scores.shape[-1]
        out = scores.clone()
        for b in range(input_ids.shape[0]):
            generated = input_ids[b] if self.count_prompt else input_ids[b, self.num_prompt:]
            counts = torch.bincount(generated.clamp(max=vocab), minlength=vocab + 1)[:vocab].to(scores.dtype)
            if self.frequency_as_presence:
                counts = (counts > 0).to(scores.dtype)
            out[b] = out[b] - (self.frequency * counts + self.presence * (counts > 0).to(scores.dtype))
        return out


class TopKWithoutTies(LogitsProcessor):
    """A wrong top-k (for the mutation tests): exactly k tokens, ties at the k-th value dropped."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, input_ids, scores):
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep.scatter_(1, scores.topk(min(self.k, scores.shape[-1]), dim=-1).indices, True)
        return scores.masked_fill(~keep, float("-inf"))


class MinPDroppingTies(LogitsProcessor):
    """A wrong min-p (for the mutation tests): drops tokens at the threshold too (<= for <)."""

    def __init__(self, min_p: float):
        self.min_p = min_p

    def __call__(self, input_ids, scores):
        probs = scores.softmax(dim=-1)
        drop = probs <= self.min_p * probs.amax(dim=-1, keepdim=True)
        drop.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
        return scores.masked_fill(drop, float("-inf"))


class BadWordsWithoutPrefix(LogitsProcessor):
    """A wrong bad-words ban (for the mutation tests): every word's last token, whatever precedes it."""

    def __init__(self, words, eos):
        self.banned = sorted({w[-1] for w in words if not (len(w) == 1 and w[0] in eos)})

    def __call__(self, input_ids, scores):
        out = scores.clone()
        out[:, self.banned] = float("-inf")
        return out


def reference(params: SamplingParams, num_prompt: int, wrong: frozenset = frozenset()) -> LogitsProcessorList:
    """transformers' processor list for `params` (in `_get_logits_processor`'s order), or, with `wrong`,
    a deliberately broken variant (for the mutation tests)."""
    procs = []
    bias = None
    if params.logit_bias:
        bias = SequenceBiasLogitsProcessor(sequence_bias={(t,): float(b) for t, b in params.logit_bias.items()})
        procs.append(bias)
    if params.repetition_penalty != 1.0:
        ignore = num_prompt if "repetition_outputs_only" in wrong else None
        procs.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty), prompt_ignore_length=ignore))
    if params.presence_penalty or params.frequency_penalty:
        procs.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty, num_prompt,
                                              count_prompt="penalties_count_prompt" in wrong,
                                              frequency_as_presence="frequency_as_presence" in wrong))
    if bias is not None and "bias_last" in wrong:
        procs.remove(bias)
        procs.append(bias)
    if params.no_repeat_ngram_size:
        procs.append(NoRepeatNGramLogitsProcessor(params.no_repeat_ngram_size))
    if params.bad_words_ids:
        if "bad_words_no_prefix" in wrong:
            procs.append(BadWordsWithoutPrefix(params.bad_words_ids, EOS))
        else:
            eos = None if "bad_words_ban_eos" in wrong else EOS
            procs.append(NoBadWordsLogitsProcessor([list(w) for w in params.bad_words_ids], eos))
    if params.min_new_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(num_prompt, params.min_new_tokens, END))
    if not params.is_greedy:
        temperature = TemperatureLogitsWarper(float(params.temperature)) if params.temperature != 1.0 else None
        warpers = []
        if temperature is not None:
            if "temperature_first" in wrong:
                procs.insert(0, temperature)
            else:
                warpers.append(temperature)
        if params.top_k:
            top_k = TopKWithoutTies if "top_k_no_ties" in wrong else TopKLogitsWarper
            warpers.append(top_k(params.top_k))
        top_p = TopPLogitsWarper(params.top_p) if params.top_p < 1.0 else None
        min_p = None
        if params.min_p > 0:
            min_p = MinPDroppingTies(params.min_p) if "min_p_drops_ties" in wrong else MinPLogitsWarper(params.min_p)
        order = [min_p, top_p] if "min_p_first" in wrong else [top_p, min_p]
        warpers.extend(w for w in order if w is not None)
        procs.extend(warpers)
    return LogitsProcessorList(procs)


def reference_row(row, history, num_prompt, params, wrong=frozenset()) -> torch.Tensor:
    """What transformers' list turns the raw next-token logits `row` into after `history`."""
    return reference(params, num_prompt, frozenset(wrong))(torch.tensor([history]), row[None].clone())[0]


def reference_draw(ref_row: torch.Tensor, seed: int, position: int, greedy: bool) -> int:
    """The token the documented rule picks from the reference distribution: the first argmax when
    greedy (torch.argmax's documented choice), else the inverse CDF of softmax (tokens in id order,
    float64) at u = uniform(seed, position)."""
    if greedy:
        return int(torch.argmax(ref_row))
    cdf = torch.softmax(ref_row.double(), dim=-1).cumsum(dim=-1)
    x = torch.tensor([uniform(seed, position) * cdf[-1].item()], dtype=torch.float64)
    return int(torch.searchsorted(cdf, x, right=True)[0])


def mismatch(ours: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Why `ours` is not transformers' `ref` (None when it is): the same -inf mask exactly, and the
    finite values to ATOL/RTOL."""
    if ours.shape != ref.shape:
        return f"shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    if torch.isnan(ours).any():
        return "NaN in our row"
    if torch.isposinf(ours).any():
        return "+inf in our row"
    ours_masked, ref_masked = torch.isneginf(ours), torch.isneginf(ref)
    if not torch.equal(ours_masked, ref_masked):
        only_ours = ((ours_masked & ~ref_masked).nonzero().flatten().tolist())[:8]
        only_ref = ((ref_masked & ~ours_masked).nonzero().flatten().tolist())[:8]
        return f"different tokens masked: only ours {only_ours}, only transformers' {only_ref}"
    finite = ~ref_masked
    if not torch.allclose(ours[finite], ref[finite], atol=ATOL, rtol=RTOL):
        diff = (ours[finite] - ref[finite]).abs()
        return f"values differ by up to {diff.max().item():.3g} ({int((diff > ATOL).sum())} tokens)"
    return None


def assert_matches(ours, ref, what=""):
    problem = mismatch(ours, ref)
    assert problem is None, f"{what}: {problem}"


# ---------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One row to process: settings, the raw logits' vocabulary and kind, and a history of
    `num_prompt` prompt and `num_output` generated tokens (from `range(alphabet)`, to make repeats
    likely; `tail` replaces its last tokens; `beyond` its first ones, with ids past the head's
    vocabulary)."""

    name: str
    params: SamplingParams
    vocab: int = 1000
    kind: str = "randn"  # randn (x3), peaky (x8), flat (x0.5), int (integer values in [-6, 6]: ties)
    num_prompt: int = 20
    num_output: int = 12
    alphabet: int | None = None
    tail: tuple = ()
    beyond: tuple = ()
    changes: bool = True  # whether transformers' list changes the raw row at all (else: a no-op case)

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())

    def inputs(self) -> tuple[torch.Tensor, list[int]]:
        g = torch.Generator().manual_seed(self.seed)
        if self.kind == "int":
            row = torch.randint(-6, 7, (self.vocab,), generator=g).float()
        else:
            scale = {"randn": 3.0, "peaky": 8.0, "flat": 0.5}[self.kind]
            row = torch.randn(self.vocab, generator=g) * scale
        n = self.num_prompt + self.num_output
        history = torch.randint(0, self.alphabet or self.vocab, (n,), generator=g).tolist()
        if self.tail:
            history[n - len(self.tail):] = list(self.tail)
        if self.beyond:  # ids an embedding larger than the head knows: in the prompt
            history[:len(self.beyond)] = list(self.beyond)
        return row, history

    def state(self, history, seed=0, params=None) -> SamplingState:
        return SamplingState(params or self.params, seed, list(history), self.num_prompt, end_token_ids=END,
                             eos_token_ids=EOS)


def S(**settings) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 64, **settings})


BAD_WORDS_TAIL = (5, 9)
BAD_WORDS = [[40], [5, 9, 33], [9, 34], [4, 35], [2], [9, 7], [1] * 40 + [36], [17, 18]]

CASES = [
    # logit_bias
    Case("logit_bias-greedy", S(logit_bias={5: 2.5, 17: -3.0, 999: 1.0, 0: -100.0})),
    Case("logit_bias-sampled-3001", S(temperature=1.0, logit_bias={3000: 4.0, 64: -2.0, 1: 0.5}), vocab=3001),
    # penalties
    Case("repetition_penalty", S(repetition_penalty=1.2)),
    Case("repetition_penalty-reward-long", S(repetition_penalty=0.8), vocab=3001, num_prompt=150, num_output=100),
    Case("presence", S(presence_penalty=0.7), alphabet=30),
    Case("presence-negative", S(presence_penalty=-0.5, temperature=1.0), vocab=3001, alphabet=30),
    Case("frequency", S(frequency_penalty=0.4), alphabet=30, num_output=30),
    Case("frequency-negative", S(frequency_penalty=-0.3), alphabet=20, num_output=30),
    Case("penalties-beyond-head-vocab", S(repetition_penalty=1.3, presence_penalty=0.2, no_repeat_ngram_size=1),
         beyond=(1000, 1001, 1003)),
    # bans
    Case("bad_words", S(bad_words_ids=BAD_WORDS), tail=BAD_WORDS_TAIL),
    Case("bad_words-sampled", S(temperature=0.9, bad_words_ids=BAD_WORDS), vocab=3001, tail=BAD_WORDS_TAIL),
    Case("no_repeat_ngram-1", S(no_repeat_ngram_size=1)),
    Case("no_repeat_ngram-2", S(no_repeat_ngram_size=2), alphabet=12, num_output=40),
    Case("no_repeat_ngram-3", S(no_repeat_ngram_size=3), alphabet=5, num_output=40),
    Case("no_repeat_ngram-3-sampled", S(no_repeat_ngram_size=3, temperature=1.0), vocab=3001, alphabet=5),
    # min_new_tokens (END masked while fewer than min_new_tokens were generated)
    Case("min_new_tokens-before", S(min_new_tokens=5), num_output=2),
    Case("min_new_tokens-one-below", S(min_new_tokens=5), num_output=4),
    Case("min_new_tokens-at-threshold", S(min_new_tokens=5), num_output=5, changes=False),
    Case("min_new_tokens-after", S(min_new_tokens=5, temperature=1.0), num_output=9, changes=False),
    Case("min_new_tokens-no-outputs", S(min_new_tokens=3, temperature=1.0), num_output=0),
    # warpers
    Case("temperature-0.7", S(temperature=0.7)),
    Case("temperature-1.0", S(temperature=1.0), changes=False),
    Case("temperature-1.8-3001", S(temperature=1.8), vocab=3001),
    Case("top_k-20", S(temperature=1.0, top_k=20)),
    Case("top_k-1", S(temperature=1.0, top_k=1)),
    Case("top_k-vocab-minus-1", S(temperature=1.0, top_k=999)),
    Case("top_k-equals-vocab", S(temperature=1.0, top_k=1000), changes=False),
    Case("top_k-above-vocab", S(temperature=1.0, top_k=5000), changes=False),
    Case("top_k-300-3001", S(temperature=0.5, top_k=300), vocab=3001),
    Case("top_p-0.9", S(temperature=1.0, top_p=0.9)),
    Case("top_p-0.5-3001", S(temperature=1.0, top_p=0.5), vocab=3001),
    Case("top_p-peaky-5000", S(temperature=1.0, top_p=0.9), vocab=5000, kind="peaky"),
    Case("top_p-flat-5000", S(temperature=1.0, top_p=0.9), vocab=5000, kind="flat"),
    Case("top_p-flat-32000", S(temperature=1.0, top_p=0.9), vocab=32000, kind="flat"),
    Case("top_p-peaky-32000", S(temperature=0.9, top_p=0.9), vocab=32000, kind="peaky"),
    Case("top_p-peaky-151936", S(temperature=1.5, top_p=0.8), vocab=151936, kind="peaky"),
    Case("temperature-0.05+top_p", S(temperature=0.05, top_p=0.9)),
    Case("min_p-0.1", S(temperature=1.0, min_p=0.1)),
    Case("min_p-0.05-hot", S(temperature=1.5, min_p=0.05), vocab=3001),
    # combinations
    Case("temperature+top_k+top_p+repetition",
         S(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)),
    Case("temperature+presence+frequency", S(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3),
         alphabet=30, num_output=30),
    Case("logit_bias+repetition", S(logit_bias={t: 1.5 - 0.3 * t for t in range(10)}, repetition_penalty=1.4),
         alphabet=10),
    Case("min_p+top_k", S(temperature=1.2, top_k=40, min_p=0.1)),
    Case("top_p+min_p", S(temperature=1.0, top_p=0.9, min_p=0.02)),
    Case("top_p+min_p-peaky-5000", S(temperature=1.3, top_p=0.9, min_p=0.02), vocab=5000, kind="peaky"),
    Case("top_k+top_p-5000", S(temperature=1.0, top_k=2000, top_p=0.7), vocab=5000, kind="flat"),
    Case("top_k-beyond-the-unbanned", S(temperature=1.0, top_k=900, top_p=0.99, no_repeat_ngram_size=1),
         num_prompt=150, num_output=100),  # fewer than k tokens left: the k-th value is -inf
    Case("greedy-ignores-warpers", S(top_k=3, top_p=0.5, min_p=0.5, repetition_penalty=1.3,
                                     frequency_penalty=0.2, no_repeat_ngram_size=2), alphabet=12, num_output=30),
    Case("all-at-once", S(temperature=0.8, top_k=200, top_p=0.9, min_p=0.02, repetition_penalty=1.15,
                          presence_penalty=0.3, frequency_penalty=0.2, logit_bias={3: 2.0, 2999: 5.0},
                          bad_words_ids=[[13], [5, 9, 14]], no_repeat_ngram_size=2, min_new_tokens=20),
         vocab=3001, alphabet=40, num_output=12, tail=BAD_WORDS_TAIL),
    # ties (integer-valued logits)
    Case("top_k-ties", S(temperature=1.0, top_k=10), kind="int"),
    Case("top_k-1-ties", S(temperature=1.0, top_k=1), kind="int"),
    Case("top_k-ties-temperature", S(temperature=0.6, top_k=25), kind="int"),
    Case("top_k-ties-min_p", S(temperature=1.0, top_k=30, min_p=0.3), kind="int"),
    Case("min_p-ties", S(temperature=1.0, min_p=0.1), kind="int"),
    Case("min_p-ties-temperature", S(temperature=0.5, min_p=0.14), kind="int"),
    Case("min_p-1.0-ties", S(temperature=1.0, min_p=1.0), kind="int"),  # keeps exactly the tied maxima
    Case("greedy-ties", S(), kind="int", changes=False),
    Case("greedy-ties-penalties", S(repetition_penalty=2.0, presence_penalty=1.0), kind="int", alphabet=50),
]
BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_processed_logits_match_transformers(case):
    case.params.validate()
    row, history = case.inputs()
    ref = reference_row(row, history, case.num_prompt, case.params)
    # The case exercises what it claims: transformers' list changes the row (or is a no-op, where meant).
    assert (mismatch(ref, row) is not None) == case.changes, "the case does not test what it says"
    assert_matches(processed_logits(row, case.state(history)), ref, case.name)


def test_the_cases_exercise_each_semantic():
    """Sanity of the inputs above: the bad-words case bans what transformers bans (prefix matching,
    lone eos kept, multi-token word ending in eos banned, a word longer than the history ignored), the
    tie cases really have ties at the k-th value, the n-gram cases ban tokens."""
    c = BY_NAME["bad_words"]
    row, history = c.inputs()
    assert history[-2:] == list(BAD_WORDS_TAIL)
    ref = reference_row(row, history, c.num_prompt, c.params)
    assert all(torch.isneginf(ref[t]) for t in (40, 33, 34, 7)), "single, prefix-matched, eos-ending words"
    assert not any(torch.isneginf(ref[t]) for t in (35, 2, 36, 18)), "unmatched prefix, lone eos, too long"
    for name in ("top_k-ties", "top_k-1-ties", "top_k-ties-temperature"):
        c = BY_NAME[name]
        row, history = c.inputs()
        kept = (~torch.isneginf(reference_row(row, history, c.num_prompt, c.params))).sum()
        assert kept > c.params.top_k, f"{name}: no tie at the k-th value"
    c = BY_NAME["min_p-1.0-ties"]
    row, history = c.inputs()
    assert (~torch.isneginf(reference_row(row, history, c.num_prompt, c.params))).sum() == (row == row.max()).sum() > 1
    for name in ("no_repeat_ngram-2", "no_repeat_ngram-3"):
        c = BY_NAME[name]
        row, history = c.inputs()
        assert torch.isneginf(reference_row(row, history, c.num_prompt, c.params)).sum() >= 1


class _Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


@pytest.mark.parametrize("name,fast", [("top_p-peaky-5000", True), ("top_p-peaky-32000", True),
                                       ("top_p-peaky-151936", True), ("top_p+min_p-peaky-5000", True),
                                       ("top_p-flat-5000", False), ("top_p-flat-32000", False)])
def test_top_p_fast_path_and_its_fallback_both_match(monkeypatch, name, fast):
    """Peaky rows are decided from the most likely TOP_P_CANDIDATES tokens; flat rows, whose tokens
    each hold about the margin's mass, fall back to the full sort; all equal transformers' full sort."""
    c = BY_NAME[name]
    assert c.vocab > TOP_P_CANDIDATES[0]
    spy = _Spy(Sampler._top_p_min_p_dense)
    monkeypatch.setattr(Sampler, "_top_p_min_p_dense", staticmethod(spy))
    row, history = c.inputs()
    ours = processed_logits(row, c.state(history))
    assert (spy.calls == 0) == fast, "the row did not take the path it is meant to test"
    assert_matches(ours, reference_row(row, history, c.num_prompt, c.params), name)


def _batched(cases, seed0=0):
    """One Sampler call over every case's row (output_scores on): per case (ours, ref, token, expected)."""
    inputs = [c.inputs() for c in cases]
    states = [c.state(h, seed=seed0 + j, params=replace(c.params, output_scores=True))
              for j, (c, (_, h)) in enumerate(zip(cases, inputs))]
    logits = torch.stack([row for row, _ in inputs])
    out = Sampler()(logits.clone(), [SampleRow(s) for s in states])
    results = []
    for j, (c, (row, history)) in enumerate(zip(cases, inputs)):
        ref = reference_row(row, history, c.num_prompt, c.params)
        expected = reference_draw(ref, states[j].seed, len(history), c.params.is_greedy)
        results.append((out.scores[j], ref, out.token_ids[j], expected))
    return results


@pytest.mark.parametrize("vocab", sorted({c.vocab for c in CASES}))
def test_batched_rows_with_different_settings_match_transformers(vocab):
    """All the cases of one vocabulary in one call, in two orders: each row's scores are its own
    reference's, and its token is the reference draw."""
    cases = [c for c in CASES if c.vocab == vocab]
    for order in (cases, cases[::-1]):
        for c, (scores, ref, token, expected) in zip(order, _batched(order)):
            assert scores is not None
            assert_matches(scores, ref, c.name)
            # fp32 vs the float64 reference CDF: only a u within ~1e-7 of a boundary could differ
            assert token == expected, f"{c.name}: drew {token}, the reference CDF gives {expected}"
            assert not torch.isneginf(ref[token])


def test_greedy_ties_take_torch_argmax_choice():
    """Greedy rows with tied maxima (integer logits, after penalties too) take what torch.argmax takes
    on the processed row: the first maximal index (its documented choice), in a batched call."""
    cases = [BY_NAME["greedy-ties"], BY_NAME["greedy-ties-penalties"]]
    for c in cases:
        row, history = c.inputs()
        assert (row == row.max()).sum() > 1, "no tie at the maximum"
    for c, (_, ref, token, _) in zip(cases * 3, _batched(cases * 3)):
        assert token == int(torch.argmax(ref)) == int((ref == ref.max()).nonzero()[0])


# ---------------------------------------------------------------------------------------------- speculative
SPEC_PARAMS = S(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                no_repeat_ngram_size=3, min_new_tokens=8, top_k=60,
                bad_words_ids=[[4, 77], [3, 4, 78], [1, 2, 79], [2, 80]])


def _spec_history():
    g = torch.Generator().manual_seed(7)
    history = torch.randint(0, 6, (26,), generator=g).tolist()  # 20 prompt + 6 outputs, alphabet 6
    history[-1] = 1  # so the word [1, 2, 79] straddles history and drafts (2, ...)
    return history


SPEC_EXTRAS = [(), (2,), (2, 3), (2, 3, 4), (2, 3, 4, 2)]


@pytest.mark.parametrize("ngram", [1, 2, 3])
def test_speculative_rows_process_like_the_extended_history(ngram):
    """A verify row `SampleRow(state, extra)` equals transformers on prompt + outputs + extra (extra
    counted as outputs: penalties, n-grams ending inside `extra`, bad-word prefixes straddling it, the
    min_new_tokens count), for all of a request's verify rows in one call; and the state is left as it
    was (a later row without drafts processes as before)."""
    history, num_prompt = _spec_history(), 20
    params = replace(SPEC_PARAMS, no_repeat_ngram_size=ngram)
    state = SamplingState(replace(params, output_scores=True), 5, history, num_prompt, END, EOS)
    g = torch.Generator().manual_seed(8)
    rows = torch.randn(len(SPEC_EXTRAS), 100, generator=g) * 3
    rows[:, [77, 78, 79, 80, 2, 7, 11]] += 5.0  # so that the bans and masks fall inside the top-k
    out = Sampler()(rows.clone(), [SampleRow(state, e) for e in SPEC_EXTRAS])
    refs = []
    for j, extra in enumerate(SPEC_EXTRAS):
        ref = reference_row(rows[j], history + list(extra), num_prompt, params)
        refs.append(ref)
        assert_matches(out.scores[j], ref, f"batched verify row after {extra}")
        assert_matches(processed_logits(rows[j], state, extra), ref, f"processed_logits after {extra}")
        # The same (seed, position) as the request would have once the drafts are its outputs.
        assert out.token_ids[j] == reference_draw(ref, 5, len(history) + len(extra), False)
        committed = SamplingState(params, 5, history + list(extra), num_prompt, END, EOS)
        assert out.token_ids[j] == Sampler()(rows[j][None].clone(), [SampleRow(committed)]).token_ids[0]
    # The drafts changed what is banned and masked: the cases really exercise extra history.
    # (min_new_tokens=8 after 6 outputs: 7 and 11, outside the history's alphabet, masked until 2 drafts)
    assert torch.isneginf(refs[1][[7, 11]]).all() and not torch.isneginf(refs[2][[7, 11]]).any()
    assert torch.isneginf(refs[1][[79, 80]]).all() and torch.isneginf(refs[3][[77, 78]]).all()
    assert not torch.isneginf(refs[0][[77, 78, 79, 80]]).any()
    # Not absorbed into the state.
    assert_matches(processed_logits(rows[0], state), refs[0], "after the verify rows")
    # The comparison sees drafts that are ignored, or counted as prompt tokens.
    assert mismatch(out.scores[3], reference_row(rows[3], history, num_prompt, params)) is not None
    assert mismatch(out.scores[3], reference_row(rows[3], history + [2, 3, 4], num_prompt + 3, params)) is not None


# ---------------------------------------------------------------------------------------------- mutations
def _p(**changes):
    return lambda p: replace(p, **changes)


_SAME = lambda p: p  # noqa: E731
MUTATIONS = [
    # (what is wrong, case, the wrong settings given to transformers, wrong reference behaviour)
    ("logit bias sign", "logit_bias-greedy",
     lambda p: replace(p, logit_bias={t: -b for t, b in p.logit_bias.items()}), ()),
    ("logit bias applied after the penalties", "logit_bias+repetition", _SAME, ("bias_last",)),
    ("repetition 1.3 for 1.2", "repetition_penalty", _p(repetition_penalty=1.3), ()),
    ("repetition on outputs only", "repetition_penalty", _SAME, ("repetition_outputs_only",)),
    ("repetition 0.85 for 0.8", "repetition_penalty-reward-long", _p(repetition_penalty=0.85), ()),
    ("presence applied to prompt tokens", "presence", _SAME, ("penalties_count_prompt",)),
    ("presence 0.6 for 0.7", "presence", _p(presence_penalty=0.6), ()),
    ("frequency applied to prompt tokens", "frequency", _SAME, ("penalties_count_prompt",)),
    ("frequency counted once per token", "frequency", _SAME, ("frequency_as_presence",)),
    ("presence and frequency swapped", "temperature+presence+frequency",
     lambda p: replace(p, presence_penalty=p.frequency_penalty, frequency_penalty=p.presence_penalty), ()),
    ("temperature before the penalties", "temperature+presence+frequency", _SAME, ("temperature_first",)),
    ("bad words without the prefix check", "bad_words", _SAME, ("bad_words_no_prefix",)),
    ("bad words banning a lone eos", "bad_words", _SAME, ("bad_words_ban_eos",)),
    ("no_repeat_ngram 2 for 3", "no_repeat_ngram-3", _p(no_repeat_ngram_size=2), ()),
    ("no_repeat_ngram 1 for 2", "no_repeat_ngram-2", _p(no_repeat_ngram_size=1), ()),
    ("no_repeat_ngram 2 for 1", "no_repeat_ngram-1", _p(no_repeat_ngram_size=2), ()),
    ("min_new_tokens one fewer", "min_new_tokens-one-below", _p(min_new_tokens=4), ()),
    ("min_new_tokens one more", "min_new_tokens-at-threshold", _p(min_new_tokens=6), ()),
    ("temperature 0.8 for 0.7", "temperature-0.7", _p(temperature=0.8), ()),
    ("top_k 21 for 20", "top_k-20", _p(top_k=21), ()),
    ("top_k 2 for 1", "top_k-1", _p(top_k=2), ()),
    ("top_k 998 for 999", "top_k-vocab-minus-1", _p(top_k=998), ()),
    ("top_k dropping ties", "top_k-ties", _SAME, ("top_k_no_ties",)),
    ("top_p 0.92 for 0.9", "top_p-0.9", _p(top_p=0.92), ()),
    ("top_p 0.88 for 0.9 (full-sort fallback)", "top_p-flat-32000", _p(top_p=0.88), ()),
    ("top_p 0.93 for 0.9 (fast path)", "top_p-peaky-5000", _p(top_p=0.93), ()),
    ("min_p 0.2 for 0.1", "min_p-0.1", _p(min_p=0.2), ()),
    ("min_p 0.2 for 0.1 (ties)", "min_p-ties", _p(min_p=0.2), ()),
    ("min_p before top_p", "top_p+min_p", _SAME, ("min_p_first",)),
    ("min_p dropping ties at the threshold", "min_p-1.0-ties", _SAME, ("min_p_drops_ties",)),
    ("greedy applying the warpers", "greedy-ignores-warpers", _p(temperature=1.0), ()),
]


@pytest.mark.parametrize("what,name,change,wrong", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_wrong_implementation_is_reported_by_the_same_comparison(what, name, change, wrong):
    c = BY_NAME[name]
    row, history = c.inputs()
    ours = processed_logits(row, c.state(history))
    assert mismatch(ours, reference_row(row, history, c.num_prompt, c.params)) is None
    wrong_ref = reference_row(row, history, c.num_prompt, change(c.params), frozenset(wrong))
    assert mismatch(ours, wrong_ref) is not None, f"{what} went unnoticed"


# ---------------------------------------------------------------------------------------------- logprobs
def logprobs_problem(entry, dist: torch.Tensor, token: int, k: int) -> str | None:
    """Why `entry` is not the logprobs of `token` under log_softmax(dist) with its k most likely."""
    logp = torch.log_softmax(dist.double(), dim=-1)
    if entry is None:
        return "no logprobs"
    if entry.token_id != token:
        return f"token {entry.token_id} != {token}"
    if abs(entry.logprob - logp[token].item()) > 1e-5:  # fp32 log_softmax vs float64
        return f"logprob {entry.logprob} != {logp[token].item()}"
    rank = 1 + int((dist > dist[token]).sum())  # compared on the logits: exact
    if entry.rank != rank:
        return f"rank {entry.rank} != {rank}"
    kept = int(torch.isfinite(logp).sum())
    want = logp.topk(min(k, kept))
    got = entry.top[:len(want.values)]
    if [t for t, _ in got] != want.indices.tolist():
        return f"top ids {[t for t, _ in got]} != {want.indices.tolist()}"
    if any(abs(lp - w) > 1e-5 for (_, lp), w in zip(got, want.values.tolist())):  # fp32 vs float64
        return f"top logprobs {[lp for _, lp in got]} != {want.values.tolist()}"
    if len(entry.top) != min(k, kept):  # the k most likely of the tokens the processors kept
        return f"{len(entry.top)} top entries, want min(k={k}, kept={kept})"
    return None


LOGPROB_ROWS = [
    S(logprobs=5),
    S(logprobs=0, repetition_penalty=1.3),
    S(logprobs=3, logprobs_mode="raw", logit_bias={1: 9.0}),
    S(logprobs=20, temperature=0.8),  # full vocabulary
    S(logprobs=4, temperature=1.0, top_k=30),  # support form
    S(logprobs=7, temperature=0.7, top_k=8, top_p=0.9),
    S(logprobs=5, temperature=1.0, top_p=0.9),  # the top-p fast path (candidates form) at 5000
    S(logprobs=2, temperature=1.0, min_p=0.05, presence_penalty=0.5),
    S(logprobs=6, temperature=1.0, top_k=30, logprobs_mode="raw"),
    S(logprobs=3, temperature=1.2, top_p=0.8, logprobs_mode="raw", repetition_penalty=1.2),
]


@pytest.mark.parametrize("vocab", [1000, 5000])
def test_logprobs_processed_and_raw(vocab):
    """Processed mode: log_softmax of transformers' processed row; raw mode: of the raw logits; for
    greedy and sampled rows, support-form (top-k, top-p candidates) and full-vocabulary rows."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(len(LOGPROB_ROWS), vocab, generator=g) * 4
    history = torch.randint(0, vocab, (30,), generator=g).tolist()
    states = [SamplingState(replace(p, output_logits=True), 100 + j, history, 20, END, EOS)
              for j, p in enumerate(LOGPROB_ROWS)]
    out = Sampler()(logits.clone(), [SampleRow(s) for s in states])
    for j, p in enumerate(LOGPROB_ROWS):
        ref = reference_row(logits[j], history, 20, p)
        dist = logits[j] if p.logprobs_mode == "raw" else ref
        problem = logprobs_problem(out.logprobs[j], dist, out.token_ids[j], p.logprobs)
        assert problem is None, f"row {j} ({p.logprobs_mode}): {problem}"
        assert torch.equal(out.logits[j], logits[j]), "output_logits: the raw row"
        assert out.scores[j] is None
        # The same check tells the two modes apart (where processing changed the row's distribution).
        if mismatch(ref, logits[j]) is not None:
            other = ref if p.logprobs_mode == "raw" else logits[j]
            assert logprobs_problem(out.logprobs[j], other, out.token_ids[j], p.logprobs) is not None


def test_logprobs_asking_for_more_than_the_kept_tokens():
    """`logprobs=k` beyond the tokens top-k / top-p / min-p keep: the kept ones in order and no more
    (a dropped token has no rank to report), whichever form (support or full vocabulary) the row
    took, and the same entries whatever rows share the call."""
    g = torch.Generator().manual_seed(3)
    rows = [S(logprobs=10, temperature=1.0, top_k=5), S(logprobs=10, temperature=1.0, top_p=0.3),
            S(logprobs=10, temperature=1.0, min_p=0.5), S(logprobs=10, temperature=1.0, top_k=3, top_p=0.5)]
    logits = torch.randn(len(rows), 100, generator=g) * 3
    out = Sampler()(logits.clone(), [SampleRow(SamplingState(p, j, [3, 4], 2)) for j, p in enumerate(rows)])
    problems = []
    for j, p in enumerate(rows):
        ref = reference_row(logits[j], [3, 4], 2, p)
        problem = logprobs_problem(out.logprobs[j], ref, out.token_ids[j], p.logprobs)
        if problem:
            problems.append(f"top_k={p.top_k} top_p={p.top_p} min_p={p.min_p}: {problem}")
        alone = Sampler()(logits[j][None].clone(), [SampleRow(SamplingState(p, j, [3, 4], 2))]).logprobs[0]
        batched = out.logprobs[j]
        if alone.top != batched.top:
            problems.append(f"top_k={p.top_k}: {len(alone.top)} top entries alone, {len(batched.top)} in the batch")
    assert not problems, "; ".join(problems)


def test_logprobs_of_prompt_rows():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 1000, generator=g) * 3
    tokens = torch.randint(0, 1000, (6,), generator=g).tolist()
    for j, entry in enumerate(logprobs_of(logits, tokens, 4)):
        problem = logprobs_problem(entry, logits[j], tokens[j], 4)
        assert problem is None, problem


# ---------------------------------------------------------------------------------------------- distribution
CHUNK = 5000


def draw_many(row: torch.Tensor, params: SamplingParams, history: list[int], num_prompt: int, n: int,
              first_seed: int) -> torch.Tensor:
    """Counts of n tokens drawn for the same row with seeds first_seed..first_seed+n-1, CHUNK rows a call."""
    tokens = []
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        rows = [SampleRow(SamplingState(params, first_seed + start + j, history, num_prompt, END, EOS))
                for j in range(m)]
        tokens += Sampler()(row.expand(m, -1).clone(), rows, with_outputs=False).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=row.numel())


def rejects(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[bool, str]:
    """Whether `counts` are unlikely under `probs`: a draw outside its support, or Pearson's chi-square
    over bins (tokens by decreasing probability, rare ones grouped until a bin expects `min_expected`)
    beyond the 0.001 critical value."""
    outside = int(counts[probs == 0].sum())
    if outside:
        return True, f"{outside} draws outside the support"
    n = counts.sum().item()
    order = probs.argsort(descending=True)
    order = order[probs[order] > 0]
    bin_counts, bin_probs, c, q = [], [], 0.0, 0.0
    for t, pt in zip(counts[order].tolist(), probs[order].tolist()):
        c, q = c + t, q + pt
        if q * n >= min_expected:
            bin_counts.append(c)
            bin_probs.append(q)
            c, q = 0.0, 0.0
    if q > 0:  # the rarest tail joins the last bin
        bin_counts[-1] += c
        bin_probs[-1] += q
    stat, df = chi2_statistic(torch.tensor(bin_counts, dtype=torch.float64),
                              torch.tensor(bin_probs, dtype=torch.float64))
    return stat > chi2_critical(df), f"chi2={stat:.1f} df={df} critical={chi2_critical(df):.1f}"


DIST_CASES = [
    # (name, params, vocab, logits scale, wrong settings the draws must not fit)
    ("top_k+top_p+temperature", S(temperature=0.7, top_k=40, top_p=0.9), 1000, 0.8,
     [S(), S(temperature=1.0, top_k=40, top_p=0.9), S(temperature=0.7, top_k=40, top_p=0.95)]),
    ("full-vocab-2000", S(temperature=0.9, logit_bias={5: 3.0, 6: -3.0}), 2000, 1.5,
     [S(temperature=1.0), S(temperature=1.0, logit_bias={5: 3.0, 6: -3.0})]),
    ("penalties", S(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3), 300, 2.0,
     [S(temperature=1.0), S(temperature=1.0, repetition_penalty=1.5)]),
]


@pytest.mark.parametrize("name,params,vocab,scale,wrongs", DIST_CASES, ids=[d[0] for d in DIST_CASES])
def test_draws_follow_softmax_of_the_processed_logits(name, params, vocab, scale, wrongs):
    """20k draws (one seed each) fit softmax(transformers' processed row); the same statistic rejects
    the raw distribution and wrongly processed ones (power)."""
    g = torch.Generator().manual_seed(vocab)
    row = torch.randn(vocab, generator=g) * scale
    # penalised tokens among the likeliest, repeated among the outputs, so the penalties matter
    top = row.topk(15).indices.tolist()
    history = [top[j % 15] for j in range(10)] + [top[j % 6] for j in range(20)]
    counts = draw_many(row, params, history, 10, 20_000, first_seed=vocab * 1_000_003)
    probs = torch.softmax(reference_row(row, history, 10, params).double(), dim=-1)
    bad, why = rejects(counts, probs)
    assert not bad, f"{name}: {why}"
    for wrong in wrongs:
        bad, why = rejects(counts, torch.softmax(reference_row(row, history, 10, wrong).double(), dim=-1))
        assert bad, f"{name}: draws also fit {wrong} ({why})"


def test_draws_over_positions_follow_softmax():
    """One seed, varying position (the history grows by a token the processing ignores): the draws
    over positions fit the distribution too."""
    params = S(temperature=1.0, top_k=10)
    row = torch.randn(200, generator=torch.Generator().manual_seed(11)) * 2
    n = 3000
    states = [SamplingState(params, 1234, [0] * (j + 1), 1) for j in range(n)]
    counts = torch.bincount(torch.tensor(Sampler()(row.expand(n, -1).clone(), [SampleRow(s) for s in states],
                                                   with_outputs=False).token_ids), minlength=200)
    probs = torch.softmax(reference_row(row, [0], 1, params).double(), dim=-1)
    bad, why = rejects(counts, probs)
    assert not bad, why
    for wrong in (S(temperature=1.0, top_k=11), S(temperature=1.2, top_k=10), S(temperature=1.0)):
        bad, why = rejects(counts, torch.softmax(reference_row(row, [0], 1, wrong).double(), dim=-1))
        assert bad, f"the draws also fit {wrong} ({why})"


# ---------------------------------------------------------------------------------------------- seeds
SEED_ROWS = [
    S(), S(repetition_penalty=1.3, no_repeat_ngram_size=2), S(temperature=0.9), S(temperature=1.0, top_k=5),
    S(temperature=0.8, top_k=40, top_p=0.8), S(temperature=1.0, top_k=1), S(temperature=1.0, top_p=0.9),
    S(temperature=1.0, min_p=0.1), S(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.4),
    S(temperature=1.0, top_k=10), S(temperature=1.3, top_p=0.95, min_p=0.05, bad_words_ids=[[3], [4, 5]]),
    S(temperature=1.0, min_new_tokens=50),
]
SEED_INT = {9}  # integer logits: a row whose top-k has ties


def _seed_rows(vocab=1000):
    g = torch.Generator().manual_seed(21)
    rows = []
    for j, p in enumerate(SEED_ROWS):
        logits = (torch.randint(-6, 7, (vocab,), generator=g).float() if j in SEED_INT
                  else torch.randn(vocab, generator=g) * 3)
        history = torch.randint(0, 30, (20 + j,), generator=g).tolist()
        rows.append((p, logits, history, 1000 + 17 * j))
    return rows


def test_the_same_seed_and_position_draw_the_same_token_in_any_batch():
    """Each tracked row draws the reference token (inverse CDF at uniform(seed, position)) alone, in the
    full batch, reversed, in random subsets and orders, with filler rows of other settings (which change
    the batch's top-k width, its tie and top-p paths), and without outputs."""
    vocab = 1000
    tracked = _seed_rows(vocab)
    expected = []
    for p, logits, history, seed in tracked:
        ref = reference_row(logits, history, 10, p)
        expected.append(reference_draw(ref, seed, len(history), p.is_greedy))
    rng = random.Random(5)
    g = torch.Generator().manual_seed(22)
    fillers = [S(temperature=1.0, top_k=900), S(temperature=0.5, top_k=3), S(logprobs=3, output_scores=True),
               S(temperature=1.0, top_p=0.5, logprobs=2), S(temperature=2.0, top_k=100, min_p=0.3),
               S(temperature=1.0, top_k=7, repetition_penalty=1.5)]

    def run(indices, num_fillers, with_outputs=True):
        rows, logits = [], []
        for i in indices:
            p, lg, history, seed = tracked[i]
            rows.append(SampleRow(SamplingState(p, seed, history, 10, END, EOS)))
            logits.append(lg)
        for _ in range(num_fillers):
            rows.insert(rng.randrange(len(rows) + 1), None)
        full = []
        for r in rows:
            if r is None:
                p = rng.choice(fillers)
                full.append(SampleRow(SamplingState(p, rng.randrange(1 << 40), [1, 2, 3], 1, END, EOS)))
                logits.insert(len(full) - 1, torch.randint(-3, 4, (vocab,), generator=g).float()
                              if rng.random() < 0.5 else torch.randn(vocab, generator=g) * 3)
            else:
                full.append(r)
        out = Sampler()(torch.stack(logits), full, with_outputs=with_outputs)
        got = [t for r, t in zip(full, out.token_ids) if any(r.state.seed == tr[3] for tr in tracked)]
        return got

    everyone = list(range(len(tracked)))
    assert run(everyone, 0) == expected
    assert run(everyone[::-1], 0) == expected[::-1]
    assert run(everyone, 0, with_outputs=False) == expected
    for i in everyone:
        assert run([i], 0) == [expected[i]]
        assert run([i], 3) == [expected[i]]
    for _ in range(6):
        subset = rng.sample(everyone, rng.randint(2, len(everyone)))
        assert run(subset, rng.randint(0, 8)) == [expected[i] for i in subset]


def test_the_draw_depends_on_seed_and_position():
    """The reference check above is strict: the draw at a neighbouring position, or another seed, is
    (for most rows) another token."""
    tracked = _seed_rows()
    moved = 0
    for p, logits, history, seed in tracked:
        if p.is_greedy:
            continue
        ref = reference_row(logits, history, 10, p)
        if (~torch.isneginf(ref)).sum() < 2:
            continue
        here = reference_draw(ref, seed, len(history), False)
        moved += here != reference_draw(ref, seed, len(history) + 1, False)
        moved += here != reference_draw(ref, seed + 1, len(history), False)
    assert moved >= 6


@pytest.mark.parametrize("vocab", [1000, 1024, 3001, 4096])
def test_full_vocabulary_draws_are_the_reference_inverse_cdf(vocab):
    """Full-vocabulary rows (no top-k / top-p: the chunked two-level CDF over the whole row, padded or
    not): 300 seeds, each token the float64 reference inverse CDF."""
    g = torch.Generator().manual_seed(vocab)
    row = torch.randn(vocab, generator=g) * 1.5
    n = 300
    states = [SamplingState(S(temperature=1.0, min_p=0.0), 77 + j, [1, 2, 3], 3) for j in range(n)]
    got = Sampler()(row.expand(n, -1).clone(), [SampleRow(s) for s in states], with_outputs=False).token_ids
    want = [reference_draw(row, 77 + j, 3, False) for j in range(n)]
    assert got == want  # fp32 vs float64 CDF: only a u within ~1e-7 of a boundary could differ
    assert len(set(got)) > 100


def _seeds_with(condition, position: int, count: int) -> list[int]:
    found, seed = [], 0
    while len(found) < count:
        if condition(uniform(seed, position)):
            found.append(seed)
        seed += 1
    return found


@pytest.mark.parametrize("form", ["top_k", "min_p", "full"])
def test_extreme_uniforms_pick_the_first_and_last_kept_tokens(form):
    """u near 0 picks the first kept token in id order, u near 1 the last (even with every higher id
    dropped, so the last chunks of the CDF are empty), in support form (top-k) and full-vocabulary
    form (min-p, plain)."""
    vocab, position = 3000, 3
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(9)) - 20.0
    kept = [10, 300, 301, 1500, 1700]
    row[kept] = torch.tensor([1.0, 2.0, 0.5, 1.5, 0.8])
    params = {"top_k": S(temperature=1.0, top_k=5), "min_p": S(temperature=1.0, min_p=0.01),
              "full": S(temperature=1.0)}[form]
    low = _seeds_with(lambda u: u < 2e-4, position, 3)
    high = _seeds_with(lambda u: u > 1 - 2e-4, position, 3)
    states = [SamplingState(params, seed, [1, 2, 3], 3) for seed in low + high]
    out = Sampler()(row.expand(len(states), -1).clone(), [SampleRow(s) for s in states])
    ref = reference_row(row, [1, 2, 3], 3, params)
    assert out.token_ids == [reference_draw(ref, s.seed, position, False) for s in states]
    if form != "full":  # the full row keeps every token: its first and last are 0 and vocab - 1
        assert out.token_ids == [kept[0]] * 3 + [kept[-1]] * 3
