"""What each decoder layer of a config keeps per sequence: K/V per token (attention), a fixed state
(linear attention, Mamba, a short convolution), both (a hybrid layer), or nothing (an MLP-only layer).
Read from the config dict (`configs.text_config`) as transformers' config classes read it.

Layer kinds are transformers' `layer_types` names, its older spellings mapped as it maps them
("mamba" -> "linear_attention", "attention" -> "full_attention"):

    full_attention, sliding_attention, chunked_attention, indexed_attention   K/V per token
    linear_attention (gated delta net, Mamba, lightning attention), conv       a fixed state per sequence
    hybrid (Falcon-H1, Zamba: attention beside a Mamba mixer)                   both
    mlp, moe (Nemotron-H's mixer-less layers)                                   nothing

A config without `layer_types` gets them by its family's rule (Qwen3-Next / Qwen 3.5
`full_attention_interval`, Jamba / Zamba `attn_layer_period` and `attn_layer_offset`, Bamba
`attn_layer_indices`, Nemotron-H `hybrid_override_pattern`, LFM2 `full_attn_idxs`, Llama 4
`no_rope_layers`, MiniMax `attn_type_list`, Kimi `linear_attn_config`, Gemma 2/3 and Cohere 2
`sliding_window_pattern`), else every layer is full attention (sliding where `sliding_window` says so,
as before `layer_types` existed).

Fixed state of one layer, as transformers' modelling code keeps it (elements):

    gated delta net (Qwen3-Next, Qwen 3.5, OLMo hybrid):
        recurrent  linear_num_value_heads * linear_key_head_dim * linear_value_head_dim
        conv       (2 * linear_num_key_heads * linear_key_head_dim
                    + linear_num_value_heads * linear_value_head_dim) * linear_conv_kernel_dim
    Mamba-2 (Mamba2, Bamba, Granite 4, Falcon-H1, Nemotron-H, Zamba2):
        recurrent  num_heads * head_dim * state_size
        conv       (intermediate + 2 * n_groups * state_size) * conv_kernel
    Mamba (Mamba, Falcon-Mamba, Jamba, Zamba):
        recurrent  intermediate * state_size;  conv  intermediate * conv_kernel
    short convolution (LFM2): conv  hidden_size * conv_L_cache
    lightning attention (MiniMax): recurrent  num_heads * head_dim * head_dim (in the model's dtype)

The recurrent state is float32 (transformers' kernels accumulate it in float32) unless the config names
`mamba_ssm_cache_dtype` / `mamba_ssm_dtype`; the conv state holds the last `conv_kernel` inputs
(`LinearAttentionLayer`; vLLM keeps one fewer) in the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kv_spec import LayerSpec, layer_specs
from .configs import family

ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention", "indexed_attention",
                             "hybrid"})
STATE_KINDS = frozenset({"linear_attention", "conv", "hybrid"})
MIXERLESS_KINDS = frozenset({"mlp", "moe"})
KNOWN_KINDS = ATTENTION_KINDS | STATE_KINDS | MIXERLESS_KINDS
# transformers' `_LEGACY_LAYER_TYPE_REMAP`, and RecurrentGemma's block names.
_LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention", "recurrent": "linear_attention",
                 "deepseek_sparse_attention": "indexed_attention", "qwen_sparse_attention": "indexed_attention"}
_NEMOTRON_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
_STATE_DTYPES = ("float32", "float16", "bfloat16")
# Families whose config class makes every `sliding_window_pattern`-th layer full attention (default here).
_SLIDING_PATTERNS = {"gemma2": 2, "gpt_oss": 2, "gemma3_text": 6, "gemma3": 6, "cohere2": 4, "gemma3n_text": 5,
                     "gemma4_text": 6}

# Which mixer a family's state layers run.
_MIXERS = {
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lara_mini", "qwen4_exp_text"),
                    "gated_delta_net"),
    **dict.fromkeys(("mamba2", "bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "zamba2"), "mamba2"),
    **dict.fromkeys(("mamba", "falcon_mamba", "jamba", "zamba"), "mamba"),
    **dict.fromkeys(("lfm2", "lfm2_moe", "lfm3"), "short_conv"),
    "minimax": "lightning",
}
# Mamba-2 fields per family: heads, head_dim, state_size, n_groups, conv kernel, expand, intermediate.
_MAMBA2_FIELDS = {
    "mamba2": ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "expand", None),
    "bamba": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_expand",
              None),
    "falcon_h1": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv",
                  "mamba_expand", "mamba_d_ssm"),
    "nemotron_h": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "expand", None),
    "zamba2": ("n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_ngroups", "mamba_d_conv", "mamba_expand",
               None),
}
_MAMBA2_FIELDS["granitemoehybrid"] = _MAMBA2_FIELDS["bamba"]
# Mamba fields per family: expand, state_size, conv kernel, dt rank.
_MAMBA_FIELDS = {
    "mamba": ("expand", "state_size", "conv_kernel", "time_step_rank"),
    "falcon_mamba": ("expand", "state_size", "conv_kernel", "time_step_rank"),
    "jamba": ("mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank"),
    "zamba": ("mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank"),
}


@dataclass(frozen=True)
class MixerState:
    """One state layer's fixed state and parameters.

    Attributes:
        recurrent: elements of the recurrent state (in `recurrent_dtype`, None: the model's dtype).
        conv: elements of the convolution state (in the model's dtype).
        params: the mixer's parameters (in place of attention's in the parameter count).
    """

    recurrent: int
    conv: int
    recurrent_dtype: str | None
    params: int


def num_layers(c: dict) -> int:
    """The decoder's layer count (Nemotron-H: its pattern's length, which transformers uses)."""
    if family(c.get("model_type")) == "nemotron_h":
        explicit = c.get("layers_block_type") or c.get("layer_types") or c.get("hybrid_override_pattern")
        if explicit:
            return len(explicit)
    return int(c["num_hidden_layers"])


def layer_kinds(c: dict) -> tuple[str, ...]:
    """Per decoder layer, its kind (see the module docstring).

    Raises:
        ValueError: `layer_types` does not name one kind per layer.
    """
    n = num_layers(c)
    mt = family(c.get("model_type"))
    explicit = c.get("layer_types") or c.get("layers_block_type")
    if explicit:
        kinds = list(explicit)
        if len(kinds) != n:
            raise ValueError(f"layer_types names {len(kinds)} layers, num_hidden_layers {n}")
    elif mt == "nemotron_h" and c.get("hybrid_override_pattern"):
        kinds = [_NEMOTRON_PATTERN.get(ch, ch) for ch in c["hybrid_override_pattern"]]
    else:
        kinds = _family_kinds(c, mt, n)
    return tuple(_LEGACY_KINDS.get(k, k) for k in kinds)


def _family_kinds(c: dict, mt: str | None, n: int) -> list[str]:
    """The layer kinds a family's config class computes when the file names none."""
    if _MIXERS.get(mt) == "gated_delta_net":
        interval = int(c.get("full_attention_interval") or 4)
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if mt == "jamba":
        period, offset = int(c["attn_layer_period"]), int(c["attn_layer_offset"])
        return ["full_attention" if i % period == offset else "linear_attention" for i in range(n)]
    if mt == "zamba":  # two Mamba layers and a hybrid one, then the period from layer 3 on
        period, offset = int(c["attn_layer_period"]), int(c["attn_layer_offset"])
        return ["linear_attention", "linear_attention", "hybrid"][:n] + [
            "hybrid" if i % period == offset else "linear_attention" for i in range(n - 3)]
    if mt == "zamba2" and c.get("hybrid_layer_ids") is not None:
        return ["hybrid" if i in c["hybrid_layer_ids"] else "linear_attention" for i in range(n)]
    if mt == "bamba":
        indices = c.get("attn_layer_indices") or ()
        return ["full_attention" if i in indices else "linear_attention" for i in range(n)]
    if mt in ("mamba", "mamba2", "falcon_mamba", "granitemoehybrid"):
        return ["linear_attention"] * n
    if mt == "falcon_h1":
        return ["hybrid"] * n
    if mt in ("lfm2", "lfm2_moe"):
        full = c.get("full_attn_idxs")
        return ["full_attention" if full is None or i in full else "conv" for i in range(n)]
    if mt == "llama4_text":
        interval = int(c.get("no_rope_layer_interval") or 4)
        rope = c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        chunked = c.get("attention_chunk_size") is not None
        return ["chunked_attention" if r and chunked else "full_attention" for r in rope]
    if mt == "minimax":
        types = c.get("attn_type_list")  # MiniMax's own checkpoints: 1 full attention, 0 lightning
        if types:
            return ["full_attention" if t else "linear_attention" for t in types]
        return ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(n)]
    if mt in _SLIDING_PATTERNS and c.get("sliding_window"):  # every pattern-th layer full, the rest sliding
        pattern = int(c.get("sliding_window_pattern") or _SLIDING_PATTERNS[mt])
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        if mt == "gemma4_text" and kinds:
            kinds[-1] = "full_attention"  # Gemma 4's config forces its last layer to full attention
        return kinds
    if mt == "kimi_linear":
        linear = c.get("linear_attn_config") or {}
        if "full_attn_layers" in linear and "kda_layers" in linear:  # 1-indexed in the checkpoint
            return ["full_attention" if i + 1 in linear["full_attn_layers"] else "linear_attention"
                    for i in range(n)]
        return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if mt == "recurrent_gemma":
        blocks = list(c.get("block_types") or ("recurrent", "recurrent", "attention"))
        return ["sliding_attention" if blocks[i % len(blocks)] == "attention" else "linear_attention"
                for i in range(n)]
    return _sliding_by_window(c, n)


