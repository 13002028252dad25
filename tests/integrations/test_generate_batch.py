"""`model.generate_batch` (transformers' continuous-batching API) on an hf_paged model is served by
the engine with transformers' signature and return type, plus logprobs; repeated prompts (in
`generate_batch` and in a plain `generate` batch, as RL trainers build them) share their blocks."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

import hf_paged  # installs the patches
import hf_paged.integrations.generate_batch as generate_batch
from tiny_models import VOCAB, stock_greedy, tiny_model

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked

PROMPTS = [[5, 9, 33, 7, 81, 12], [44, 17, 3], [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102]]
GREEDY = GenerationConfig(do_sample=False, max_new_tokens=8, eos_token_id=2, pad_token_id=0)
# transformers' own manager, sized for these three short prompts: its default sizes the cache to a share of
# host memory, which takes 5-12 s here; the size changes no token (hf_paged's side sizes its own pool).
STOCK_CB = ContinuousBatchingConfig(auto_switch_to_flash=False, num_blocks=8, max_batch_tokens=64)


@pytest.fixture
def served(monkeypatch):
    """How many prompts each engine-served `generate_batch` call had."""
    calls = []
    original = generate_batch.engine_generate_batch

    def spy(model, inputs, *args, **kwargs):
        calls.append(len(inputs))
        return original(model, inputs, *args, **kwargs)

    monkeypatch.setattr(generate_batch, "engine_generate_batch", spy)
    return calls


def _completion(stock_tokens: list[int]) -> list[int]:
    """Stock generate's new tokens up to its first EOS (included): what generate_batch returns."""
    return stock_tokens[: stock_tokens.index(2) + 1] if 2 in stock_tokens else stock_tokens


def test_greedy_outputs_equal_stock_in_transformers_return_type(served):
    model = tiny_model("llama", "hf_paged")
    out = model.generate_batch(PROMPTS, generation_config=GREEDY)
    assert served == [3]
    assert list(out) == ["req_0", "req_1", "req_2"]
    expected = stock_greedy("llama", PROMPTS, max_new_tokens=8, eos_token_id=2, pad_token_id=0)
    for (request_id, result), prompt, stock in zip(out.items(), PROMPTS, expected):
        assert isinstance(result, GenerationOutput) and result.request_id == request_id
        assert result.status == RequestStatus.FINISHED and result.error is None and result.is_finished()
        assert result.prompt_ids == prompt
        assert result.generated_tokens == _completion(stock)
        assert len(result.logprobs) == len(result.generated_tokens)
    assert model.config._attn_implementation == "hf_paged"  # nothing swapped in, nothing left behind


def test_greedy_outputs_equal_transformers_own_generate_batch():
    stock = tiny_model("llama", "sdpa")
    ref = stock.generate_batch(PROMPTS, generation_config=GREEDY, continuous_batching_config=STOCK_CB)
    out = tiny_model("llama", "hf_paged").generate_batch(PROMPTS, generation_config=GREEDY,
                                                          continuous_batching_config=STOCK_CB)
    assert list(out) == list(ref)
    assert [r.generated_tokens for r in out.values()] == [r.generated_tokens for r in ref.values()]


def test_logprobs_are_each_generated_tokens_processed_log_probability_when_sampling():
    """Under temperature 0.7 the processed distribution differs from the raw one: log_softmax(logits / T)."""
    model, stock = tiny_model("llama", "hf_paged"), tiny_model("llama", "sdpa")
    gc = GenerationConfig(do_sample=True, temperature=0.7, top_k=0, max_new_tokens=6, pad_token_id=0)
    out = model.generate_batch(PROMPTS[:1], generation_config=gc)["req_0"]
    ids = torch.tensor([PROMPTS[0] + out.generated_tokens])
    with torch.no_grad():
        logits = stock(ids).logits[0, len(PROMPTS[0]) - 1: -1].float()  # the rows that drew each token
    tokens = torch.tensor(out.generated_tokens)
    processed = torch.log_softmax(logits / 0.7, -1)[torch.arange(len(tokens)), tokens]
    raw = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
    torch.testing.assert_close(torch.tensor(out.logprobs), processed, atol=1e-4, rtol=0)
    assert not torch.allclose(processed, raw, atol=1e-3)


