"""Sampling through the Engine on a tiny model: the tokens it draws follow the processed distribution
(chi-square), n samples are independent draws that share the prompt's blocks and its one prefill,
logprobs / prompt logprobs / scores equal what transformers' processors and log_softmax give, and a
seeded request draws the same tokens whatever shares its batch, with or without speculation."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged import Engine, SamplingParams
from stats import chi2_critical, chi2_statistic
from tiny_models import VOCAB, CharTokenizer, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "hf_paged")


@pytest.fixture(scope="module")
def stock():
    return tiny_model("llama", "sdpa")


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_processors(temperature, top_k=0, top_p=1.0, repetition_penalty=1.0):
    procs = LogitsProcessorList()
    if repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    procs.append(TemperatureLogitsWarper(temperature))
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs


def _stock_next_probs(stock, prompt, **settings) -> torch.Tensor:
    """softmax of what transformers' processors make of stock's next-token logits."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = stock(ids).logits[:, -1].float()
    return _hf_processors(**settings)(ids, logits)[0].softmax(-1)


SETTINGS = dict(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3)


def test_sampled_tokens_follow_the_processed_distribution(model, stock):
    prompt = _prompt(20)
    probs = _stock_next_probs(stock, prompt, **SETTINGS)
    engine = Engine(model, max_num_seqs=256, num_blocks=512)
    outs = engine.generate([prompt] * 2000, [SamplingParams(max_new_tokens=1, seed=s, **SETTINGS) for s in range(2000)])
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs]), minlength=VOCAB)
    stat, df = chi2_statistic(counts, probs)
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df}"
    # Power: the unprocessed distribution is rejected by the same statistic.
    stat, df = chi2_statistic(counts, _stock_next_probs(stock, prompt, temperature=1.0))
    assert stat > chi2_critical(df)


