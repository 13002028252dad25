"""What one sequence's per-sequence state costs in a layer with a recurrent mixer, from a config alone:
the one definition the cache (which allocates it) and the planner (which counts it) share.

Torch-free, like `kv_spec`: the planner reads a config.json, the cache a live config, both through
`state_shape`. A mixer keeps transformers' linear-attention cache contract (`cache_utils.
LinearAttentionCacheLayerMixin`): a convolution window of its last `kernel` inputs and a recurrent state,
per sequence, independent of the sequence's length. The shapes below are the ones the stock mixers
allocate, without the batch dimension (`tests/core/test_state_spec.py` checks them, and the dtypes,
against a stock cache after a forward):

    gated delta rule (Qwen 3.5, Qwen3-Next, OLMo hybrid, Lara mini, Qwen4-Exp without per-layer embeddings)
        conv       (2 * linear_num_key_heads * linear_key_head_dim
                    + linear_num_value_heads * linear_value_head_dim, linear_conv_kernel_dim)
        recurrent  (linear_num_value_heads, linear_key_head_dim, linear_value_head_dim)
    Mamba 2 (Mamba2, Bamba, Granite 4, Falcon-H1, Nemotron-H, Zamba2)
        conv       (intermediate + 2 * n_groups * state_size, conv_kernel)
        recurrent  (num_heads, head_dim, state_size)
        intermediate: expand * hidden_size (Falcon-H1: mamba_d_ssm where set; Nemotron-H: heads * head_dim)
    Mamba 1 (Mamba, Falcon-Mamba, Jamba, Zamba)
        conv       (intermediate, conv_kernel)
        recurrent  (intermediate, state_size)   Zamba: (n_mamba_heads, intermediate / n_mamba_heads, state_size)
        intermediate: expand * hidden_size
    Kimi delta attention (Kimi Linear, Bailing hybrid: queries, keys and values convolved together)
        conv       (3 * linear_num_heads * linear_head_dim, linear_conv_kernel_dim)
        recurrent  (linear_num_heads, linear_head_dim, linear_head_dim)
    compressed convolutional attention (ZAYA: its attention's q/k convolution and delayed values)
        conv       ((num_attention_heads + num_key_value_heads) * head_dim, cca_time0 + cca_time1 - 2)
        recurrent  (num_key_value_heads * head_dim / 2,)   in the model's dtype
    short convolution (LFM2, LFM3)
        conv       (hidden_size, conv_L_cache);  no recurrent state
    lightning attention (MiniMax)
        no conv;  recurrent  (num_attention_heads, head_dim, head_dim)

Dtypes: the conv window is in the model's dtype. The recurrent state is float32 for every family but
MiniMax's, whatever the model's dtype: stock's torch paths accumulate it in float32 and cache what they
return (a bfloat16 Qwen 3.5, Bamba, Nemotron-H or Jamba holds a float32 state), as do the maintained
kernels (flash-linear-attention, mamba-ssm), whose final state is float32. Stock reads no config field
for it: Nemotron-H's `mamba_ssm_cache_dtype` and Qwen 3.5's `mamba_ssm_dtype` (vLLM's knobs) change
nothing in transformers, so nothing here either. MiniMax's lightning state is in the model's dtype
(`recurrent_dtype` None).

Under tensor parallelism transformers' plans gather these mixers' outputs (Qwen 3.5's
`colwise_gather_output`) or leave them whole, so every rank computes, and keeps, the whole state: the
shapes do not divide by the rank count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

@dataclass(frozen=True)
class StateShape:
    """The state one sequence carries through a layer, on one tensor-parallel rank: transformers'
    linear-attention cache contract (`LinearAttentionCacheLayerMixin`), one conv and one recurrent state
    per state index, each a shape without its batch dimension.

    Attributes:
        conv: per state index, the convolution window's shape (channels, kernel).
        recurrent: per state index, the recurrent (SSM or delta-rule) state's shape, or () when the
            layer keeps none (a convolution-only layer).
        recurrent_dtype: the dtype of the recurrent state whatever the model's ("float32" for every
            family but MiniMax, see the module docstring), or None: the model's.
    """

    conv: tuple[tuple[int, ...], ...]
    recurrent: tuple[tuple[int, ...], ...]
    recurrent_dtype: str | None = None

    def __post_init__(self):
        if len(self.conv) != len(self.recurrent) or not self.conv:
            raise ValueError("a state shape has one conv and one recurrent shape per state index")
        for shape in self.conv + self.recurrent:
            for dim in shape:
                _check_positive("a state dimension", dim)

    @property
    def num_states(self) -> int:
        return len(self.conv)

    @property
    def conv_elements(self) -> int:
        return sum(_prod(s) for s in self.conv if s)

    @property
    def recurrent_elements(self) -> int:
        return sum(_prod(s) for s in self.recurrent if s)

    def bytes(self, itemsize: int, recurrent_itemsize: int | None = None) -> int:
        """Bytes of one sequence's state at `itemsize` (the recurrent part at `recurrent_itemsize`,
        default the same)."""
        for name, value in (("itemsize", itemsize), ("recurrent_itemsize", recurrent_itemsize or itemsize)):
            _check_positive(name, value)
        return self.conv_elements * itemsize + self.recurrent_elements * (recurrent_itemsize or itemsize)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


# The recurrent state's dtype in the families that fix it (see the module docstring).
_FLOAT32 = "float32"


def _gated_delta_rule(c: Mapping[str, Any]) -> StateShape:
    nk, nv = _get(c, "linear_num_key_heads"), _get(c, "linear_num_value_heads")
    dk, dv = _get(c, "linear_key_head_dim"), _get(c, "linear_value_head_dim")
    return StateShape(conv=((2 * nk * dk + nv * dv, _get(c, "linear_conv_kernel_dim")),),
                      recurrent=((nv, dk, dv),), recurrent_dtype=_FLOAT32)


def _qwen4_exp(c: Mapping[str, Any]) -> StateShape:
    if c.get("ple_layer_ids"):  # its per-layer embeddings keep two more conv states (a conv and n-gram ids)
        raise ValueError("hf_paged does not size the per-layer-embedding conv states of a Qwen4-Exp config with "
                         f"ple_layer_ids={c['ple_layer_ids']!r}")
    return _gated_delta_rule(c)


# model_type -> its config's names of (heads, head_dim, state size, groups, conv kernel, expand); expand
# None: the intermediate width is heads * head_dim.
_MAMBA2_FIELDS = {
    "mamba2": ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "expand"),
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_expand"),
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", None),
    "zamba2": ("n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_ngroups", "mamba_d_conv", "mamba_expand"),
}
_MAMBA2_FIELDS["granitemoehybrid"] = _MAMBA2_FIELDS["falcon_h1"] = _MAMBA2_FIELDS["bamba"]


def _mamba2(c: Mapping[str, Any]) -> StateShape:
    heads_key, head_dim_key, state_key, groups_key, kernel_key, expand_key = _MAMBA2_FIELDS[c["model_type"]]
    heads = _get(c, heads_key)
    if expand_key is None:
        inner = heads * _get(c, head_dim_key)
    elif c["model_type"] == "falcon_h1" and c.get("mamba_d_ssm") is not None:
        inner = _get(c, "mamba_d_ssm")
    else:
        inner = _expanded(c, expand_key)
    # "auto" (Bamba, Granite 4, Falcon-H1 in a config.json): what the config class derives
    head_dim = inner // heads if c.get(head_dim_key) in (None, "auto") else _get(c, head_dim_key)
    d_state, groups = _get(c, state_key), _get(c, groups_key)
    return StateShape(conv=((inner + 2 * groups * d_state, _get(c, kernel_key)),),
                      recurrent=((heads, head_dim, d_state),), recurrent_dtype=_FLOAT32)


# model_type -> its config's names of (expand, state size, conv kernel).
_MAMBA1_FIELDS = {
    "mamba": ("expand", "state_size", "conv_kernel"),
    "jamba": ("mamba_expand", "mamba_d_state", "mamba_d_conv"),
}
_MAMBA1_FIELDS["falcon_mamba"] = _MAMBA1_FIELDS["mamba"]
_MAMBA1_FIELDS["zamba"] = _MAMBA1_FIELDS["jamba"]


def _mamba1(c: Mapping[str, Any]) -> StateShape:
    expand_key, state_key, kernel_key = _MAMBA1_FIELDS[c["model_type"]]
    inner, d_state = _expanded(c, expand_key), _get(c, state_key)
    recurrent: tuple[int, ...] = (inner, d_state)
    if c["model_type"] == "zamba":  # its mixer splits the channels into heads
        heads = _get(c, "n_mamba_heads")
        if inner % heads:
            raise ValueError(f"n_mamba_heads={heads} must divide the Mamba width {inner} (mamba_expand * hidden_size)")
        recurrent = (heads, inner // heads, d_state)
    return StateShape(conv=((inner, _get(c, kernel_key)),), recurrent=(recurrent,), recurrent_dtype=_FLOAT32)


def _kimi_delta(c: Mapping[str, Any]) -> StateShape:
    heads, head_dim = _get(c, "linear_num_heads"), _get(c, "linear_head_dim")
    return StateShape(conv=((3 * heads * head_dim, _get(c, "linear_conv_kernel_dim")),),
                      recurrent=((heads, head_dim, head_dim),), recurrent_dtype=_FLOAT32)


def _compressed_conv(c: Mapping[str, Any]) -> StateShape:
    heads, kv_heads, head_dim = _get(c, "num_attention_heads"), _get(c, "num_key_value_heads"), _get(c, "head_dim")
    kernel = _get(c, "cca_time0") + _get(c, "cca_time1") - 2  # its depthwise and grouped convolutions, chained
    return StateShape(conv=(((heads + kv_heads) * head_dim, kernel),), recurrent=((kv_heads * head_dim // 2,),))


def _short_conv(c: Mapping[str, Any]) -> StateShape:
    return StateShape(conv=((_get(c, "hidden_size"), _get(c, "conv_L_cache")),), recurrent=((),))


def _lightning(c: Mapping[str, Any]) -> StateShape:
    heads = _get(c, "num_attention_heads")
    head_dim = _get(c, "head_dim") if c.get("head_dim") else _get(c, "hidden_size") // heads
    return StateShape(conv=((),), recurrent=((heads, head_dim, head_dim),))


# Which mixer a family's state layers run (the planner counts each mixer's parameters by it).
MIXERS: dict[str, str] = {
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid",
                     "lara_mini", "qwen4_exp_text"), "gated_delta_rule"),
    **dict.fromkeys(_MAMBA2_FIELDS, "mamba2"),
    **dict.fromkeys(_MAMBA1_FIELDS, "mamba"),
    **dict.fromkeys(("kimi_linear", "bailing_hybrid"), "kimi_delta"),
    "zaya": "compressed_conv",
    **dict.fromkeys(("lfm2", "lfm2_moe", "lfm3"), "short_conv"),
    "minimax": "lightning",
}
_FORMULAS: dict[str, Callable[[Mapping[str, Any]], StateShape]] = {
    "gated_delta_rule": _gated_delta_rule, "mamba2": _mamba2, "mamba": _mamba1, "short_conv": _short_conv,
    "lightning": _lightning, "kimi_delta": _kimi_delta, "compressed_conv": _compressed_conv,
}
# model_type -> the formula of its mixer's state. A family whose mixer is not one of these is refused
# (`state_shape` raises, naming it), never sized by a guess.
STATE_FORMULAS: dict[str, Callable[[Mapping[str, Any]], StateShape]] = {
    model_type: _FORMULAS[mixer] for model_type, mixer in MIXERS.items()}
STATE_FORMULAS["qwen4_exp_text"] = _qwen4_exp


def state_shape(config: Mapping[str, Any]) -> StateShape:
    """The per-sequence state of one recurrent layer of a text config given as a dict (its
    `model_type` picks the formula; every such layer of a model has the same shape).

    Args:
        config: the text model's config as a dict: a live config's (`hf.support._config_dict`) or a
            config.json's with its family's defaults filled in (`planner.configs.text_config`).

    Raises:
        ValueError: a model type with no formula here (its mixer's state is not one hf_paged knows how
            to size), or a size field missing from the config.
    """
    model_type = config.get("model_type")
    formula = STATE_FORMULAS.get(model_type)
    if formula is None:
        raise ValueError(
            f"hf_paged does not know the per-sequence state of model_type={model_type!r}'s recurrent layers "
            f"(it sizes those of {sorted(STATE_FORMULAS)})")
    return formula(config)


def _get(c: Mapping[str, Any], name: str) -> int:
    value = c.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the config's {name} must be a positive integer to size its recurrent state, got {value!r}")
    return value


def _expanded(c: Mapping[str, Any], expand_key: str) -> int:
    """The Mamba width, int(expand * hidden_size), as the mixers compute it (expand may be a float)."""
    expand = c.get(expand_key)
    if isinstance(expand, bool) or not isinstance(expand, (int, float)) or expand <= 0:
        raise ValueError(f"the config's {expand_key} must be a positive number to size its recurrent state, "
                         f"got {expand!r}")
    return int(expand * _get(c, "hidden_size"))
