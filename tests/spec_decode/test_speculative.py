"""Speculative decoding: the verification functions on their own, lossless greedy and sampling in the
engine, rollback without leaks, and the drop-in `generate(assistant_model=...)` for batches."""

from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_paged import Engine, SamplingParams
from hf_paged.spec_decode import (
    NgramProposer,
    expected_tokens_per_forward,
    layer_skip_draft,
    target_tokens,
    verify_greedy,
)
from hf_paged.worker import SamplingState, sample_processed
from stats import chi2_critical, chi2_statistic
from tiny_models import VOCAB, stock_greedy, tiny_model

NEW = 16
# ---------------------------------------------------------------------------------------- pure functions
def test_verify_greedy_prefix_bonus_and_first_mismatch():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # stops at the first mismatch
    assert verify_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]  # none accepted: the target's own token
    assert verify_greedy([3], []) == [3]
    with pytest.raises(ValueError, match="k \\+ 1"):
        verify_greedy([1, 2], [1, 2])


def _random_dists(k: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, dim=-1)
    drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
    return p, q, drafts


def _verify_sampled(p: torch.Tensor, drafts: list[int], seed: int) -> list[int]:
    """The engine's sampled verification on given target probabilities ([k + 1, vocab])."""
    state = SamplingState(params=SamplingParams(temperature=1.0), seed=seed, token_ids=[0], num_prompt_tokens=1,
                          end_token_ids=[])
    return verify_greedy(target_tokens(p.log(), state, drafts), drafts)


def _coupled_draft(q: torch.Tensor, seed: int) -> list[int]:
    """Drafts sampled from q with the target's keyed noise at the same positions (as the draft-model
    proposer does)."""
    return [sample_processed(q[j].log(), SamplingState(params=SamplingParams(temperature=1.0), seed=seed,
                                                       token_ids=[0] * (1 + j), num_prompt_tokens=1,
                                                       end_token_ids=[]))
            for j in range(q.shape[0])]


@pytest.mark.parametrize("one_hot", [False, True])
def test_sampled_verification_matches_the_target_distribution(one_hot):
    """First emitted token ~ p_0 and, given it equals draft 1, the second ~ p_1, whatever the drafts
    are: drafts coupled to the target's noise (a draft model), or fixed / random ones (prompt lookup).
    8k trials, one seed each: power at significance 0.001 (noncentral chi-square) above 0.9999 against
    the classic defect, a rejected draft resampled from p instead of the residual (first token: noncentrality
    ~360; second token, ~370 trials given draft 1 accepted: ~70), and the draft's own law far beyond."""
    vocab, k, trials = 6, 2, 8000
    p, q, _ = _random_dists(k, vocab, seed=3)
    g = torch.Generator().manual_seed(11)
    first = torch.zeros(vocab, dtype=torch.long)
    second_given = torch.zeros(vocab, dtype=torch.long)
    fixed_d1 = 2
    for seed in range(trials):
        if one_hot:
            drafts = [fixed_d1, int(torch.randint(vocab, (1,), generator=g))]
        else:
            drafts = _coupled_draft(q, seed)
        out = _verify_sampled(p, drafts, seed)
        assert 1 <= len(out) <= k + 1
        first[out[0]] += 1
        if len(out) > 1 and out[0] == drafts[0] == fixed_d1:
            second_given[out[1]] += 1
    stat, df = chi2_statistic(first, p[0])
    assert stat < chi2_critical(df), f"first token: chi2={stat:.1f} df={df}"
    stat, df = chi2_statistic(second_given, p[1])
    assert stat < chi2_critical(df), f"second token: chi2={stat:.1f} df={df}"
    # The same test rejects the draft's distribution: it has the power to fail.
    if not one_hot:
        stat, df = chi2_statistic(first, q[0])
        assert stat > chi2_critical(df)


def test_sampled_verification_accepts_everything_when_draft_equals_target():
    p, _, _ = _random_dists(3, 8, seed=5)
    for seed in range(50):
        drafts = _coupled_draft(p[:3], seed)
        out = _verify_sampled(p, drafts, seed)
        assert out[:3] == drafts and len(out) == 4


def test_sampled_verification_equals_sampling_without_drafts():
    """Whatever the drafts, each committed token is the one the request samples without speculation
    at that position: a seeded request's output cannot depend on how many drafts it got."""
    p, q, _ = _random_dists(3, 8, seed=7)
    for seed in range(200):
        for drafts in (_coupled_draft(q, seed), [1, 2, 3], []):
            out = _verify_sampled(p[: len(drafts) + 1], drafts, seed)
            expected = [sample_processed(p[j].log(), SamplingState(
                params=SamplingParams(temperature=1.0), seed=seed, token_ids=[0] * (1 + j), num_prompt_tokens=1,
                end_token_ids=[])) for j in range(len(out))]
            assert out == expected


