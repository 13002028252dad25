"""Greedy parity on the real SmolLM2-135M-Instruct weights (Llama, GQA 9:3), batched and one at a time."""

from __future__ import annotations

import pytest
import torch

from hf_paged.defaults.models import load_default
from tiny_models import cache_of
from hf_paged.defaults.prompts import CHAT_PROMPTS, chat_inputs

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
# fp32 through 30 layers: only the attention's summation order differs from sdpa.
LOGITS_ATOL = 2e-4


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return load_default(dtype=torch.float32, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def stock_batched(model_and_tokenizer):
    """Stock sdpa on the eight left-padded chat prompts: the one reference every batched test compares with."""
    model, tokenizer = model_and_tokenizer
    inputs = chat_inputs(tokenizer)
    model.set_attn_implementation("sdpa")
    return inputs, _generate(model, inputs)


def _generate(model, inputs):
    return model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)


def _assert_parity(ref, out):
    assert torch.equal(out.sequences, ref.sequences)
    worst = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))
    assert worst <= LOGITS_ATOL, f"max |logit diff| {worst:.2e} > {LOGITS_ATOL}"


@pytest.mark.parity
def test_batched_left_padded_parity(model_and_tokenizer, stock_batched):
    model, _ = model_and_tokenizer
    inputs, ref = stock_batched
    lengths = inputs["attention_mask"].sum(1)
    assert lengths.min() < lengths.max()  # really mixed lengths, really padded
    model.set_attn_implementation("hf_paged")
    model.hf_paged_use_engine = False  # the stock generate path over a PagedCache
    out = _generate(model, inputs)
    _assert_parity(ref, out)
    assert cache_of(out).stats()["num_tokens"] == int(lengths.sum()) + len(CHAT_PROMPTS) * (NEW_TOKENS - 1)


@pytest.mark.parity
def test_one_at_a_time_parity(model_and_tokenizer):
    """Unpadded, one prompt per call: the shortest, a middle and the longest chat prompt (the batched test
    above runs all eight)."""
    model, tokenizer = model_and_tokenizer
    by_length = sorted(CHAT_PROMPTS, key=len)
    for prompt in (by_length[0], by_length[len(by_length) // 2], by_length[-1]):
        inputs = chat_inputs(tokenizer, [prompt])
        model.set_attn_implementation("sdpa")
        ref = _generate(model, inputs)
        model.set_attn_implementation("hf_paged")
        model.hf_paged_use_engine = False  # the stock generate path over a PagedCache
        out = _generate(model, inputs)
        _assert_parity(ref, out)


def test_text_generation_pipeline(model_and_tokenizer):
    """`pipeline()` calls generate: same text with the flag flipped."""
    from transformers import pipeline

    model, tokenizer = model_and_tokenizer
    messages = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS[:3]]
    results = {}
    for attn in ("sdpa", "hf_paged"):
        model.set_attn_implementation(attn)
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
        results[attn] = [r[0]["generated_text"][-1]["content"]
                         for r in pipe(messages, max_new_tokens=24, do_sample=False, batch_size=3)]
    assert results["hf_paged"] == results["sdpa"]
    assert all(results["sdpa"])


@pytest.mark.parametrize("backend", ["torch", "cpu", "flex"])
def test_batched_parity_through_each_cpu_backend(model_and_tokenizer, stock_batched, backend, monkeypatch):
    """The eight chat prompts through the engine (drop-in generate) with each CPU attention backend
    forced: the torch path alone, the native kernel for decode ("cpu", the default here), and
    FlexAttention: the same greedy tokens as stock sdpa, logits within 2e-4."""
    from hf_paged.attention import cpu_kernel, dispatch

    if backend == "cpu" and cpu_kernel.load() is None:
        pytest.skip(f"no CPU kernel: {cpu_kernel.load_error()}")
    model, _ = model_and_tokenizer
    inputs, ref = stock_batched
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    seen = []
    real = dispatch.run
    monkeypatch.setattr(dispatch, "run", lambda call, plan=None: seen.append(plan.backend if plan is not None else None)
                        or real(call, plan))
    model.set_attn_implementation("hf_paged")
    try:
        out = _generate(model, inputs)
    finally:
        import hf_paged

        hf_paged.release(model)  # the next test's engine plans with its own backend
    _assert_parity(ref, out)
    assert seen and set(seen) == {backend}
