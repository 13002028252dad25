"""The per-sequence state of recurrent layers (`state_spec.state_shape`, the one definition the cache and
the planner share) against stock transformers: for every family it has a formula for, a tiny model runs
one stock forward on a batch of 2, and every state layer's conv and recurrent states in its cache have
the formula's shapes (without the batch) and dtypes. The models are bfloat16, so the dtypes can differ:
stock keeps the recurrent state in float32 (MiniMax's in the model's dtype) and the conv window in the
model's dtype. Sizes are set small and pairwise different (key vs value head size, heads vs groups) so
that a swapped or missing factor changes a shape."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_paged.hf.support import _config_dict
from hf_paged.state_spec import StateShape
from hf_paged.state_spec import MIXERS, STATE_FORMULAS, state_shape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hf"))
from family_configs import FAMILY_CONFIG  # noqa: E402
from family_sweep import tiny_config  # noqa: E402

_GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=12, linear_conv_kernel_dim=3)
# Per family, sizes on top of the sweep's tiny config (FAMILY_CONFIG): small, and different from each other.
SIZES = {
    "qwen3_5_text": _GATED_DELTA,
    "qwen3_5_moe_text": _GATED_DELTA,
    "qwen3_next": _GATED_DELTA,
    "olmo_hybrid": _GATED_DELTA,
    "lara_mini": _GATED_DELTA,
    "qwen4_exp_text": _GATED_DELTA,
    "bamba": dict(mamba_n_groups=2),
    "granitemoehybrid": dict(mamba_n_groups=2),
    # mamba_d_ssm (48) is not expand * hidden_size (64): the formula must take it
    "falcon_h1": dict(mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head=12, mamba_d_state=8, mamba_n_groups=2,
                      mamba_chunk_size=16),
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=6, ssm_state_size=8, n_groups=2, chunk_size=16),
    "mamba2": dict(state_size=16, n_groups=2, chunk_size=16),
    "jamba": {}, "mamba": {}, "falcon_mamba": {}, "zamba": {}, "zamba2": {},
    "lfm2": dict(layer_types=["full_attention", "conv"]),
    "lfm2_moe": {}, "lfm3": {},
    "minimax": {},
    "kimi_linear": {}, "bailing_hybrid": {}, "zaya": {},
}
# Multimodal model types whose text config is another entry's: sized as their text model.
OUTER = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
CASES = [(mt, {}) for mt in SIZES] + [("nemotron_h", dict(mamba_ssm_cache_dtype="bfloat16"))]


def test_every_formula_is_checked_against_stock():
    assert set(STATE_FORMULAS) == set(SIZES) | set(OUTER)
    for outer, text in OUTER.items():
        config = _config_dict(AutoConfig.for_model(text))
        assert state_shape({**config, "model_type": outer}) == state_shape(config)


def _stock_cache(model_type: str, extra: dict):
    """A tiny bfloat16 model of `model_type` after one stock forward of 2 x 7 tokens, and its cache."""
    config = tiny_config(CONFIG_MAPPING[model_type],
                         overrides={**FAMILY_CONFIG.get(model_type, {}), **SIZES[model_type], **extra})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    if model_type == "minimax":  # its lightning state lives in a cache class of its own, not a DynamicCache
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        cache = MiniMaxCache()
    else:
        cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (2, 7)), cache=cache, use_cache=True)
    return model, cache


def _states(layer, name: str) -> dict:
    held = getattr(layer, name, None) or {}
    items = held.items() if isinstance(held, dict) else enumerate(held)
    return {i: t for i, t in items if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("model_type, extra", CASES, ids=[f"{m}{'-' if e else ''}{'-'.join(e)}" for m, e in CASES])
def test_state_shape_is_what_stock_caches(model_type, extra):
    model, cache = _stock_cache(model_type, extra)
    text = model.config.get_text_config(decoder=True)
    state = state_shape(_config_dict(text))
    conv_dtype = torch.bfloat16
    recurrent_dtype = getattr(torch, state.recurrent_dtype) if state.recurrent_dtype else torch.bfloat16
    checked = 0
    if model_type == "minimax":
        assert state.conv == ((),)
        for layer_state in cache.linear_cache:
            if isinstance(layer_state, torch.Tensor):
                assert (tuple(layer_state.shape[1:]), layer_state.dtype) == (state.recurrent[0], recurrent_dtype)
                checked += 1
    for layer in cache.layers:
        if not hasattr(layer, "conv_states"):
            continue  # an attention or cache-free layer
        conv, recurrent = _states(layer, "conv_states"), _states(layer, "recurrent_states")
        assert sorted(conv) == [i for i, s in enumerate(state.conv) if s]
        assert sorted(recurrent) == [i for i, s in enumerate(state.recurrent) if s]
        for i, t in conv.items():
            assert (t.shape[0], tuple(t.shape[1:]), t.dtype) == (2, state.conv[i], conv_dtype), f"conv {i}"
        for i, t in recurrent.items():
            assert (t.shape[0], tuple(t.shape[1:]), t.dtype) == (2, state.recurrent[i], recurrent_dtype), i
        checked += 1
    kinds = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or []
    expected = sum(k in ("linear_attention", "mamba", "hybrid", "conv") for k in kinds)
    assert checked == expected > 0  # every state layer's cache was checked


def test_the_mamba_widths_a_config_json_leaves_to_its_class():
    """A config.json may say "auto" (or nothing) where the config class derives a size: the formula
    derives it the same way."""
    for model_type in ("bamba", "granitemoehybrid", "falcon_h1", "zamba2"):
        live = AutoConfig.for_model(model_type)
        saved = _config_dict(live)
        key = {"zamba2": "mamba_headdim"}.get(model_type, "mamba_d_head")
        for value in ("auto", None):
            assert state_shape({**saved, key: value}) == state_shape(saved), (model_type, value)


def test_families_of_one_mixer_and_the_shapes_written_out():
    """The docstring's formulas, by hand, on round numbers (Qwen3.5-27B's gated delta rule, Zamba's heads)."""
    qwen = dict(model_type="qwen3_5_text", linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
    assert state_shape(qwen) == StateShape(conv=((2 * 16 * 128 + 48 * 128, 4),), recurrent=((48, 128, 128),),
                                           recurrent_dtype="float32")
    zamba = dict(model_type="zamba", hidden_size=32, mamba_expand=2, mamba_d_state=16, mamba_d_conv=4,
                 n_mamba_heads=2)
    assert state_shape(zamba) == StateShape(conv=((64, 4),), recurrent=((2, 32, 16),), recurrent_dtype="float32")
    assert state_shape({**zamba, "model_type": "jamba"}).recurrent == ((64, 16),)
    assert {MIXERS[m] for m in ("qwen3_next", "bamba", "jamba", "lfm2", "minimax")} == {
        "gated_delta_rule", "mamba2", "mamba", "short_conv", "lightning"}


@pytest.mark.parametrize("config, message", [
    (dict(model_type="llama"), "model_type='llama'"),
    (dict(model_type="qwen3_next", linear_num_key_heads=2), "linear_num_value_heads"),
    (dict(model_type="bamba", hidden_size=32, mamba_n_heads=4, mamba_d_head="auto", mamba_d_state=8,
          mamba_n_groups=1, mamba_d_conv=4, mamba_expand="two"), "mamba_expand"),
    (dict(model_type="zamba", hidden_size=30, mamba_expand=1, mamba_d_state=8, mamba_d_conv=4, n_mamba_heads=4),
     "n_mamba_heads=4"),
    # Qwen4-Exp's per-layer embeddings add conv states of their own (state_idx 1 and 2)
    (dict(_config_dict(AutoConfig.for_model("qwen4_exp_text")), ple_layer_ids=[1]), "ple_layer_ids"),
])
def test_bad_configs_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        state_shape(config)
