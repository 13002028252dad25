"""Latent-attention modules in paged steps: their `expand_kv` hands the paged rows on unexpanded.

A multi-head latent attention module (DeepSeek V2/V3/V3.2, Kimi K2, MiniCPM3, GLM-4.7-Flash, ...)
calls `cache.update(latent, rope)` and then `self.expand_kv(latent, rope)`, which multiplies every
cached latent by `kv_b_proj` into per-head K/V before the attention function runs. In a paged step the
cache hands back the layer's rows (`layer.LatentLayer.paged_kv`), and expanding every cached token per
step is what absorbed attention avoids (`attention.latent`): `install_latent` wraps each module's
`expand_kv` so that the rows pass through unchanged; the "hf_paged" attention function then absorbs
the up-projection into the query and the output. Any other call (a dense step, training, another
cache) runs the module's own `expand_kv`.
"""

from __future__ import annotations

import weakref

import torch

from ..attention.interface import UnsupportedModelError, is_paged_blocks
from ..attention.latent import absorb_refusal
from .indexer import indexer_refusal, install_indexers
from .support import has_latent_kv

_WRAPPED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_NEEDED = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "layer_idx")


def latent_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's latent-attention modules: those with `expand_kv` and `kv_b_proj`."""
    return [m for m in model.modules() if callable(getattr(m, "expand_kv", None)) and hasattr(m, "kv_b_proj")]


def latent_refusal(model: torch.nn.Module) -> str | None:
    """Why the model's latent attention cannot run in paged steps (None: it can): no module to wrap, an
    up-projection that is not a plain float `nn.Linear` without bias (a quantised checkpoint's), or an
    indexer that cannot run per sequence (`indexer.indexer_refusal`). None for a model without latent
    attention."""
    if not has_latent_kv(model.config):
        return None
    modules = latent_modules(model)
    if not modules:
        return ("its config names kv_lora_rank (multi-head latent attention) but no attention module has the "
                "expand_kv and kv_b_proj that paged latent attention absorbs")
    for module in modules:
        proj = module.kv_b_proj
        missing = [name for name in _NEEDED if not hasattr(module, name)]
        if missing:
            return f"its {type(module).__name__} has no {missing}, which absorbing kv_b_proj needs"
        if not _absorbable(module):
            dtype = getattr(getattr(proj, "weight", None), "dtype", None)
            biased = getattr(proj, "bias", None) is not None
            return (f"its {type(module).__name__}.kv_b_proj is a {type(proj).__name__} ({dtype}, bias={biased}), "
                    "not a plain floating-point nn.Linear without bias whose weight is here (not offloaded), so it "
                    "cannot be absorbed into the query")
    return indexer_refusal(model)


def _absorbable(module) -> bool:
    """Whether `module.kv_b_proj`'s weight is the whole up-projection, readable as it is: a plain `nn.Linear`
    without bias (`attention.latent.absorb_refusal`: no LoRA or quantised wrapper), a floating-point weight
    that is a tensor here (not on the meta device behind an offloading hook, not a tensor subclass but a
    tensor-parallel DTensor)."""
    proj = module.kv_b_proj
    if absorb_refusal(module) is not None or hasattr(proj, "_hf_hook"):
        return False
    weight = proj.weight
    plain = type(weight) in (torch.nn.Parameter, torch.Tensor) or hasattr(weight, "to_local")
    return plain and weight.dtype.is_floating_point and not weight.is_meta


def install_latent(model: torch.nn.Module) -> bool:
    """Make every latent-attention module of `model` pass paged rows through `expand_kv`, and its
    indexers (indexed sparse attention) select per sequence (`hf.indexer`); idempotent. Returns False
    when there is nothing to install (no latent attention).

    Raises:
        UnsupportedModelError: the model's latent attention cannot be absorbed, or its indexers cannot
            run per sequence (`latent_refusal`).
    """
    if not has_latent_kv(model.config):
        return False
    reason = latent_refusal(model)
    if reason is not None:
        raise UnsupportedModelError(f"hf_paged: model_type={model.config.model_type!r}: {reason}; load it with "
                                    "attn_implementation='sdpa' (its latents are still stored paged)")
    for module in latent_modules(model):
        if module not in _WRAPPED:
            module.expand_kv = _passes_rows(module.expand_kv)
            _WRAPPED.add(module)
    install_indexers(model)
    return True


def check_latent_rows(kv) -> None:
    """Raise ValueError when `kv` (a `KVOwner`) keeps a latent-attention model's latents quantised
    (`KVOwner.latent_rows` False): packed steps read the rows absorbed, which are not quantised yet."""
    if kv.has_latent_kv and not kv.latent_rows:
        raise ValueError(f"hf_paged: kv_cache_dtype={kv.cache_config.kv_cache_dtype!r} with multi-head latent "
                         "attention (MLA): the Engine reads latent rows absorbed, which are not quantised yet; use "
                         "kv_cache_dtype='auto' (model.generate over a quantised PagedCache runs stock generation, "
                         "dense)")


def is_installed(model: torch.nn.Module) -> bool:
    """Whether every latent-attention module of `model` is wrapped."""
    modules = latent_modules(model)
    return bool(modules) and all(m in _WRAPPED for m in modules)


def _passes_rows(expand_kv):
    def wrapped(kv_nope, k_rot, *args, **kwargs):
        if is_paged_blocks(kv_nope, k_rot):  # a paged step's rows: absorbed in the attention function
            return kv_nope, k_rot
        return expand_kv(kv_nope, k_rot, *args, **kwargs)

    return wrapped
