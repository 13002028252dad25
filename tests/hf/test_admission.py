"""Which models `attn_implementation="hf_paged"` admits, decided from what their modules do and what their
configs say, not from a class flag alone (issue 54):

* routing: a class that does not declare `_supports_attention_backend` but whose attention modules call
  transformers' attention interface with their keyword arguments, and whose decoder layers pass theirs on
  (Qwen3-Next, Qwen 3.5, Jamba, Bamba, Falcon-H1, Nemotron-H), routes its attention; one that computes
  attention itself (Bloom, MPT, XGLM) or drops the keyword arguments on the way (StableLM, Falcon) does not,
  and the refusal says which of its classes does what;
* layer kinds: full, sliding and Llama 4's chunked attention are served, and so is Gemma 3n/4's cross-layer
  K/V sharing; Mamba and linear-attention layers are refused for their kind (the next issue builds per-sequence
  state), before any question about routing; a model whose every layer reuses K/V (a Gemma 4 assistant) is
  refused alone;
* the cached K/V: Gemma 3n/4's store layers keep what `cache.update` returned for the reuse layers, which hand
  it to their attention function: no computing with the K/V, unlike DiffLlama, Doge and JetMoe.

Classes and configs only (no forward), except one tiny Gemma 4 load."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from family_sweep import family_config
from hf_paged.hf import support
from hf_paged.hf.support import (attention_refusal, cached_kv_refusal, check_decoder_supported, check_model_supported,
                                 routes_attention)

# Hybrids whose attention routes through the interface without the flag, and the layer kind each is refused for.
HYBRIDS = {"qwen3_next": "linear_attention", "qwen3_5_text": "linear_attention", "jamba": "linear_attention",
           "bamba": "linear_attention", "falcon_h1": "hybrid", "nemotron_h": "linear_attention"}


def _causal_lm(model_type: str):
    return AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(model_type))]


# --------------------------------------------------------------------------------------------------- routing
@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_a_class_without_the_flag_whose_attention_routes_through_the_interface_routes(model_type):
    cls = _causal_lm(model_type)
    assert not getattr(cls, "_supports_attention_backend", False)  # what the load check used to go by alone
    assert routes_attention(cls)
    assert attention_refusal(cls, AutoConfig.for_model(model_type)) is None


def test_gemma4_attention_routes_without_the_flag(monkeypatch):
    """Gemma 4's text attention (dispatch through ALL_ATTENTION_FUNCTIONS, **kwargs passed on; its decoder layer
    passes its own on) routes whatever the class declares; and so does Qwen3-Next's full-attention module."""
    from transformers.models.gemma4 import modeling_gemma4
    from transformers.models.qwen3_next import modeling_qwen3_next

    monkeypatch.setattr(transformers.Gemma4ForCausalLM, "_supports_attention_backend", False)
    assert routes_attention(transformers.Gemma4ForCausalLM)
    assert support._module_routing(modeling_gemma4) == (True, "")
    assert support._interface_problem(support._function_tree(modeling_qwen3_next.Qwen3NextAttention.forward)) is None


@pytest.mark.parametrize("model_type, why", [
    ("bloom", "its BloomAttention reads the cache but computes attention itself"),
    ("mpt", "its MptAttention reads the cache but computes attention itself"),
    ("xglm", "its XGLMAttention reads the cache but computes attention itself"),
    ("stablelm", "its StableLmDecoderLayer does not pass its keyword arguments on to its self_attn"),
    ("falcon", "its FalconDecoderLayer does not pass its keyword arguments on to its self_attention"),
])
def test_a_class_that_bypasses_the_interface_is_refused_saying_how(model_type, why):
    cls = _causal_lm(model_type)
    assert not routes_attention(cls)
    reason = attention_refusal(cls, AutoConfig.for_model(model_type))
    assert reason is not None and why in reason
    assert f"cannot serve {cls.__name__} (model_type='{model_type}')" in reason and "'eager'" in reason


@pytest.mark.parametrize("model_type", sorted(HYBRIDS))
def test_a_hybrid_is_admitted_by_what_its_modules_do(model_type):
    """Issue 55: their recurrent layers keep a per-sequence state (`kv_spec.LinearState`, or Falcon-H1's
    attention with one), and their attention routes through the interface without the class declaring
    it: the config and the class both pass (nothing is built, so the full-size default config is free)."""
    # Bamba's default config has no attention layer at all (refused for that: nothing to page)
    config = AutoConfig.for_model(model_type, **({"attn_layer_indices": [1]} if model_type == "bamba" else {}))
    text = config.get_text_config(decoder=True)
    assert HYBRIDS[model_type] in text.layer_types
    check_model_supported(config)
    cls = _causal_lm(model_type)
    assert not getattr(cls, "_supports_attention_backend", False) or model_type == "nemotron_h"
    assert attention_refusal(cls, config) is None


