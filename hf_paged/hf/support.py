"""Which transformers models a paged cache can serve, and why not; what K/V shapes they cache; where
their decoder is.

Reads configs and module trees only: it allocates nothing and runs nothing. Every entry point (the
cache, `attach`, the engine) asks `check_model_supported` first, so an unsupported model fails with
one clear `ValueError` before any forward.
"""

from __future__ import annotations

import torch

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_model_supported(config) -> None:
    """Raise ValueError naming what a model config needs that a paged cache cannot give."""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"hf_paged does not support encoder-decoder models (model_type={config.model_type!r}); "
            "use a decoder-only causal LM"
        )
    text = config.get_text_config(decoder=True)
    unsupported = sorted({t for t in layer_types_of(config) if t not in SUPPORTED_LAYER_TYPES})
    if unsupported:
        raise ValueError(
            f"hf_paged does not support model_type={text.model_type!r}: its layer types {unsupported} are "
            f"not plain attention (supported: {SUPPORTED_LAYER_TYPES})"
        )
    if getattr(text, "kv_sharing_modes", None) or getattr(text, "num_kv_shared_layers", 0):
        raise ValueError(f"hf_paged does not support cross-layer KV sharing (model_type={text.model_type!r})")
    if getattr(text, "num_key_value_heads", None) is None and getattr(text, "num_attention_heads", None) is None:
        raise ValueError(f"hf_paged cannot find attention heads in the config of model_type={text.model_type!r}")


def has_latent_kv(config) -> bool:
    """Whether the model uses multi-head latent attention (DeepSeek-V2/V3; its config names
    `kv_lora_rank`).

    Such a model caches, per token and layer, the compressed latent (`kv_lora_rank` wide) in the K
    slot and the shared rotary key (`qk_rope_head_dim` wide) in the V slot, each as one head, and
    expands them into per-head K (`qk_nope_head_dim + qk_rope_head_dim`) and V (`v_head_dim`) inside
    its attention module: after `cache.update`, before the attention function runs. A paged cache
    stores the latents (MLA's small footprint); attention over them runs dense.
    """
    return getattr(config.get_text_config(decoder=True), "kv_lora_rank", None) is not None


def kv_head_shapes(config) -> tuple[int, int, int]:
    """(num_kv_heads, head_dim, head_dim_v) of the K and V states a layer passes to `cache.update`,
    from the config alone (the cache allocates from the states themselves once it sees them)."""
    text = config.get_text_config(decoder=True)
    if has_latent_kv(config):
        return 1, text.kv_lora_rank, text.qk_rope_head_dim
    num_attention_heads = getattr(text, "num_attention_heads", 1)
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_attention_heads
    return num_kv_heads, head_dim, head_dim


def check_paged_attention_supported(config) -> None:
    """Raise ValueError when attention cannot read K/V straight from the blocks (what the `Engine`'s
    packed steps need); the cache itself still serves such a model, with dense attention."""
    if has_latent_kv(config):
        text = config.get_text_config(decoder=True)
        raise ValueError(
            f"hf_paged's paged attention cannot serve multi-head latent attention (model_type="
            f"{text.model_type!r}): the model expands its cached latents into per-head K/V inside its attention "
            "module, so no attention kernel ever reads the paged blocks, and the Engine (which also serves "
            "model.generate for attn_implementation='hf_paged') needs one that does. Set "
            "`model.hf_paged_use_engine = False` so that model.generate runs stock generation over a PagedCache "
            "(the latents are stored paged, attention runs dense), or use attn_implementation='sdpa'"
        )


def layer_types_of(config) -> list[str]:
    """The text decoder's per-layer attention types ("full_attention" when the config names none)."""
    text = config.get_text_config(decoder=True)
    return getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers


def layer_windows_of(config) -> list[int | None]:
    """Per decoder layer, the sliding window its attention uses (None: full attention), the way
    transformers' `DynamicCache` reads the config: `layer_types` when given, else every layer slides
    when the config sets `sliding_window` (Mistral, Phi-3)."""
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if types is None:
        return [window] * text.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward takes `input_ids`, `attention_mask` and the cache (the base model of a
    `*ForCausalLM`), or the model itself when it has no separate decoder."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, torch.nn.Module) else model