def test_the_config_is_read_as_transformers_reads_it():
    """The config passed is used as is (no merge of the model's `do_sample=True` or global defaults),
    `max_new_tokens` of the call wins, and no `max_new_tokens` means no limit but the model's."""
    stock, ours = tiny_model("llama", "sdpa"), tiny_model("llama", "hf_paged")
    for model in (stock, ours):
        model.generation_config.do_sample = True  # the passed config leaves do_sample unset: greedy
    partial = GenerationConfig(eos_token_id=None, pad_token_id=0)
    ref = stock.generate_batch(PROMPTS, generation_config=partial, continuous_batching_config=STOCK_CB,
                               max_new_tokens=7)
    out = ours.generate_batch(PROMPTS, generation_config=partial, continuous_batching_config=STOCK_CB,
                              max_new_tokens=7)
    assert [r.generated_tokens for r in out.values()] == [r.generated_tokens for r in ref.values()]
    assert all(len(r.generated_tokens) == 7 for r in out.values())
    ours.config.max_position_embeddings = 40  # the model's limit (the default 512 would take long)
    unbounded = ours.generate_batch([PROMPTS[2]], generation_config=partial)["req_0"]
    assert unbounded.status == RequestStatus.FINISHED
    assert len(PROMPTS[2]) + len(unbounded.generated_tokens) == ours.config.max_position_embeddings


def test_the_model_runs_in_eval_mode_and_keeps_its_training_mode():
    """TRL calls generate_batch on a model in training mode: transformers' manager switches to eval;
    so does hf_paged (attention dropout would be refused by the paged kernels), restoring it after."""
    from transformers import AutoModelForCausalLM

    from tiny_models import CONFIGS

    config = CONFIGS["llama"]()
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="hf_paged").train()
    out = model.generate_batch(PROMPTS, generation_config=GREEDY)
    assert all(r.status == RequestStatus.FINISHED for r in out.values())
    assert model.training


def test_the_pool_is_freed_after_the_call_unless_persistent():
    model = tiny_model("llama", "hf_paged")
    model.generate_batch(PROMPTS, generation_config=GREEDY)
    assert not hf_paged.release(model)  # nothing left held
    model.generate_batch(PROMPTS, generation_config=GREEDY, persistent_manager=True)
    assert hf_paged.release(model)


def test_logprobs_are_each_generated_tokens_processed_log_probability():
    model = tiny_model("llama", "hf_paged")
    stock = tiny_model("llama", "sdpa")
    out = model.generate_batch(PROMPTS[:1], generation_config=GREEDY)["req_0"]
    ids = torch.tensor([PROMPTS[0]])
    ref = stock.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GREEDY, output_scores=True,
                         return_dict_in_generate=True)
    expected = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(ref.scores, out.generated_tokens)]
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
    assert all(lp <= 0 for lp in out.logprobs)


def test_num_return_sequences_children_come_before_their_parent_and_seed_reproduces():
    model = tiny_model("llama", "hf_paged")
    gc = GenerationConfig(do_sample=True, num_return_sequences=3, max_new_tokens=6, eos_token_id=2, pad_token_id=0)
    seeded = ContinuousBatchingConfig(seed=7)
    out = model.generate_batch(PROMPTS[:2], generation_config=gc, continuous_batching_config=seeded)
    assert list(out) == ["req_0__child#0", "req_0__child#1", "req_0", "req_1__child#0", "req_1__child#1", "req_1"]
    assert all(r.prompt_ids == PROMPTS[int(k[4])] for k, r in out.items())
    again = model.generate_batch(PROMPTS[:2], generation_config=gc, continuous_batching_config=seeded)
    assert [r.generated_tokens for r in again.values()] == [r.generated_tokens for r in out.values()]
    other = model.generate_batch(PROMPTS[:2], generation_config=gc,
                                 continuous_batching_config=ContinuousBatchingConfig(seed=8))
    assert [r.generated_tokens for r in other.values()] != [r.generated_tokens for r in out.values()]
    assert len({tuple(out[k].generated_tokens) for k in ("req_0__child#0", "req_0__child#1", "req_0")}) > 1


def test_a_bad_prompt_fails_alone():
    model = tiny_model("llama", "hf_paged")
    out = model.generate_batch([PROMPTS[0], [], [5, VOCAB + 3], PROMPTS[1]], generation_config=GREEDY)
    assert [r.status for r in out.values()] == [RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.FAILED,
                                                RequestStatus.FINISHED]
    assert "empty" in out["req_1"].error and str(VOCAB + 3) in out["req_2"].error
    expected = stock_greedy("llama", [PROMPTS[0], PROMPTS[1]], max_new_tokens=8, eos_token_id=2, pad_token_id=0)
    assert [out["req_0"].generated_tokens, out["req_3"].generated_tokens] == [_completion(e) for e in expected]