def test_ngram_lookup():
    prop = NgramProposer(min_ngram=1, max_ngram=3)
    assert prop.lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert prop.lookup([7, 1, 2, 9, 1, 2, 8, 1, 2], 2) == [8, 1]  # latest earlier occurrence
    assert prop.lookup([1, 2, 3], 2) == []  # nothing repeats
    assert prop.lookup([5], 4) == []
    with pytest.raises(ValueError):
        NgramProposer(min_ngram=0)


def test_closed_form():
    assert expected_tokens_per_forward(0.8, 5) == pytest.approx(3.6893, abs=1e-4)
    assert expected_tokens_per_forward(1.0, 5) == 6
    assert expected_tokens_per_forward(0.0, 5) == 1


# ---------------------------------------------------------------------------------------- engine, greedy
def _prompts():
    g = torch.Generator().manual_seed(0)
    base = torch.randint(3, VOCAB, (12,), generator=g).tolist()
    # Repetitive prompts give prompt lookup something to find; random ones give it nothing.
    return [base * 4, base * 2 + [5, 6, 7], torch.randint(3, VOCAB, (30,), generator=g).tolist(), [9], base[:5]]


def _stock(arch, prompts):
    return stock_greedy(arch, prompts, max_new_tokens=NEW, min_new_tokens=NEW)


def _no_leaks(engine):
    for pool in [engine.cache.pool] + ([engine.proposer.cache.pool] if hasattr(engine.proposer, "cache") else []):
        assert pool.num_free_blocks == pool.num_blocks
        pool.check_invariants()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_is_lossless(arch, k):
    prompts = _prompts()
    stock = _stock(arch, prompts)
    model = tiny_model(arch, "hf_paged")
    drafts = {
        "ngram": dict(speculative_method="ngram"),
        "random_draft": dict(draft_model=tiny_model(arch, "hf_paged", seed=1)),  # rejects nearly everything
        "self_draft": dict(draft_model=tiny_model(arch, "hf_paged")),  # accepts everything: the bonus path
        "layer_skip": dict(draft_model=layer_skip_draft(model, 2)),
    }
    for name, kwargs in drafts.items():
        engine = Engine(model, num_speculative_tokens=k, block_size=4, **kwargs)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
        assert [o.token_ids for o in outs] == stock, f"{arch}/{name}/k={k}"
        spec = engine.metrics()
        assert spec["vllm:spec_decode_num_drafts"] > 0, name
        if name == "self_draft":
            assert spec["alpha"] == 1.0 and spec["tokens_per_target_forward"] > 0.8 * (k + 1)
        if name == "random_draft":
            assert spec["alpha"] < 0.2
        _no_leaks(engine)


def test_speculation_under_preemption_and_mixed_with_plain_requests():
    prompts = _prompts()
    stock = _stock("llama", prompts)
    model = tiny_model("llama", "hf_paged")
    engine = Engine(model, speculative_method="ngram", num_speculative_tokens=4, block_size=4, num_blocks=24,
                    max_num_batched_tokens=32)
    params = [SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, num_speculative_tokens=0 if i % 2 else None)
              for i in range(len(prompts))]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == stock
    m = engine.metrics()
    assert m["vllm:num_preemptions"] > 0 and m["vllm:spec_decode_num_drafts"] > 0
    _no_leaks(engine)


