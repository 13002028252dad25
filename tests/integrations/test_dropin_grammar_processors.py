"""Issue 34's acceptance on SmolLM2: drop-in `generate` with a JSON-schema logits processor (xgrammar's own
transformers processor, and hf_paged's `GrammarLogitsProcessor`) over a batch of 8 prompts runs in the
engine and returns stock's tokens exactly."""

from __future__ import annotations

import json

import pytest
import torch

from hf_paged import StructuredOutputs

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "sunny": {"type": "boolean"}, "temp_c": {"type": "integer"}},
          "required": ["city", "sunny", "temp_c"], "additionalProperties": False}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul"]


@pytest.fixture(scope="module")
def smollm2():
    from hf_paged.defaults.models import load_default

    return load_default()


def _batch(tokenizer):
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Give today's weather in {city} as JSON with keys city, sunny, temp_c."}],
        tokenize=False, add_generation_prompt=True) for city in CITIES]
    return tokenizer(prompts, return_tensors="pt", padding=True)


def _xgrammar_processor(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    return xgr.contrib.hf.LogitsProcessor(compiled)  # one per call: it keeps per-row state


def _hf_paged_processor(tokenizer):
    from hf_paged.structured import GrammarLogitsProcessor

    if "processor" not in _SHARED:  # one for both calls: it starts afresh on other prompts
        _SHARED["processor"] = GrammarLogitsProcessor(tokenizer, StructuredOutputs(json=SCHEMA, any_whitespace=False))
    return _SHARED["processor"]


_SHARED: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("make", [_xgrammar_processor, _hf_paged_processor], ids=["xgrammar-contrib", "hf_paged"])
def test_a_json_schema_processor_on_a_batch_of_8_runs_in_the_engine_and_equals_stock(smollm2, engine_calls, make):
    model, tokenizer = smollm2
    inputs = _batch(tokenizer)
    kwargs = dict(max_new_tokens=40, do_sample=False)
    stock = model.generate(**inputs, **kwargs, logits_processor=[make(tokenizer)])
    model.set_attn_implementation("hf_paged")
    try:
        ours = model.generate(**inputs, **kwargs, logits_processor=[make(tokenizer)])
        steps = model.hf_paged_last_metrics["num_steps"]
    finally:
        model.set_attn_implementation("sdpa")
    assert engine_calls == [True] and steps >= 10  # the engine ran the drop-in call
    assert torch.equal(ours, stock)
    width = inputs["input_ids"].shape[1]
    texts = tokenizer.batch_decode(ours[:, width:], skip_special_tokens=True)
    parsed = [json.loads(t) for t in texts]
    assert [set(p) for p in parsed] == [{"city", "sunny", "temp_c"}] * 8