def _binned(tokens: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Each token's category: its index among `top`, or len(top) for any other token."""
    match = tokens[:, None] == top[None, :]
    return torch.where(match.any(-1), match.int().argmax(-1), torch.full_like(tokens, len(top)))


def _independence_stat(a: torch.Tensor, b: torch.Tensor, categories: int) -> tuple[float, int]:
    table = torch.zeros(categories, categories, dtype=torch.float64)
    table.index_put_((a, b), torch.ones(len(a), dtype=torch.float64), accumulate=True)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    keep = expected > 0
    return float((((table - expected) ** 2)[keep] / expected[keep]).sum()), (categories - 1) ** 2


def test_n_samples_are_independent_draws_of_the_processed_distribution(model, stock):
    prompt = _prompt(20, seed=1)
    probs = _stock_next_probs(stock, prompt, **SETTINGS)
    engine = Engine(model, max_num_seqs=256, num_blocks=512)
    outs = engine.generate([prompt] * 800, [SamplingParams(n=4, max_new_tokens=1, seed=s, **SETTINGS)
                                            for s in range(800)])
    tokens = torch.tensor([[c.token_ids[0] for c in o.outputs] for o in outs])  # [800, 4]
    assert all(len(o.outputs) == 4 and o.finished for o in outs)
    for j in range(4):  # every sample index has the processed distribution
        stat, df = chi2_statistic(torch.bincount(tokens[:, j], minlength=VOCAB), probs)
        assert stat < chi2_critical(df), f"sample {j}: chi2={stat:.1f} df={df}"
    top = probs.topk(4).indices
    cats = [_binned(tokens[:, j], top) for j in range(4)]
    for i, j in [(0, 1), (1, 2), (0, 3)]:  # pairs of samples are independent (contingency test)
        stat, df = _independence_stat(cats[i], cats[j], len(top) + 1)
        assert stat < chi2_critical(df), f"samples {i},{j}: chi2={stat:.1f} df={df}"
    # Power: perfectly dependent pairs (a sample with itself) are rejected.
    stat, df = _independence_stat(cats[0], cats[0], len(top) + 1)
    assert stat > chi2_critical(df)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_n_samples_share_the_prompt_blocks_and_its_one_prefill(model, enable_prefix_caching):
    """n = 8 on a 500-token prompt: after the prefill the pool holds the prompt's 32 blocks once; after
    the first decode step, its 31 full blocks are still shared and each sample has its own copy of the
    partial last block (copy-on-write). The model was fed the prompt once, then 8 tokens per step."""
    prompt, n, bs = _prompt(500, seed=2), 8, 16
    engine = Engine(model, block_size=bs, num_blocks=128, max_num_batched_tokens=2048,
                    enable_prefix_caching=enable_prefix_caching)
    rid = engine.add_request(prompt, SamplingParams(n=n, max_new_tokens=4, temperature=1.0, seed=0))
    engine.step()
    pool = engine.cache.pool
    assert engine.metrics()["num_forward_tokens"] == 500
    assert pool.num_used_blocks == -(-500 // bs) == 32
    engine.step()
    assert engine.metrics()["num_forward_tokens"] == 500 + n
    assert pool.num_used_blocks == 500 // bs + n  # 31 shared full blocks + 8 partial copies
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.request_id == rid and final.finished and len(final.outputs) == n
    assert [c.index for c in final.outputs] == list(range(n))
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # different seeds, different samples
    assert engine.metrics()["num_forward_tokens"] == 500 + 3 * n
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


def test_logprobs_scores_and_logits_equal_the_processed_distribution(model):
    """Per generated token: output_logits is the raw row; output_scores and the logprobs equal
    transformers' processors applied to it (log_softmax to 1e-5, fp32)."""
    prompt = _prompt(15, seed=3)
    params = SamplingParams(max_new_tokens=6, seed=5, logprobs=5, output_scores=True, output_logits=True, **SETTINGS)
    raw_mode = SamplingParams(**{**params.__dict__, "logprobs_mode": "raw"})
    engine = Engine(model)
    out, raw_out = engine.generate([prompt, prompt], [params, raw_mode])
    assert out.token_ids == raw_out.token_ids  # the same seed draws the same tokens in either mode
    sample = out.outputs[0]
    history = list(prompt)
    for t, token in enumerate(sample.token_ids):
        raw = sample.logits[t]
        processed = _hf_processors(**SETTINGS)(torch.tensor([history]), raw[None].clone())[0]
        assert torch.equal(torch.isinf(sample.scores[t]), torch.isinf(processed))
        finite = ~torch.isinf(processed)
        torch.testing.assert_close(sample.scores[t][finite], processed[finite], atol=1e-6, rtol=1e-6)
        for entry, dist in ((sample.logprobs[t], processed.log_softmax(-1)),
                            (raw_out.outputs[0].logprobs[t], raw.log_softmax(-1))):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(dist[token].item(), abs=1e-5)
            assert entry.rank == int((dist > dist[token]).sum()) + 1
            top = dist.topk(5)
            assert [tok for tok, _ in entry.top] == top.indices.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)
        history.append(token)
    assert out.logprobs is sample.logprobs


def test_prompt_logprobs_equal_stock_log_softmax_even_when_the_prompt_is_cached(model, stock):
    prompt = _prompt(30, seed=4)
    with torch.no_grad():
        ref = stock(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    engine = Engine(model, block_size=4, max_num_batched_tokens=7)  # chunked prefill
    engine.generate(prompt, SamplingParams(max_new_tokens=2))  # the prompt is now in the prefix cache
    before = engine.metrics()["num_forward_tokens"]
    out = engine.generate(prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=3))[0]
    assert engine.metrics()["num_forward_tokens"] - before == len(prompt) + 1  # no prefix-cache hit
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for t in range(1, len(prompt)):
        dist = ref[t - 1]  # position t - 1 predicts token t
        assert lps[t].token_id == prompt[t]
        assert lps[t].logprob == pytest.approx(dist[prompt[t]].item(), abs=1e-4)  # fp32, different kernels
        assert [tok for tok, _ in lps[t].top] == dist.topk(3).indices.tolist()


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch(model):
    prompt = _prompt(25, seed=6)
    params = SamplingParams(max_new_tokens=10, seed=42, temperature=1.1, top_p=0.95, presence_penalty=0.5,
                            frequency_penalty=0.3, no_repeat_ngram_size=2, logit_bias={5: 2.0})
    alone = Engine(model).generate(prompt, params)[0].token_ids
    others = [SamplingParams(max_new_tokens=7, seed=s, temperature=0.7 + 0.1 * s, top_k=5 * s, min_p=0.05 * s,
                             repetition_penalty=1.0 + 0.1 * s) for s in range(5)]
    mixed = Engine(model, max_num_batched_tokens=40).generate(
        [_prompt(9 + s, seed=s) for s in range(3)] + [prompt] + [_prompt(4, seed=9)] * 2,
        others[:3] + [params] + others[3:])
    assert mixed[3].token_ids == alone
    speculative = Engine(model, speculative_method="ngram", num_speculative_tokens=3).generate(prompt, params)[0]
    assert speculative.token_ids == alone


def test_speculative_sampling_keeps_tokens_and_logprobs(model):
    """Verification samples the target's rows with the same processors (the drafts as history): the
    committed tokens and their logprobs equal the non-speculative run's."""
    prompt = (_prompt(6, seed=7) * 5)[:28]  # repetitive, so prompt lookup drafts
    params = SamplingParams(max_new_tokens=16, seed=3, temperature=0.8, top_k=30, repetition_penalty=1.2,
                            min_new_tokens=10, logprobs=2)
    plain = Engine(model).generate(prompt, params)[0]
    engine = Engine(model, speculative_method="ngram", num_speculative_tokens=4)
    spec = engine.generate(prompt, params)[0]
    assert spec.token_ids == plain.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert engine.metrics().get("vllm:spec_decode_num_draft_tokens", 0) > 0


def test_streamed_samples_and_aborting_every_sample(model):
    tok = CharTokenizer()
    engine = Engine(model, tok)
    params = SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=1)
    events = list(engine.stream("hello world", params))
    ends = [e for e in events if e.finish_reason is not None]
    assert sorted(e.sample_index for e in ends) == [0, 1, 2]
    final = engine.generate("hello world", params)[0]
    for j, sample in enumerate(final.outputs):
        mine = [e for e in events if e.sample_index == j]
        assert [e.token_id for e in mine if e.token_id is not None] == sample.token_ids
        assert "".join(e.text or "" for e in mine) == sample.text
    rid = engine.add_request("hello world", SamplingParams(n=4, max_new_tokens=50, temperature=1.0))
    engine.step()
    engine.step()
    aborted = engine.abort(rid)
    assert aborted.finished and [c.finish_reason for c in aborted.outputs] == ["abort"] * 4
    assert not engine.has_unfinished_requests()
    assert engine.cache.pool.num_free_blocks == engine.cache.pool.num_blocks


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("min_p", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", float("nan")),
    ("logit_bias", {VOCAB: 1.0}), ("bad_words_ids", [[]]), ("no_repeat_ngram_size", -1), ("logprobs", 100),
    ("prompt_logprobs", -1), ("logprobs_mode", "softmax"),
])
def test_bad_sampling_settings_are_rejected_by_name(model, field, value):
    engine = Engine(model)
    with pytest.raises((ValueError, TypeError), match=field):
        engine.add_request([5, 6, 7], SamplingParams(**{field: value}))
    assert not engine.has_unfinished_requests()