@pytest.mark.parametrize("inputs, message", [
    (torch.tensor([[5, 6, 7]]), "not a tensor"),
    ("hello", "list of token-id lists"),
    (["hello"], "prompt 0 must be a list of token ids"),
    ([[5, 6.5]], "prompt 0 must be a list of token ids"),
])
def test_inputs_that_are_not_token_id_lists_are_a_type_error(inputs, message):
    with pytest.raises(TypeError, match=message):
        tiny_model("llama", "hf_paged").generate_batch(inputs, generation_config=GREEDY)


def test_training_after_generate_batch_equals_sdpa_training():
    """transformers' own manager leaves `paged|...` attention behind; hf_paged leaves the model as it was."""
    ours, stock = tiny_model("llama", "hf_paged"), tiny_model("llama", "sdpa")
    ours.generate_batch(PROMPTS, generation_config=GREEDY)
    ids = torch.tensor([PROMPTS[2]])
    for model in (ours, stock):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
    torch.testing.assert_close(ours.lm_head.weight.grad, stock.lm_head.weight.grad, atol=1e-5, rtol=1e-4)


def test_repeated_prompts_are_computed_once_and_share_blocks(served):
    model = tiny_model("llama", "hf_paged")
    long_a, long_b = list(range(3, 43)), list(range(50, 90))  # 40 tokens: two full blocks each
    rows = [long_a] * 4 + [long_b] * 4
    gc = GenerationConfig(do_sample=True, max_new_tokens=4, eos_token_id=None, pad_token_id=0)
    out = model.generate_batch(rows, generation_config=gc)
    assert len(out) == 8 and all(len(r.generated_tokens) == 4 for r in out.values())
    metrics = model.hf_paged_last_metrics
    assert metrics["vllm:prompt_tokens"] == 80  # each prompt computed once, not four times
    assert metrics["vllm:generation_tokens"] == 32


def test_repeated_rows_of_a_generate_batch_share_blocks_and_match_stock_greedy(engine_calls):
    """A GRPO-style left-padded batch (each prompt `num_generations` times) through plain `generate`."""
    ours, stock = tiny_model("llama", "hf_paged"), tiny_model("llama", "sdpa")
    a, b = list(range(3, 43)), list(range(50, 71))
    rows = [a, a, a, b, b, b]
    ids = torch.zeros(6, 40, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, 40 - len(row):], mask[r, 40 - len(row):] = torch.tensor(row), 1
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, attention_mask=mask, **gen), stock.generate(ids, attention_mask=mask, **gen))
    assert engine_calls == [True]
    assert ours.hf_paged_last_metrics["vllm:prompt_tokens"] == 40 + 21
    sampled = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, pad_token_id=0)
    metrics = ours.hf_paged_last_metrics  # the second call also reads the first call's full blocks
    assert sampled.shape[0] == 6 and metrics["vllm:prompt_tokens"] + metrics["vllm:prefix_cache_hits"] == 40 + 21


def test_uninstall_restores_transformers_generate_batch():
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    wrapped = ContinuousMixin.generate_batch
    assert wrapped.__wrapped__ is not None
    generate_batch.uninstall()
    try:
        assert ContinuousMixin.generate_batch is wrapped.__wrapped__
    finally:
        generate_batch.install()
    assert ContinuousMixin.generate_batch.__wrapped__ is wrapped.__wrapped__


@pytest.mark.parametrize("detect", [True, False])
def test_a_persistent_engine_reuses_no_prefix_computed_under_old_weights(detect, monkeypatch):
    """persistent_manager=True keeps the engine and its prefix cache between calls; an optimizer step in
    between must make the second call recompute the prompt (the control, detection off, hits it)."""
    if not detect:
        monkeypatch.setattr("hf_paged.engine.engine.weights_fingerprint", lambda model: 0)
    model = tiny_model("llama", "hf_paged")
    prompt = list(range(3, 51))  # three full blocks
    model.generate_batch([prompt], generation_config=GREEDY, persistent_manager=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model.train()
    model(input_ids=torch.tensor([prompt]), labels=torch.tensor([prompt])).loss.backward()
    optimizer.step()
    model.generate_batch([prompt], generation_config=GREEDY, persistent_manager=True)
    hits = model.hf_paged_last_metrics["vllm:prefix_cache_hits"]
    assert hits == (0 if detect else 32)  # the last block is computed again for its logits
    hf_paged.release(model)