def _sliding_by_window(c: dict, n: int) -> list[str]:
    """Before `layer_types`: every layer slides when `sliding_window` is set (Mistral), from
    `max_window_layers` on when `use_sliding_window` (Qwen2), none when `use_sliding_window` is false."""
    if not c.get("sliding_window") or c.get("use_sliding_window") is False:
        return ["full_attention"] * n
    if "max_window_layers" in c and c.get("use_sliding_window"):
        return ["sliding_attention" if i >= c["max_window_layers"] else "full_attention" for i in range(n)]
    return ["sliding_attention"] * n


def has_attention(kind: str) -> bool:
    """Whether a layer of `kind` keeps or reads K/V per token (every kind but the state-only and
    mixer-less ones; a kind the planner does not know counts as attention)."""
    return kind not in MIXERLESS_KINDS and not (kind in STATE_KINDS and kind not in ATTENTION_KINDS)


def kv_layer_specs(c: dict, kinds: tuple[str, ...]) -> tuple[LayerSpec, ...]:
    """Per layer that keeps or reads K/V (`has_attention`), its spec, by the one definition the cache
    uses (`kv_spec.layer_specs`: windows, chunks, shared K/V, per-layer shapes). A kind the cache does
    not serve yet (a hybrid layer's attention, indexed attention, an unknown kind), a sliding layer
    without a window or a chunked one without a chunk counts as full attention (every token's K/V).

    Raises:
        ValueError: what `kv_spec.layer_specs` refuses (a reuse layer without a source, ...).
    """
    window = c.get("sliding_window") or c.get("attention_window_size")
    chunk = c.get("attention_chunk_size")
    present = {"sliding_attention": bool(window), "chunked_attention": bool(chunk), "full_attention": True}
    types = [kind if present.get(kind) else "full_attention" for kind in kinds]
    specs = layer_specs({**c, "layer_types": types, "num_hidden_layers": len(kinds), "sliding_window": window})
    return tuple(spec for spec, kind in zip(specs, kinds) if has_attention(kind))


