"""The "hf_paged" attention function and its mask function, registered in transformers' public
registries (`AttentionInterface`, `AttentionMaskInterface`).

This module is the only place transformers' attention calls enter hf_paged. It unpacks the padded
batch through the step's `StepMetadata` and calls `dispatch`; it never allocates blocks or plans a
step (the cache adapter in `hf/` does that).

Two paths, chosen per call:

* **Paged** (a `PagedCache` step planned by `hf_paged.attach`'s hook): `key`/`value` are the layer's
  blocks, the step's `StepMetadata` arrives as the `paged_metadata` kwarg, and attention runs over
  packed real tokens straight from the blocks (`attention.dispatch`), with the step's attention
  plan (`metadata.plan`, made once per step; see `plan.py`).
* **Dense** (no cache, `DynamicCache`, training): exactly transformers' own sdpa, or the model's own
  eager function where sdpa lacks a feature (softcap, sinks, attention weights), so outputs and
  gradients match stock bit for bit.

The mask function hands back a `LazyMask` (the dense mask is built only if a layer asks for it) only
while a paged step is about to run in this thread (`note_paged_step`): the paged path never pays for
a dense `[batch, 1, q, kv]` mask. Every other caller (a dense forward, code that pre-builds masks
through `create_masks_for_generate`) gets the tensor transformers' sdpa would get.
"""

from __future__ import annotations

import sys
import threading
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from . import dispatch
from .metadata import PAGED, StepMetadata

ATTN_IMPLEMENTATION = "hf_paged"


class LazyMask:
    """The arguments transformers passed to the mask interface; the dense mask is built on demand
    (once per kind, shared by every layer that receives this object) and never on the paged path."""

    # A model that hands one mask call's result to another (PaliGemma's to its Gemma) has transformers
    # prepare it again, which reads `ndim` and treats anything but a 2-D padding mask as prepared.
    ndim = 4

    def __init__(self, kwargs: dict):
        self._kwargs = kwargs
        self._built: dict[str, torch.Tensor | None] = {}

    @property
    def is_plain_causal(self) -> bool:
        """False when the model overlaid its own mask function (transformers then asks for vmap
        expansion), e.g. bidirectional attention among image tokens, here or in a mask this one was
        made from; the paged path cannot honour it."""
        inner = self._kwargs.get("attention_mask")
        return not self._kwargs.get("use_vmap", False) and (not isinstance(inner, LazyMask) or inner.is_plain_causal)

    def build(self, kind: str) -> torch.Tensor | None:
        """The mask transformers' `sdpa` ("sdpa") or `eager` ("eager") implementation would get."""
        if kind not in self._built:
            fn = sdpa_mask if kind == "sdpa" else eager_mask
            self._built[kind] = fn(**self._kwargs)
        return self._built[kind]


# .step: the PAGED step whose forward this thread runs next, else None; .written: weak references to
# the key and value blocks the cache last handed a layer in a PAGED step, and to that step.
_pending = threading.local()


def note_paged_step(step: StepMetadata | None) -> None:
    """Set (a PAGED step's forward is about to run in this thread) or clear (it ended, or was dropped)
    what the mask function sees; called by the cache that plans steps."""
    _pending.step = step if step is not None and step.mode == PAGED else None


class UnsupportedModelError(ValueError):
    """The model cannot be served by "hf_paged" attention at all (not one request's problem, and not
    transient): a retry would fail the same way, so the engine ends the step's requests at once."""


def note_paged_write(keys: torch.Tensor | None, values: torch.Tensor | None = None,
                     step: StepMetadata | None = None) -> None:
    """Record (or forget, with None) the key and value blocks the cache just handed a layer in `step`, a
    PAGED step. Attention that receives them without the step's metadata was called by a layer that
    does not pass its keyword arguments on; attention that receives that step's metadata with other
    tensors was called by a module that changed the K/V after `cache.update` (see
    `paged_attention_forward`). Weak references: a record never keeps a pool or a step alive."""
    _pending.written = None if keys is None else (weakref.ref(keys), weakref.ref(values), weakref.ref(step))