# ----------------------------------------------------------------------------------------------- layer kinds
@pytest.mark.parametrize("model_type", ["llama4_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text"])
def test_chunked_attention_and_shared_kv_are_admitted(model_type):
    config = family_config(model_type, _causal_lm(model_type))
    text = config.get_text_config(decoder=True)
    assert "chunked_attention" in text.layer_types if model_type == "llama4_text" else text.num_kv_shared_layers >= 2
    check_model_supported(config)
    cls = _causal_lm(model_type)
    assert attention_refusal(cls, config) is None and cached_kv_refusal(cls, config) is None


def test_a_tiny_gemma4_with_shared_kv_and_per_layer_shapes_loads():
    config = family_config("gemma4_text", transformers.Gemma4ForCausalLM)
    config.vocab_size = config.vocab_size_per_layer_input = 128
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="hf_paged")
    assert model.config._attn_implementation == "hf_paged"
    assert {a.self_attn.head_dim for a in model.model.layers} == {8, 16}  # sliding / full layers' own shapes
    assert [a.self_attn.is_kv_shared_layer for a in model.model.layers] == [False] * 4 + [True] * 2


def test_a_model_whose_every_layer_reuses_kv_is_refused_alone():
    """A Gemma 4 assistant reads its target's K/V: no layer of its own stores any."""
    config = transformers.Gemma4TextConfig(num_hidden_layers=4, num_kv_shared_layers=4, hidden_size=32,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           layer_types=["sliding_attention", "full_attention"] * 2)
    with pytest.raises(ValueError, match=r"hf_paged cannot serve model_type='gemma4_text': num_kv_shared_layers=4 of "
                                         r"4 layers: no layer of this model stores K/V.*'sdpa'"):
        check_model_supported(config)
    config.num_kv_shared_layers = 2  # the last two reuse layers 0 and 1's
    check_model_supported(config)


def test_a_reuse_layer_without_a_producer_of_its_kind_is_refused_clearly():
    config = transformers.Gemma3nTextConfig(num_hidden_layers=4, num_kv_shared_layers=2, hidden_size=32,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                            activation_sparsity_pattern=[0.0] * 4)
    with pytest.raises(ValueError, match=r"hf_paged cannot serve model_type='gemma3n_text': layer 3 \(full_attention\) "
                                         r"reuses K/V, but no layer before 2 has that type"):
        check_decoder_supported(config)


# ------------------------------------------------------------------------------------------------ cached K/V
@pytest.mark.parametrize("model_type", ["gemma3n_text", "gemma4_text", "gemma4_unified_text"])
def test_storing_the_cached_kv_for_reuse_layers_is_not_computing_with_it(model_type):
    cls = _causal_lm(model_type)
    assert cached_kv_refusal(cls, AutoConfig.for_model(model_type)) is None


@pytest.mark.parametrize("model_type, attention", [("diffllama", "DiffLlamaAttention"), ("doge", "DogeAttention"),
                                                   ("jetmoe", "JetMoeAttention")])
def test_computing_with_the_cached_kv_is_still_refused(model_type, attention):
    reason = cached_kv_refusal(_causal_lm(model_type), AutoConfig.for_model(model_type))
    assert reason is not None and f"its {attention} computes with the K/V its cache returns" in reason


def _attention(module, query, key, value):
    return query


class _KeepsForReuse(torch.nn.Module):
    def forward(self, query, key_states, value_states, cache, shared, reuse):
        if reuse:
            key_states, value_states = shared["full"]
        else:
            key_states, value_states = cache.update(key_states, value_states, 0)
            shared["full"] = key_states, value_states
        return _attention(self, query, key_states, value_states)


class _KeepsASlice(torch.nn.Module):
    def forward(self, query, key_states, value_states, cache, shared, reuse):
        if reuse:
            key_states, value_states = shared["full"]
        else:
            key_states, value_states = cache.update(key_states, value_states, 0)
            shared["full"] = key_states[:, :, -8:], value_states
        return _attention(self, query, key_states, value_states)


class _KeepsWithoutReading(torch.nn.Module):
    def forward(self, query, key_states, value_states, cache, shared):
        key_states, value_states = cache.update(key_states, value_states, 0)
        shared["full"] = key_states, value_states
        return _attention(self, query, query, query)


def test_only_whole_kv_stored_and_read_back_for_attention_passes():
    assert support._cached_kv_uses(_KeepsForReuse) is None
    line = inspect.getsource(_KeepsASlice.forward).splitlines().index(
        '            shared["full"] = key_states[:, :, -8:], value_states') + 1
    assert support._cached_kv_uses(_KeepsASlice) == (line, "key_states")  # a slice of the K/V: computing with it
    assert support._cached_kv_uses(_KeepsWithoutReading) is not None  # stored, never handed to attention
