"""Which path served a drop-in `generate` call: `hf_paged.explain` names the path and the reason without
running the model, and `generate` logs each fallback to stock at INFO once per model and reason, with
the same reason explain gives; explain's path is the one `generate` then takes."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

import hf_paged
from hf_paged.integrations.explain import ENGINE, PATHS, STOCK, STOCK_PAGED_CACHE, STOCK_STATIC_CACHE, explain
from tiny_models import left_padded_batch, tiny_mla_model, tiny_model

GEN = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)


class Recorder(BaseStreamer):
    def __init__(self):
        self.num_puts = 0

    def put(self, value):
        self.num_puts += 1

    def end(self):
        pass


class Halve(LogitsProcessor):
    """A caller's own processor (nothing the generation config builds)."""

    def __call__(self, input_ids, scores):
        return scores / 2


def _fallback_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("hf_paged") and r.levelno == logging.INFO
            and "stock generate serves this call" in r.getMessage()]


def _batch():
    ids, mask = left_padded_batch([3, 5], seed=1)
    return dict(input_ids=ids, attention_mask=mask)


def _call(**extra) -> dict:
    """A two-row call: the batch, `GEN`, then `extra` (overriding `GEN`)."""
    return {**_batch(), **GEN, **extra}


def _no_forward(*args, **kwargs):
    raise AssertionError("explain ran the model")


def test_a_plain_call_is_explained_as_the_engines_and_logs_nothing(engine_calls, caplog, monkeypatch):
    model, call = tiny_model("llama", "hf_paged"), _call()
    with monkeypatch.context() as patched:
        patched.setattr(model, "forward", _no_forward)
        explained = explain(model, **call)
    assert "_hf_paged_engine" not in vars(model)  # no engine built either
    assert explained.path == ENGINE and "2 rows, greedy, up to 3 new tokens" in explained.reason
    assert str(explained).startswith("hf_paged's Engine serves this call: nothing in it needs stock generate")
    assert hf_paged.explain is explain  # the package's export
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        model.generate(**call)
    assert engine_calls == [True] and _fallback_records(caplog) == []


CASES = {
    "streamer_with_samples": (lambda: dict(streamer=Recorder(), do_sample=True, num_return_sequences=2),
                              "a streamer with num_return_sequences=2"),
    "streamer_with_scores": (lambda: dict(streamer=Recorder(), output_scores=True, return_dict_in_generate=True),
                             "a streamer with output_scores or output_logits"),
    "unknown_argument": (lambda: dict(position_ids=torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])),
                         "arguments the engine does not take (position_ids)"),
    "processor_with_scores": (lambda: dict(logits_processor=LogitsProcessorList([Halve()]), output_scores=True,
                                           return_dict_in_generate=True),
                              "logits processors with output_scores or output_logits"),
    "beam_search": (lambda: dict(num_beams=2), "beam search"),
    "unsupported_output": (lambda: dict(output_hidden_states=True, return_dict_in_generate=True),
                           "generation_config.output_hidden_states=True is not supported by the engine"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_fallback_is_explained_and_logged_once_per_model_with_the_same_reason(case, engine_calls, caplog):
    extra, reason = CASES[case]
    model = tiny_model("llama", "hf_paged")
    explained = explain(model, **_call(**extra()))
    assert (explained.path, explained.reason) == (STOCK_PAGED_CACHE, reason)
    assert str(explained) == f"Stock transformers generate serves this call, over a PagedCache: {reason}."
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        model.generate(**_call(**extra()))
        assert _fallback_records(caplog) == [f"hf_paged: stock generate serves this call on LlamaForCausalLM: "
                                             f"{reason} (logged once per model and reason)"]
        model.generate(**_call(**extra()))  # the same call again: nothing new
        assert len(_fallback_records(caplog)) == 1
        tiny_model("llama", "hf_paged").generate(**_call(**extra()))  # another model logs its own
        assert len(_fallback_records(caplog)) == 2
    assert engine_calls == [False, False, False]  # explain's path is the one generate took


def test_positional_arguments_are_explained_and_logged_by_the_generate_wrap(engine_calls, caplog):
    model, batch = tiny_model("llama", "hf_paged"), _batch()
    args = (batch["input_ids"], None, LogitsProcessorList())  # logits_processor by position
    explained = explain(model, *args, attention_mask=batch["attention_mask"], **GEN)
    assert explained.path == STOCK_PAGED_CACHE and "positional arguments" in explained.reason
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        model.generate(*args, attention_mask=batch["attention_mask"], **GEN)
        model.generate(*args, attention_mask=batch["attention_mask"], **GEN)
    assert engine_calls == [] and len(_fallback_records(caplog)) == 1
    assert explained.reason in _fallback_records(caplog)[0]


def test_latent_attention_goes_to_the_engine_unless_its_up_projection_cannot_be_absorbed(engine_calls, caplog):
    model = tiny_mla_model("deepseek_v2", "hf_paged")
    assert explain(model, **_call()).path == ENGINE  # absorbed latent attention over the paged rows
    for module in model.modules():
        if hasattr(module, "kv_b_proj"):  # a biased up-projection cannot be folded into the query
            proj = module.kv_b_proj
            module.kv_b_proj = torch.nn.Linear(proj.in_features, proj.out_features, bias=True)
    explained = explain(model, **_call())
    assert explained.path == STOCK_PAGED_CACHE and explained.reason.startswith("latent attention (MLA)")
    assert "kv_b_proj" in explained.reason
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        model.generate(**_call())
    assert engine_calls == [False] and [explained.reason in m for m in _fallback_records(caplog)] == [True]


def test_the_paths_without_the_engine_question():
    """Not an "hf_paged" model (hf_paged is not involved; one it would refuse to load, with why), a static
    cache (paging off), a call that keeps no cache, and a switched-off engine: each named without running
    anything."""
    batch = _batch()
    stock = explain(tiny_model("llama"), **batch, **GEN)
    assert stock.path == STOCK and "attention is 'sdpa', not 'hf_paged'" in stock.reason
    assert "attn_implementation='hf_paged'" in stock.note and str(stock).count(".") >= 2
    bloom = AutoModelForCausalLM.from_config(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2),
                                             attn_implementation="eager")
    refused = explain(bloom, **batch, **GEN)  # a model hf_paged refuses to load: said so
    assert refused.path == STOCK and refused.note.startswith("loading it with attn_implementation='hf_paged' is "
                                                             "refused: attn_implementation='hf_paged' cannot serve "
                                                             "BloomForCausalLM")
    model = tiny_model("llama", "hf_paged")
    assert explain(model, **batch, **GEN, cache_implementation="static").path == STOCK_STATIC_CACHE
    no_cache = explain(model, **batch, **GEN, use_cache=False)
    assert (no_cache.path, no_cache.reason) == (STOCK, "use_cache=False")
    model.hf_paged_use_engine = False
    off = explain(model, **batch, **GEN)
    assert (off.path, off.reason) == (STOCK_PAGED_CACHE, "model.hf_paged_use_engine is False")
    assert {stock.path, no_cache.path, off.path} <= set(PATHS)