def mixer_state(c: dict, kind: str) -> MixerState | None:
    """The fixed state of one layer of `kind` ("linear_attention", "conv" or "hybrid"), or None when
    the planner does not know the family's mixer (or its config lacks a size it needs)."""
    mt = family(c.get("model_type"))
    mixer = "short_conv" if kind == "conv" else _MIXERS.get(mt)
    hidden = int(c["hidden_size"])
    try:
        if mixer == "gated_delta_net":
            return _gated_delta_net(c, hidden)
        if mixer == "mamba2":
            return _mamba2(c, hidden, _MAMBA2_FIELDS[mt])
        if mixer == "mamba":
            return _mamba(c, hidden, _MAMBA_FIELDS[mt])
        if mixer == "short_conv":
            kernel = int(c.get("conv_L_cache") or 3)
            return MixerState(0, hidden * kernel, None, 4 * hidden * hidden + hidden * kernel)
        if mixer == "lightning":
            heads = int(c["num_attention_heads"])
            head_dim = int(c.get("head_dim") or hidden // heads)
            return MixerState(heads * head_dim * head_dim, 0, None, 0)  # parameters: counted as attention's
    except (KeyError, TypeError, ValueError):
        return None
    return None


def _ssm_dtype(c: dict) -> str:
    for key in ("mamba_ssm_cache_dtype", "mamba_ssm_dtype"):
        if c.get(key) in _STATE_DTYPES:
            return c[key]
    return "float32"


def _gated_delta_net(c: dict, hidden: int) -> MixerState:
    hk, hv = int(c["linear_num_key_heads"]), int(c["linear_num_value_heads"])
    dk, dv = int(c["linear_key_head_dim"]), int(c["linear_value_head_dim"])
    kernel = int(c["linear_conv_kernel_dim"])
    conv_dim = 2 * hk * dk + hv * dv
    # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (Qwen3-Next fuses them), the depthwise conv,
    # dt_bias and A_log per value head, the gated norm, out_proj.
    params = hidden * (conv_dim + hv * dv + 2 * hv) + conv_dim * kernel + 2 * hv + dv + hv * dv * hidden
    return MixerState(hv * dk * dv, conv_dim * kernel, _ssm_dtype(c), params)


def _mamba2(c: dict, hidden: int, fields: tuple) -> MixerState:
    heads_key, head_dim_key, state_key, groups_key, kernel_key, expand_key, inter_key = fields
    heads, state, kernel = int(c[heads_key]), int(c[state_key]), int(c[kernel_key])
    groups = int(c.get(groups_key) or 1)
    head_dim = c.get(head_dim_key)
    inter = c.get(inter_key) if inter_key else None
    if inter is None:
        inter = heads * int(head_dim) if isinstance(head_dim, int) else int(c[expand_key]) * hidden
    inter = int(inter)
    head_dim = head_dim if isinstance(head_dim, int) else inter // heads
    conv_dim = inter + 2 * groups * state
    bias = conv_dim if c.get("use_conv_bias", c.get("mamba_conv_bias", True)) else 0
    # in_proj (gate, conv input, dt), the depthwise conv, dt_bias / A_log / D per head, the gated norm, out_proj.
    norm = inter if c.get("mamba_rms_norm", True) else 0  # Falcon-H1 may leave the gated norm out
    params = hidden * (inter + conv_dim + heads) + conv_dim * kernel + bias + 3 * heads + norm + inter * hidden
    return MixerState(heads * head_dim * state, conv_dim * kernel, _ssm_dtype(c), params)


def _mamba(c: dict, hidden: int, fields: tuple) -> MixerState:
    expand_key, state_key, kernel_key, rank_key = fields
    inter = c.get("intermediate_size") if family(c.get("model_type")) in ("mamba", "falcon_mamba") else None
    inter = int(inter or int(c[expand_key]) * hidden)
    state, kernel = int(c[state_key]), int(c[kernel_key])
    rank = c.get(rank_key)
    rank = math.ceil(hidden / 16) if rank in (None, "auto") else int(rank)
    # in_proj (x and gate), the depthwise conv with its bias, x_proj (dt, B, C), dt_proj, A_log, D, out_proj.
    params = (hidden * 2 * inter + inter * kernel + inter + inter * (rank + 2 * state) + rank * inter + inter
              + inter * state + inter + inter * hidden)
    if family(c.get("model_type")) == "jamba":
        params += rank + 2 * state  # its dt, B and C layernorms
    return MixerState(inter * state, inter * kernel, _ssm_dtype(c), params)


def model_dtype(c: dict) -> str:
    """The checkpoint's dtype (`dtype` / `torch_dtype`) where it is a float dtype, else bfloat16."""
    for key in ("dtype", "torch_dtype"):
        if c.get(key) in _STATE_DTYPES:
            return c[key]
    return "bfloat16"


def has_mixer(kind: str) -> bool:
    """Whether a layer of `kind` has attention or a state mixer (all but Nemotron-H's MLP layers)."""
    return kind not in MIXERLESS_KINDS


def has_mlp(c: dict, kind: str) -> bool:
    """Whether a layer of `kind` has an MLP (or experts) of its own: not in pure Mamba models, and in
    Nemotron-H only its "mlp" / "moe" layers."""
    mt = family(c.get("model_type"))
    if mt in ("mamba", "mamba2", "falcon_mamba"):
        return False
    if mt == "nemotron_h":
        return kind in MIXERLESS_KINDS
    return True