def paged_mask(**kwargs) -> "LazyMask | torch.Tensor | None":
    """Mask function registered under "hf_paged": defer while a paged step runs (it needs no mask);
    otherwise sdpa's own mask (a tensor, or None for plain causal attention without padding)."""
    if getattr(_pending, "step", None) is not None:
        return LazyMask(kwargs)
    return sdpa_mask(**kwargs)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, num_q_heads, q_len, head_dim]
    key: torch.Tensor,  # paged: [num_blocks, block_size, num_kv_heads, head_dim]; dense: [batch, kv_heads, kv_len, dim]
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    paged_metadata: StepMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([batch, q_len, num_q_heads, head_dim], weights)
    """The function registered as "hf_paged" in `AttentionInterface`. See the module docstring."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if paged_metadata is not None and paged_metadata.mode == PAGED:
        if dropout:
            raise ValueError(
                "hf_paged's paged attention does not apply attention dropout; call model.eval() before generating"
            )
        if isinstance(attention_mask, LazyMask) and not attention_mask.is_plain_causal:
            raise ValueError(
                "hf_paged's paged attention supports causal and sliding-window masks only, but this model "
                "overlays its own mask function (e.g. bidirectional image tokens); use attn_implementation='sdpa'"
            )
        if kwargs.get("output_attentions"):
            raise ValueError("hf_paged's paged attention cannot return attention weights; use attn_implementation='eager'")
        written = getattr(_pending, "written", None)
        if written is not None and written[2]() is paged_metadata and (
                key is not written[0]() or value is not written[1]()):
            raise UnsupportedModelError(
                f"hf_paged: {type(module).__name__} passes its attention other K/V than the blocks "
                "PagedCache.update returned (it transforms the cached states after the update, as DiffLlama "
                "splits its values), and the paged kernels read K/V from the blocks, so they would ignore "
                "that; attn_implementation='hf_paged' cannot serve this model: load it with "
                "attn_implementation='sdpa' or 'eager'"
            )
        meta = paged_metadata
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int):
            layer_idx = meta.active_layer
        group = meta.group_of(layer_idx)
        kept = meta.group_windows[group] if meta.group_windows else None
        if kept is not None and sliding_window is None:
            # The config slides this layer (as transformers' DynamicCache and the model's own mask read
            # it: PhiMoE, Qwen2-MoE) but its attention names no window: attend over the kept window.
            sliding_window = kept
        if kept is not None and sliding_window > kept:
            raise ValueError(
                f"hf_paged: layer {layer_idx} attends with sliding_window={sliding_window}, but its KV blocks are kept "
                f"for a window of {kept} tokens only (the model config's layer_types / sliding_window disagree with "
                "its attention)"
            )
        if meta.plan is None:  # metadata no cache began (a caller's own step): plan it once, here
            meta.plan = dispatch.plan(meta)
        scales = meta.kv_scales.get(layer_idx)
        if scales is None and key.element_size() == 1:
            raise ValueError(
                f"hf_paged: the attention got {key.dtype} (quantised) blocks whose scales this step never registered; "
                "pass the key/value tensors PagedCache.update returned to the attention unchanged"
            )
        out = dispatch.paged_attention(
            meta.pack(query),
            key,
            value,
            meta.block_tables_of(group),
            meta.seq_lens,
            meta.cu_seqlens_q,
            meta.max_seqlen_q,
            meta.max_seqlen_k,
            scaling,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=s_aux,
            plan=meta.plan,
            scales=scales,
        )
        return meta.unpack(out), None
    written = getattr(_pending, "written", None)
    if written is not None and key is written[0]():
        raise UnsupportedModelError(
            f"hf_paged: {type(module).__name__} got the paged cache's K/V blocks without the step's metadata: a "
            "decoder layer of this model does not pass its keyword arguments on to its attention, so "
            "attn_implementation='hf_paged' cannot serve it; load it with attn_implementation='sdpa' or 'eager'"
        )
    return _dense_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                            s_aux, **kwargs)


def _dense_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, s_aux,
                     **kwargs):
    needs_eager = softcap is not None or s_aux is not None or kwargs.get("output_attentions", False)
    if needs_eager:
        if isinstance(attention_mask, LazyMask):
            mask = attention_mask.build("eager")
        else:
            mask = _additive_mask(attention_mask, query, key, sliding_window, getattr(module, "is_causal", True))
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", _eager_attention)
        extra = {"softcap": softcap} if softcap is not None else {}
        if s_aux is not None:
            extra["s_aux"] = s_aux
        return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                     sliding_window=sliding_window, **extra, **kwargs)
    mask = attention_mask.build("sdpa") if isinstance(attention_mask, LazyMask) else attention_mask
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _additive_mask(mask, query: torch.Tensor, key: torch.Tensor, sliding_window: int | None, causal: bool = True):
    """The eager (additive float) form of an sdpa mask, as transformers' `eager_mask` builds it: a bool
    mask becomes 0 / dtype-min; None (sdpa's skip: no padding) becomes the causal mask (sliding-window
    if the layer slides) for a causal module, and stays None (attend to everything) for another."""
    if mask is not None and mask.dtype != torch.bool:
        return mask
    if mask is None and not causal:
        return None
    if mask is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
        k_pos = torch.arange(kv_len, device=query.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        mask = mask[None, None]
    return torch.where(mask, torch.tensor(0.0, dtype=query.dtype, device=query.device),
                       torch.finfo(query.dtype).min)


def _eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                     s_aux=None, **kwargs):
    """Fallback eager attention for modules whose modeling file has none (additive float mask)."""
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask
    if s_aux is not None:
        sinks = s_aux.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1).float(), dim=-1)[..., :-1].to(query.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def register() -> None:
    """Register "hf_paged" with transformers' attention and mask registries. Idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_mask)