def test_n_samples_beyond_max_num_seqs_wait_and_recompute(model):
    """Samples that find no running slot wait; they recompute the prompt (prefix-cache hits for its
    full blocks) and draw their own first token. Each sample equals the same sample run on an engine
    with room for all (its draws depend on its seed and position only)."""
    prompt = _prompt(40, seed=8)
    params = SamplingParams(n=5, max_new_tokens=5, temperature=1.0, seed=11)
    roomy = Engine(model, block_size=4).generate(prompt, params)[0]
    engine = Engine(model, block_size=4, max_num_seqs=2)
    tight = engine.generate(prompt, params)[0]
    assert [c.token_ids for c in tight.outputs] == [c.token_ids for c in roomy.outputs]
    assert engine.metrics()["vllm:prefix_cache_hits"] > 0
    assert engine.cache.pool.num_free_blocks == engine.cache.pool.num_blocks


def test_penalty_state_is_incremental_and_matches_a_rebuild():
    from hf_paged.worker import SamplingState

    params = SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5, no_repeat_ngram_size=2)
    tokens = [5, 6, 5, 7]
    state = SamplingState(params, 0, tokens, 2)
    for new in ([6], [6, 9], [5]):
        tokens.extend(new)
        state.sync()
        ids, counts = state.penalty_arrays((9, 4))
        fresh = SamplingState(params, 0, tokens + [9, 4], 2)
        fresh.sync()
        ref_ids, ref_counts = fresh.penalty_arrays()
        assert dict(zip(ids.tolist(), counts.tolist())) == dict(zip(ref_ids.tolist(), ref_counts.tolist()))
        assert sorted(state.banned_tokens((9, 4))) == sorted(fresh.banned_tokens())
