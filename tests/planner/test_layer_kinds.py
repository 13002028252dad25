"""The planner's reading of a config.json agrees with transformers' own: layer kinds per family (with
and without `layer_types` in the file), which configs hf_paged refuses, the fixed state a hybrid
model's cache holds and its parameter count, and the recorded class refusals (`planner.refusals`)."""

import json

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from hf_paged.hf.support import attention_refusal, cached_kv_refusal, check_decoder_supported
from hf_paged.planner import refusals
from hf_paged.planner.configs import text_config
from hf_paged.planner.layers import layer_kinds
from hf_paged.planner.sizing import ModelShape

# ------------------------------------------------------------------------------------------ agreement with transformers
FAMILIES = ["llama", "qwen2", "mistral", "gemma2", "gemma3_text", "cohere2", "gpt_oss", "qwen3_next", "qwen3_5_text",
            "qwen3_5_moe_text", "qwen3_5", "jamba", "bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "zamba",
            "zamba2", "lfm2", "llama4_text", "llama4", "minimax", "mamba", "mamba2", "falcon_mamba", "recurrent_gemma",
            "olmo_hybrid", "kimi_linear", "gemma3n_text", "mllama"]


def _saved(config, drop_layer_types: bool = False) -> dict:
    """`config` as its config.json holds it; without the per-layer types where asked (the family's rule
    must then give them)."""
    saved = json.loads(config.to_json_string(use_diff=False))
    if drop_layer_types:
        for sub in (saved, saved.get("text_config") or {}):
            for key in ("layer_types", "layers_block_type"):
                sub.pop(key, None)
    return saved


@pytest.mark.parametrize("model_type", FAMILIES)
def test_layer_kinds_and_refusal_read_as_transformers_reads_them(model_type):
    config = AutoConfig.for_model(model_type)
    text = config.get_text_config(decoder=True)
    expected = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None)
    legacy = {"mamba": "linear_attention", "attention": "full_attention"}
    for drop in (False, True):
        if drop and model_type == "nemotron_h":
            continue  # its layer count is its pattern's length: a config without one has no layers
        kinds = layer_kinds(text_config(_saved(config, drop)))
        if expected is None:
            assert set(kinds) <= {"full_attention", "sliding_attention"}, kinds
        else:
            assert kinds == tuple(legacy.get(k, k) for k in expected), (drop, kinds)
    try:
        check_decoder_supported(config)
        refused = False
    except ValueError:
        refused = True
    assert (refusals.refusal(_saved(config)) is not None) == refused


@pytest.mark.parametrize("model_type, sizes", [
    ("qwen3_5_text", dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                          linear_value_head_dim=8)),
    ("jamba", dict(attn_layer_period=2, attn_layer_offset=1)),
    ("mamba2", dict(num_heads=8, head_dim=16, n_groups=2, state_size=16, num_attention_heads=None)),
    ("lfm2", dict(full_attn_idxs=[1, 3])),
])
def test_fixed_state_and_parameters_match_the_model(model_type, sizes):
    """The state bytes are those transformers' own cache holds after a forward (a bfloat16 model keeps
    its recurrent state in float32), the parameter count the model's."""
    sizes = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, **sizes}
    config = AutoConfig.for_model(model_type, **{k: v for k, v in sizes.items() if v is not None})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 100, (1, 7)), use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers
               for states in (getattr(layer, "recurrent_states", None), getattr(layer, "conv_states", None))
               if isinstance(states, dict) for t in states.values() if isinstance(t, torch.Tensor))
    shape = ModelShape.from_config({**_saved(config), "dtype": "bfloat16"})
    assert held and shape.state_bytes_per_seq == held
    assert shape.num_params == sum(p.numel() for p in model.parameters())


def _model_class(model_type):
    from transformers.models.auto import modeling_auto

    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        if model_type in mapping:
            return getattr(transformers, mapping[model_type], None)
    return None


@pytest.mark.parametrize("table, check", [(refusals.NOT_ROUTED, attention_refusal),
                                          (refusals.CACHED_KV, cached_kv_refusal)])
def test_the_recorded_class_refusals_are_hf_supports(table, check):
    """The planner's record of the classes hf_paged refuses holds for the installed transformers."""
    checked = 0
    for model_type in sorted(table):
        cls = _model_class(model_type)
        if cls is None:  # an older transformers release without this family
            continue
        assert check(cls, AutoConfig.for_model(model_type)) is not None, model_type
        checked += 1
    assert checked >= len(table) // 2
