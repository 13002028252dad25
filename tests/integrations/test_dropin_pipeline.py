"""`pipeline("text-generation")` over a model with the hf_paged attention: every input kind (a list,
a generator, a `KeyDataset` over a `datasets.Dataset`, chats) gives the sdpa pipeline's records, and
the rows of successive batches run in the engine together (continuous batching across batches)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, pipeline

import hf_paged  # noqa: F401  (installs the patches)
from hf_paged.engine import Engine
from hf_paged.integrations import pipeline as paged_pipeline

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked

WORDS = ("the cat sat on a mat while seven quick foxes jumped over lazy dogs near old rivers and "
         "bright stars shone above quiet hills").split()


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("gguf")
    from hf_paged.defaults.models import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny random Llama over the default tokenizer's vocabulary; its EOS is a token it often makes,
    so that rows of a batch end at different steps."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    probe = model.generate(**tokenizer(["the cat sat", "bright stars"], return_tensors="pt", padding=True),
                           max_new_tokens=12, do_sample=False)
    counts = torch.bincount(probe[:, -12:].flatten())
    model.generation_config.eos_token_id = int(counts.argmax())
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _prompts(n=256, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8, 20, 45, 70]))) for _ in range(n)]


def _run(model, tokenizer, inputs, attn, **kwargs):
    model.set_attn_implementation(attn)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    out = pipe(inputs, **kwargs)
    return out if isinstance(out, list) else list(out)


@pytest.fixture
def feeders(monkeypatch):
    """Every `EngineFeeder` the pipeline wrapper builds, and the engines built meanwhile."""
    made, engines = [], []
    original_init, original_engine = paged_pipeline.EngineFeeder.__init__, Engine.__init__

    def spy(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        made.append(self)

    def engine_spy(self, *args, **kwargs):
        original_engine(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(paged_pipeline.EngineFeeder, "__init__", spy)
    monkeypatch.setattr(Engine, "__init__", engine_spy)
    return made, engines


@pytest.mark.parametrize("batch_size", [8, 64])
def test_256_mixed_prompts_give_the_sdpa_pipelines_text_with_batches_running_together(model, tokenizer, feeders,
                                                                                        batch_size):
    prompts = _prompts()
    gen = dict(batch_size=batch_size, max_new_tokens=10, do_sample=False)
    ref = _run(model, tokenizer, prompts, "sdpa", **gen)
    hf_paged.release(model)
    ours = _run(model, tokenizer, prompts, "hf_paged", **gen)
    assert ours == ref
    made, engines = feeders
    assert len(made) == 1 and len(engines) == 1  # one engine for the 256 prompts
    # Rows of several batches ran at once (the window: the next batches' rows joined before earlier ones
    # ended), where stock runs one batch at a time.
    window = max(paged_pipeline.IN_FLIGHT_ROWS, 2 * batch_size)
    assert model.hf_paged_last_metrics["peak_num_running"] == window > batch_size


def test_a_key_dataset_a_generator_and_chats_give_the_sdpa_pipelines_records(model, tokenizer, feeders):
    datasets = pytest.importorskip("datasets")
    from transformers.pipelines.pt_utils import KeyDataset

    prompts = _prompts(40, seed=1)
    ds = datasets.Dataset.from_dict({"text": prompts})
    chats = [[{"role": "user", "content": p}] for p in prompts[:24]]
    cases = [
        (lambda: KeyDataset(ds, "text"), dict(batch_size=8, max_new_tokens=6, do_sample=False)),
        (lambda: (p for p in prompts), dict(batch_size=4, max_new_tokens=6, do_sample=False,
                                            return_full_text=False)),
        (lambda: chats, dict(batch_size=8, max_new_tokens=6, do_sample=False)),
        (lambda: chats, dict(batch_size=8, max_new_tokens=6, do_sample=False, return_full_text=False)),
        # Sampling arguments are the generate call's: top_k=1 sampling is greedy in both.
        (lambda: prompts, dict(batch_size=8, max_new_tokens=6, do_sample=True, top_k=1, temperature=0.7)),
        (lambda: prompts, dict(batch_size=8, max_length=130, do_sample=False, return_tensors=True)),
    ]
    for make, kwargs in cases:
        ref = _run(model, tokenizer, make(), "sdpa", **kwargs)
        ours = _run(model, tokenizer, make(), "hf_paged", **kwargs)
        assert _plain(ours) == _plain(ref), kwargs
    made, _ = feeders
    assert len(made) == len(cases)


def _plain(records):
    """Records with tensors as lists (return_tensors)."""
    def item(v):
        return v.tolist() if hasattr(v, "tolist") else v

    return [[{k: item(v) for k, v in r.items()} for r in rec] if isinstance(rec, list) else rec for rec in records]


def test_batches_the_engine_cannot_queue_run_in_order_with_stocks_result(model, tokenizer, feeders):
    """A stop sequence (stopping criteria see every step) or a caller's logits processor: such batches run
    when every batch before them is out, still giving the sdpa pipeline's records."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    prompts = _prompts(24, seed=2)
    for kwargs in (dict(batch_size=8, max_new_tokens=8, do_sample=False, stop_sequence="the"),
                   dict(batch_size=8, max_new_tokens=5, do_sample=False,
                        logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]))):
        ref = _run(model, tokenizer, prompts, "sdpa", **kwargs)
        ours = _run(model, tokenizer, prompts, "hf_paged", **kwargs)
        assert ours == ref, kwargs
    # What the paged path cannot do is refused with a clear error, as from generate itself.
    with pytest.raises(ValueError, match="cannot return attention weights"):
        _run(model, tokenizer, prompts, "hf_paged", batch_size=8, max_new_tokens=2, output_attentions=True,
             return_dict_in_generate=True)


def test_the_wrapper_is_undone_by_uninstall(model, tokenizer):
    from transformers.pipelines.text_generation import TextGenerationPipeline

    from hf_paged.integrations import generate as patch

    wrapped = TextGenerationPipeline.get_iterator
    patch.uninstall()
    try:
        assert TextGenerationPipeline.get_iterator is not wrapped
        assert TextGenerationPipeline.get_iterator.__qualname__ == "Pipeline.get_iterator"
    finally:
        patch.install()
    assert TextGenerationPipeline.get_iterator is not wrapped  # a fresh wrap, same behaviour
    assert TextGenerationPipeline.get_iterator.__qualname__.endswith("get_iterator")


def test_a_peft_wrapped_model_is_fed_through_the_engine_once_per_batch(model, tokenizer, engine_calls):
    """A wrapper's `generate` calls its base model's: the feeder captures that call too, so no batch is
    generated twice (once captured, once in order)."""
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    wrapped.eval()
    prompts = _prompts(24, seed=4)
    gen = dict(batch_size=8, max_new_tokens=6, do_sample=False)
    try:
        ref = _run(wrapped, tokenizer, prompts, "sdpa", **gen)
        engine_calls.clear()
        ours = _run(wrapped, tokenizer, prompts, "hf_paged", **gen)
    finally:
        wrapped.unload()  # the module-scoped model without its LoRA layers again
    assert ours == ref
    assert engine_calls == []  # every batch went through the feeder, none through a second generate
