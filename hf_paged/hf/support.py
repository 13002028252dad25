"""Which transformers models a paged cache can serve, and why not; where their decoder is.

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


def layer_types_of(config) -> list[str]:
    """The text decoder's per-layer attention types ("full_attention" when the config names none)."""
    text = config.get_text_config(decoder=True)
    return getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward takes `input_ids`, `attention_mask` and the cache (the base model of a
    `*ForCausalLM`), or the model itself when it has no separate decoder."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, torch.nn.Module) else model
