"""TRL's `GRPOTrainer` with an hf_paged model: both transformers rollout paths (`model.generate` and
`use_transformers_continuous_batching=True`'s `model.generate_batch`) run on the engine, the rollouts
are distributed as stock generate's, and no prefix computed before an optimizer step is reused after
it. A tiny random Llama with SmolLM2's tokenizer keeps it fast; `examples/grpo_rollouts.py` runs the
real model."""

from __future__ import annotations

import pytest
import torch

import hf_paged  # noqa: F401
import hf_paged.integrations.batch_generate as batch_generate
import hf_paged.integrations.generate_batch as generate_batch
from example_modules import load_example
from stats import chi2_critical, chi2_statistic

trl = pytest.importorskip("trl")
pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

# A prompt of three full blocks, so that a step's rollout could hit the prefix cache of the last one.
LONG_PROMPT = ("Name the capital of each country: France, Italy, Spain, Portugal, Germany, Austria, Poland, "
               "Greece, Norway, Sweden, Finland, Denmark, Ireland, Belgium, the Netherlands, Switzerland, "
               "Hungary, Romania, Bulgaria, Croatia, Slovenia, Slovakia, Estonia, Latvia and Lithuania.")


def _example():
    return load_example("grpo_rollouts")


@pytest.fixture(scope="module")
def tokenizer():
    from hf_paged.defaults.models import load_default_tokenizer

    return load_default_tokenizer()


def _tiny(tokenizer, attn: str, seed: int = 0, sharpen: float = 1.0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)  # a peaked next-token distribution: a test with power
    return model


@pytest.fixture
def served(monkeypatch):
    """Which engine route served each rollout: "generate" (the drop-in generate) or "generate_batch"."""
    calls = []
    generate, batch = batch_generate.try_engine_generate, generate_batch.engine_generate_batch

    def spy_generate(*args, **kwargs):
        result = generate(*args, **kwargs)
        calls.append("generate" if result is not None else "stock")
        return result

    def spy_batch(*args, **kwargs):
        calls.append("generate_batch")
        return batch(*args, **kwargs)

    monkeypatch.setattr(batch_generate, "try_engine_generate", spy_generate)
    monkeypatch.setattr(generate_batch, "engine_generate_batch", spy_batch)
    return calls


@pytest.mark.parametrize("path, route", [("default", "generate"), ("continuous", "generate_batch")])
def test_two_grpo_steps_run_their_rollouts_on_the_engine(tokenizer, served, tmp_path, path, route):
    example = _example()
    model = _tiny(tokenizer, "hf_paged")
    before = model.lm_head.weight.detach().clone()
    result = example.run(model, tokenizer, path=path, steps=2, output_dir=str(tmp_path),
                         dataset=example.prompts_dataset(8))
    assert served == [route, route]
    assert len(result["rollout_seconds"]) == 2 and len(result["rewards"]) == 2
    assert not torch.equal(model.lm_head.weight.detach(), before)  # it trained
    assert model.config._attn_implementation == "hf_paged"
    metrics = model.hf_paged_last_metrics
    last = result["rollout_prompts"][-1]
    distinct = {tuple(p) for p in last}
    assert len(last) == 8 and len(distinct) == 2
    # Step 2's two prompts, each repeated num_generations=4 times, were each computed (or, for the
    # chat template's shared system-prompt block, read from the prefix cache) once, not four times.
    assert metrics["vllm:prompt_tokens"] + metrics["vllm:prefix_cache_hits"] == sum(len(p) for p in distinct)
    assert metrics["vllm:generation_tokens"] > 0


def _first_tokens(trainer, prompt_ids: list[int], num: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    completions, _ = trainer._generate_single_turn([prompt_ids] * num, None, {}, trainer.num_generations)
    return torch.tensor([c[0] for c in completions])


def _grpo(model, tokenizer, tmp_path, path: str, temperature: float = 1.0):
    from datasets import Dataset

    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=1, temperature=temperature, report_to=[], use_cpu=True, bf16=False,
                          use_transformers_continuous_batching=path == "continuous", disable_tqdm=True)
    return trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                           train_dataset=Dataset.from_dict({"prompt": ["x"] * 4}), processing_class=tokenizer)


