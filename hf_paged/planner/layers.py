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
`sliding_window_pattern`; DeepSeek V3.2, GLM-5, HY v4 and A.X-K2 index every layer), else every layer
is full attention (sliding where `sliding_window` says so, as before `layer_types` existed).

A state layer's fixed state (its shapes and dtypes) is `state_spec.state_shape`'s, the definition the
cache allocates by; only its mixer's parameter count is the planner's own (`mixer_state`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..kv_spec import LayerSpec, layer_specs
from ..state_spec import StateShape
from ..state_spec import MIXERS, state_shape
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
# Families whose config class makes every layer indexed sparse attention when `layer_types` is left out.
INDEXED_FAMILIES = frozenset({"deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2"})

@dataclass(frozen=True)
class MixerState:
    """One state layer's fixed state and parameters.

    Attributes:
        recurrent: elements of the recurrent state (in `recurrent_dtype`, None: the model's dtype).
        conv: elements of the convolution state (in the model's dtype).
        recurrent_dtype: `StateShape.recurrent_dtype`.
        params: the mixer's parameters (in place of attention's in the parameter count).
        state: the shapes these counts come from (`state_spec.state_shape`).
        split_params: those of `params` transformers' tensor-parallel plans split over the ranks (the
            gated delta rule's projections); the rest (convolution, per-head decay, gated norm, and every
            Mamba mixer, which no plan names) stays whole on every rank.
    """

    recurrent: int
    conv: int
    recurrent_dtype: str | None
    params: int
    state: StateShape | None = None
    split_params: int = 0


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
    if MIXERS.get(mt) == "gated_delta_rule":
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
    if mt in INDEXED_FAMILIES:
        return ["indexed_attention"] * n
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
    uses (`kv_spec.layer_specs`: windows, chunks, shared K/V, per-layer shapes, latent rows with the
    indexer's keys). A kind the cache does not serve yet (a hybrid layer's attention, indexed attention
    without latent attention, an unknown kind), a sliding layer without a window or a chunked one
    without a chunk counts as full attention (every token's K/V).

    Raises:
        ValueError: what `kv_spec.layer_specs` refuses (a reuse layer without a source, ...).
    """
    window = c.get("sliding_window") or c.get("attention_window_size")
    chunk = c.get("attention_chunk_size")
    present = {"sliding_attention": bool(window), "chunked_attention": bool(chunk), "full_attention": True,
               "indexed_attention": c.get("kv_lora_rank") is not None}
    types = [kind if present.get(kind) else "full_attention" for kind in kinds]
    specs = layer_specs({**c, "layer_types": types, "num_hidden_layers": len(kinds), "sliding_window": window})
    return tuple(spec for spec, kind in zip(specs, kinds) if has_attention(kind))


def mixer_state(c: dict, kind: str) -> MixerState | None:
    """The fixed state of one layer of `kind` ("linear_attention", "conv" or "hybrid"): its shapes by
    `state_spec.state_shape` (the cache's definition), its mixer's parameters by the planner; None when
    `state_spec` does not know the family's mixer (or its config lacks a size it needs)."""
    mt = family(c.get("model_type"))
    try:
        state = state_shape({**c, "model_type": mt})
        # A mixer whose parameters the planner does not count yet (Kimi's delta rule, ZAYA's compressed
        # convolution) still has its state counted; its weights are left out of the parameter count.
        params = _MIXER_PARAMS.get(MIXERS[mt], lambda c, hidden, state: 0)(c, int(c["hidden_size"]), state)
    except (KeyError, TypeError, ValueError):
        return None
    # MiniMax's lightning layers keep no conv window: its shape is (), whose product `conv_elements` counts as 1
    conv = state.conv_elements if any(state.conv) else 0
    split = _gated_delta_rule_projections(int(c["hidden_size"]), state) if MIXERS[mt] == "gated_delta_rule" else 0
    return MixerState(state.recurrent_elements, conv, state.recurrent_dtype, params, state, split)


def _gated_delta_rule_projections(hidden: int, state: StateShape) -> int:
    """in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj: what Qwen 3.5's and Qwen3-Next's plans split
    (`colwise_gather_output`)."""
    (conv_dim, _), (hv, _, dv) = state.conv[0], state.recurrent[0]
    return hidden * (conv_dim + hv * dv + 2 * hv) + hv * dv * hidden


def _gated_delta_rule_params(c: dict, hidden: int, state: StateShape) -> int:
    """in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (Qwen3-Next fuses them), the depthwise conv,
    dt_bias and A_log per value head, the gated norm, out_proj."""
    (conv_dim, kernel), (hv, _, dv) = state.conv[0], state.recurrent[0]
    return _gated_delta_rule_projections(hidden, state) + conv_dim * kernel + 2 * hv + dv


def _mamba2_params(c: dict, hidden: int, state: StateShape) -> int:
    """in_proj (gate, conv input, dt), the depthwise conv, dt_bias / A_log / D per head, the gated
    norm, out_proj."""
    (conv_dim, kernel), (heads, head_dim, _) = state.conv[0], state.recurrent[0]
    inter = heads * head_dim
    bias = conv_dim if c.get("use_conv_bias", c.get("mamba_conv_bias", True)) else 0
    norm = inter if c.get("mamba_rms_norm", True) else 0  # Falcon-H1 may leave the gated norm out
    return hidden * (inter + conv_dim + heads) + conv_dim * kernel + bias + 3 * heads + norm + inter * hidden


# Mamba's dt rank field per family ("auto": ceil(hidden / 16), as its config class derives it).
_DT_RANK = {"mamba": "time_step_rank", "falcon_mamba": "time_step_rank", "jamba": "mamba_dt_rank",
            "zamba": "mamba_dt_rank"}


def _mamba_params(c: dict, hidden: int, state: StateShape) -> int:
    """in_proj (x and gate), the depthwise conv with its bias, x_proj (dt, B, C), dt_proj, A_log, D,
    out_proj (Jamba: its dt, B and C layernorms too)."""
    (inter, kernel), d_state = state.conv[0], state.recurrent[0][-1]
    mt = family(c.get("model_type"))
    rank = c.get(_DT_RANK[mt])
    rank = math.ceil(hidden / 16) if rank in (None, "auto") else int(rank)
    params = (hidden * 2 * inter + inter * kernel + inter + inter * (rank + 2 * d_state) + rank * inter + inter
              + inter * d_state + inter + inter * hidden)
    if mt == "jamba":
        params += rank + 2 * d_state
    return params


def _short_conv_params(c: dict, hidden: int, state: StateShape) -> int:
    """in_proj (B, C, x), out_proj and the depthwise conv."""
    return 4 * hidden * hidden + hidden * state.conv[0][1]


# Per mixer (`state_spec.MIXERS`), its parameters; lightning attention's are counted as attention's.
_MIXER_PARAMS = {"gated_delta_rule": _gated_delta_rule_params, "mamba2": _mamba2_params, "mamba": _mamba_params,
                 "short_conv": _short_conv_params, "lightning": lambda c, hidden, state: 0}


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