def test_speculative_metrics_and_closed_form():
    prompts = _prompts()
    engine = Engine(tiny_model("llama", "hf_paged"), speculative_method="ngram", num_speculative_tokens=3)
    engine.generate(prompts, SamplingParams(max_new_tokens=40, min_new_tokens=40))
    m = engine.metrics()
    assert m["vllm:spec_decode_num_draft_tokens"] >= m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert sum(m["vllm:spec_decode_num_accepted_tokens_per_pos"]) == m["vllm:spec_decode_num_accepted_tokens"]
    per_pos = m["acceptance_rate_per_pos"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # a later draft is accepted only after the earlier
    assert m["tokens_per_target_forward"] == pytest.approx(
        1 + m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_drafts"])
    assert m["predicted_tokens_per_target_forward"] > 1


def test_engine_speculative_config_errors():
    model = tiny_model("llama", "hf_paged")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(model, speculative_method="ngram", num_speculative_tokens=16)
    with pytest.raises(ValueError, match="speculative_method"):
        Engine(model, speculative_method="medusa")
    with pytest.raises(ValueError, match="draft_model"):
        Engine(model, speculative_method="draft_model")
    with pytest.raises(ValueError, match="num_speculative_tokens needs"):
        Engine(model, num_speculative_tokens=3)
    engine = Engine(model, speculative_method="ngram")
    out = engine.generate([[5, 6]], SamplingParams(num_speculative_tokens=-1))[0]
    assert out.finish_reason == "error" and "num_speculative_tokens" in str(out.error)


# ---------------------------------------------------------------------------------------- engine, sampling
def _small_vocab_model(seed: int):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=1, eos_token_id=11, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="hf_paged").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # a peaked-enough distribution that the draft differs from it
    return model


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculative_sampling_distribution_matches_the_target(method):
    """3000 seeded requests sample three tokens. The first comes from the prefill; the second and third
    from speculative verification (first and second verified positions). The joint (t1, t2) must match
    the target's exact p(t1) p(t2 | t1), and t3 given the most frequent (t1, t2) its p(t3 | t1, t2)
    (chi-square, significance 0.001)."""
    target = _small_vocab_model(0)
    prompt = [3, 5, 3, 5, 3]
    vocab, n = 12, 3000
    with torch.no_grad():
        p1 = target(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        p2 = target(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1].softmax(-1)  # [t1, t2]
    joint = (p1[:, None] * p2).flatten()
    kwargs = dict(draft_model=_small_vocab_model(1)) if method == "draft_model" else dict(speculative_method="ngram")
    engine = Engine(target, num_speculative_tokens=2, max_num_seqs=512, **kwargs)
    params = [SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0, seed=s) for s in range(n)]
    outs = engine.generate([prompt] * n, params)
    counts = torch.zeros(vocab * vocab, dtype=torch.long)
    for o in outs:
        counts[o.token_ids[0] * vocab + o.token_ids[1]] += 1
    stat, df = chi2_statistic(counts, joint)
    assert stat < chi2_critical(df), f"(t1, t2): chi2={stat:.1f} df={df} critical={chi2_critical(df):.1f}"
    top = int(counts.argmax())
    a, b = divmod(top, vocab)
    with torch.no_grad():
        p3 = target(torch.tensor([prompt + [a, b]])).logits[0, -1].softmax(-1)
    third = torch.zeros(vocab, dtype=torch.long)
    for o in outs:
        if o.token_ids[:2] == [a, b]:
            third[o.token_ids[2]] += 1
    stat, df = chi2_statistic(third, p3)
    assert stat < chi2_critical(df), f"t3 | ({a}, {b}): chi2={stat:.1f} df={df}"
    m = engine.metrics()
    assert m["vllm:spec_decode_num_drafts"] > 0 and m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] < m["vllm:spec_decode_num_draft_tokens"]  # rejections too
    _no_leaks(engine)
    # Power: the same statistic rejects a wrong second-token law (uniform).
    wrong = (p1[:, None] * torch.full((vocab, vocab), 1 / vocab)).flatten()
    assert chi2_statistic(counts, wrong)[0] > chi2_critical(chi2_statistic(counts, wrong)[1])


def test_seeded_speculative_sampling_is_reproducible():
    prompts = _prompts()
    model = tiny_model("llama", "hf_paged")
    params = SamplingParams(max_new_tokens=NEW, temperature=0.9, seed=5)
    a = Engine(model, speculative_method="ngram").generate(prompts, params)
    b = Engine(model, speculative_method="ngram").generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


# ---------------------------------------------------------------------------------------- drop-in generate
def test_generate_with_assistant_or_prompt_lookup_for_a_batch():
    from tiny_models import left_padded_batch

    input_ids, attention_mask = left_padded_batch([5, 17, 33, 16], seed=1)
    input_ids[2, -20:] = input_ids[2, -33:-13].clone()  # something for prompt lookup to find
    stock = tiny_model("llama", "sdpa")
    ref = stock.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=NEW)
    model = tiny_model("llama", "hf_paged")
    for kwargs in (dict(assistant_model=tiny_model("llama", "hf_paged", seed=2)), dict(prompt_lookup_num_tokens=3),
                   dict(assistant_model=layer_skip_draft(model, 1), num_assistant_tokens=4)):
        out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=NEW, **kwargs)
        assert torch.equal(out, ref), kwargs


def test_a_seeded_request_samples_the_same_tokens_with_any_number_of_drafts():
    """Counter-based draws: plain decoding, prompt lookup with k = 1 or 4, a draft model, a tight
    token budget that cuts drafts short, and batch mates all give the seeded request the same tokens."""
    prompts = _prompts()
    model = tiny_model("llama", "hf_paged")
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=1.0, seed=77)
    others = [SamplingParams(max_new_tokens=NEW + i, temperature=0.8, seed=i) for i in range(len(prompts) - 1)]
    alone = Engine(model).generate(prompts[:1], params)[0].token_ids
    setups = [dict(speculative_method="ngram", num_speculative_tokens=1),
              dict(speculative_method="ngram", num_speculative_tokens=4),
              dict(speculative_method="ngram", num_speculative_tokens=4, max_num_batched_tokens=9),
              dict(draft_model=tiny_model("llama", "hf_paged", seed=3), num_speculative_tokens=3)]
    for setup in setups:
        engine = Engine(model, **setup)
        assert engine.generate(prompts[:1], params)[0].token_ids == alone, setup
        batched = engine.generate(prompts, [params] + others)
        assert batched[0].token_ids == alone, setup
        assert engine.metrics()["vllm:spec_decode_num_drafts"] > 0