def test_rollout_first_tokens_are_distributed_as_stock_generates_them(tokenizer, served, tmp_path):
    """Chi-square goodness of fit of 2,000 first tokens per path against the model's own distribution
    (softmax at TRL's temperature 1), and of hf_paged's against stock's; a temperature of 0.6 is
    rejected (the test has power)."""
    stock_model, paged_model = _tiny(tokenizer, "sdpa", sharpen=30.0), _tiny(tokenizer, "hf_paged", sharpen=30.0)
    prompt = tokenizer("The capital of France is")["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(stock_model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert probs.max() < 0.5 and (probs > 0.01).sum() >= 5  # several likely tokens: a real comparison
    num = 2000
    stock = _first_tokens(_grpo(stock_model, tokenizer, tmp_path / "s", "default"), prompt, num, seed=0)
    assert served == []  # sdpa: stock generate
    counts = {"stock": torch.bincount(stock, minlength=len(probs))}
    for path in ("default", "continuous"):
        tokens = _first_tokens(_grpo(paged_model, tokenizer, tmp_path / path, path), prompt, num, seed=0)
        again = _first_tokens(_grpo(paged_model, tokenizer, tmp_path / path, path), prompt, num, seed=0)
        assert torch.equal(tokens, again)  # a fixed seed reproduces the rollouts
        counts[path] = torch.bincount(tokens, minlength=len(probs))
    assert served == ["generate", "generate", "generate_batch", "generate_batch"]
    for name, c in counts.items():
        stat, df = chi2_statistic(c, probs)
        assert df >= 10 and stat < chi2_critical(df), (name, stat, df)
    pooled = (counts["stock"] + counts["default"]).double() / (2 * num)  # two-sample homogeneity
    for name in ("stock", "default"):
        stat, df = chi2_statistic(counts[name], pooled)
        assert stat < chi2_critical(df), (name, stat, df)
    colder = torch.softmax(torch.log(probs) / 0.6, -1)
    stat, df = chi2_statistic(counts["default"], colder)
    assert stat > chi2_critical(df)


def _hits_per_rollout(model, tokenizer, tmp_path, path: str, monkeypatch) -> list[int]:
    from datasets import Dataset

    hits = []  # prefix-cache hits of each rollout
    target, name = ((generate_batch, "engine_generate_batch") if path == "continuous"
                    else (batch_generate, "try_engine_generate"))
    recorded = getattr(target, name)

    def record(*args, **kwargs):
        result = recorded(*args, **kwargs)
        hits.append(model.hf_paged_last_metrics["vllm:prefix_cache_hits"])
        return result

    monkeypatch.setattr(target, name, record)
    args = trl.GRPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=4, learning_rate=1e-3, report_to=[], use_cpu=True, bf16=False,
                          use_transformers_continuous_batching=path == "continuous", disable_tqdm=True,
                          save_strategy="no", logging_steps=1)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                              args=args, train_dataset=Dataset.from_dict({"prompt": [LONG_PROMPT] * 12}),
                              processing_class=tokenizer)
    trainer.train()
    return hits


@pytest.mark.parametrize("path", ["default", "continuous"])
def test_no_prefix_computed_before_an_optimizer_step_is_reused_after_it(tokenizer, tmp_path, monkeypatch, path):
    """Every step rolls out the same 3-block prompt: with weight-change detection no step hits the
    previous step's blocks; with it disabled (the control) every later step of the default path would
    (the continuous path frees its pool after each call, as transformers' manager does; its
    persistent case is `test_generate_batch`'s)."""
    assert len(tokenizer(LONG_PROMPT)["input_ids"]) >= 48
    hits = _hits_per_rollout(_tiny(tokenizer, "hf_paged"), tokenizer, tmp_path / "on", path, monkeypatch)
    assert hits == [0, 0, 0]
    monkeypatch.setattr("hf_paged.engine.engine.weights_fingerprint", lambda model: 0)  # detection off
    hits = _hits_per_rollout(_tiny(tokenizer, "hf_paged"), tokenizer, tmp_path / "off", path, monkeypatch)
    if path == "default":  # the model's engine persists across rollouts: only detection keeps it honest
        assert hits[0] == 0 and all(h >= 48 for h in hits[1:])
    else:  # TRL calls generate_batch without persistent_manager: each rollout's pool is freed after it
        assert hits == [0, 0, 0]
