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

A compiled decode step (`worker/cpu_graphs.py`: the model's forward compiled by Inductor) passes
`COMPILED_STEP` as `paged_metadata` and a cache whose `update` hands the new K/V straight back: each
layer's attention then becomes one opaque op (`hf_paged::step_attention`) that runs, eagerly, at
every call of the compiled graph, what an eager step runs for that layer: the cache's `update` (the
K/V write) and this function's paged path, with the step and cache `compiled_step` names. The
compiler never sees the step's host values (lengths, block tables), which change every step.

The mask function hands back a `LazyMask` (the dense mask is built only if a layer asks for it) only
while a paged step is about to run in this thread (`note_paged_step`): the paged path never pays for
a dense `[batch, 1, q, kv]` mask. Every other caller (a dense forward, code that pre-builds masks
through `create_masks_for_generate`) gets the tensor transformers' sdpa would get.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from . import dispatch
from .latent import absorb_query, absorb_refusal, expand_output, is_latent_call
from .metadata import PAGED, StepMetadata
from .sparse import sparse_latent_attention

ATTN_IMPLEMENTATION = "hf_paged"


class LazyMask:
    """The arguments transformers passed to the mask interface; the dense mask is built on demand
    (once per kind, shared by every layer that receives this object) and never on the paged path."""

    # A model that hands one mask call's result to another (PaliGemma's to its Gemma) has transformers
    # prepare it again, which reads `ndim` and treats anything but a 2-D padding mask as prepared.
    ndim = 4

    def __init__(self, kwargs: dict, index=None):
        self._kwargs = kwargs
        self._index = index  # what the model sliced the mask with (see `__getitem__`), None: whole
        self._built: dict[str, torch.Tensor | None] = {}

    def __getitem__(self, index) -> "LazyMask":
        """The mask of a slice of the queries: Gemma 4 keeps only the last `logits_to_keep` queries in its
        KV-sharing layers (`mask[:, :, -n:, :]`); the dense mask is sliced when built."""
        if self._index is not None:
            raise TypeError("hf_paged: a LazyMask is sliced once (transformers slices the queries of later layers once)")
        return LazyMask(self._kwargs, index)

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
            mask = fn(**self._kwargs)
            self._built[kind] = mask[self._index] if mask is not None and self._index is not None else mask
        return self._built[kind]


# .step: the PAGED step whose forward this thread runs next, else None; .written: for the PAGED step whose
# forward runs, [{layer: (keys, values)} the cache handed each layer, the step, the last (keys, values)
# handed out], all weak references.
_pending = threading.local()


def note_paged_step(step: StepMetadata | None) -> None:
    """Set (a PAGED step's forward is about to run in this thread) or clear (it ended, or was dropped)
    what the mask function sees; called by the cache that plans steps."""
    _pending.step = step if step is not None and step.mode == PAGED else None


class UnsupportedModelError(ValueError):
    """The model cannot be served by "hf_paged" attention at all (not one request's problem, and not
    transient): a retry would fail the same way, so the engine ends the step's requests at once."""


def note_paged_write(keys: torch.Tensor | None, values: torch.Tensor | None = None,
                     step: StepMetadata | None = None, layer_idx: int | None = None) -> None:
    """Record (or forget, with None) the key and value blocks the cache just handed layer `layer_idx` in
    `step`, a PAGED step. Attention that receives them without the step's metadata was called by a layer
    that does not pass its keyword arguments on; attention that receives that step's metadata with
    other tensors than its layer's (or, for a layer reading another's K/V, its source's) was called by
    a module that changed the K/V after `cache.update` (see `paged_attention_forward`). Weak
    references: a record never keeps a pool or a step alive."""
    if keys is None:
        _pending.written = None
        return
    written = getattr(_pending, "written", None)
    if written is None or written[1]() is not step:
        written = _pending.written = [{}, weakref.ref(step), None]
    written[0][layer_idx] = written[2] = (weakref.ref(keys), weakref.ref(values))


def is_paged_blocks(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `key`/`value` are the blocks the cache handed out last in this thread's PAGED step (a
    latent-attention module's `expand_kv` passes them on unexpanded: `hf.latent`)."""
    written = getattr(_pending, "written", None)
    last = written[2] if written is not None else None
    return last is not None and key is last[0]() and value is last[1]()


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
    """The function registered as "hf_paged" in `AttentionInterface`. See the module docstring.

    `indices` (keyword, indexed sparse attention: DeepSeek V3.2, GLM-5): `[batch, q_len, W]` int key
    positions the layer's indexer picked per query (-1: none). A paged step attends over those keys'
    latent rows only (`sparse`); a dense call masks every other key, as transformers' eager and sdpa do.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if paged_metadata is COMPILED_STEP:
        return _compiled_attention(module, query, key, value, dropout, scaling, sliding_window, softcap, s_aux,
                                   kwargs), None
    indices = kwargs.pop("indices", None)
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
        meta = paged_metadata
        if query.shape[2] != meta.q_len:  # Gemma 4's KV-sharing layers keep only the last queries
            meta = meta.last_columns(query.shape[2])
        layer_idx = getattr(module, "layer_idx", None)
        if not isinstance(layer_idx, int):
            layer_idx = meta.active_layer
        # A layer reading another layer's K/V (Gemma 3n/4 "reuse" layers) gets its source's blocks.
        source = meta.source_of(layer_idx)
        written = getattr(_pending, "written", None)
        if written is not None and written[1]() is meta.parent and not _is_written(written, source, key, value):
            raise UnsupportedModelError(
                f"hf_paged: {type(module).__name__} passes its attention other K/V than the blocks "
                "PagedCache.update returned (it transforms the cached states after the update, as DiffLlama "
                "splits its values), and the paged kernels read K/V from the blocks, so they would ignore "
                "that; attn_implementation='hf_paged' cannot serve this model: load it with "
                "attn_implementation='sdpa' or 'eager'"
            )
        group = meta.group_of(layer_idx)
        sliding_window, chunk_size = _layer_mask(meta, layer_idx, group, sliding_window)
        if meta.plan is None:  # metadata no cache began (a caller's own step): plan it once, here
            meta.plan = dispatch.plan(meta)
        scales = meta.kv_scales.get(source)
        if scales is None and key.element_size() == 1:
            raise ValueError(
                f"hf_paged: the attention got {key.dtype} (quantised) blocks whose scales this step never registered; "
                "pass the key/value tensors PagedCache.update returned to the attention unchanged"
            )
        query = meta.pack(query)
        if meta.num_columns == 0 and getattr(module, "attn_temperature_tuning", False) \
                and not getattr(module, "use_rope", True):
            query = _packed_temperature(module, query, meta)
        latent_dim = value.shape[-1] if is_latent_call(module, key, value) else None
        if latent_dim is not None:  # latent rows: the up-projection absorbed into the query (`latent`)
            why = absorb_refusal(module)
            if why is not None:
                raise UnsupportedModelError(why)
            query = absorb_query(module, query)
        if indices is not None:
            if latent_dim is None:
                raise UnsupportedModelError(
                    f"hf_paged: {type(module).__name__} passes its attention indexer top-k indices over K/V that are "
                    "not latent rows; paged sparse attention reads latent rows only: load it with "
                    "attn_implementation='sdpa'")
            out = sparse_latent_attention(query, key, meta.block_tables_of(group), meta.cu_seqlens_q,
                                          meta.pack(indices.unsqueeze(1))[:, 0], scaling, latent_dim,
                                          sinks=s_aux, softcap=softcap)
            return meta.unpack(expand_output(module, out)), None
        out = dispatch.paged_attention(
            query,
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
            chunk_size=chunk_size,
            latent_dim=latent_dim,
        )
        if latent_dim is not None:
            out = expand_output(module, out)
        return meta.unpack(out), None
    written = getattr(_pending, "written", None)
    if written is not None and any(key is k() for k, _ in written[0].values()):
        raise UnsupportedModelError(
            f"hf_paged: {type(module).__name__} got the paged cache's K/V blocks without the step's metadata: a "
            "decoder layer of this model does not pass its keyword arguments on to its attention, so "
            "attn_implementation='hf_paged' cannot serve it; load it with attn_implementation='sdpa' or 'eager'"
        )
    return _dense_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                            s_aux, indices=indices, **kwargs)


# ---------------------------------------------------------------------------------- compiled steps
class CompiledStep:
    """The `paged_metadata` a compiled decode forward passes (`COMPILED_STEP`, the one instance): the
    step itself is `compiled_step`'s, read by the attention op at run time."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "COMPILED_STEP"


COMPILED_STEP = CompiledStep()
_compiled = threading.local()  # .handler: what the attention ops of the compiled forward running in this thread call


@contextlib.contextmanager
def compiled_step(handler):
    """While this block runs, the attention ops of a compiled forward in this thread call
    `handler(query, key, value, layer_idx, scaling, sliding_window, softcap, sinks)`, which writes the
    layer's new K/V and returns its attention output as `step_attention` describes (the worker's
    `cpu_graphs.StepAttention`: the step's cache and metadata, and the eager path through this module)."""
    previous = getattr(_compiled, "handler", None)
    _compiled.handler = handler
    try:
        yield
    finally:
        _compiled.handler = previous


@torch.library.custom_op("hf_paged::step_attention", mutates_args=())
def step_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scaling: float,
                   sliding_window: int | None, softcap: float | None,
                   sinks: torch.Tensor | None) -> torch.Tensor:  # [batch, q_len, num_q_heads, head_dim_v]
    """One layer of a compiled forward's step: write the new K/V (`key`/`value`, [batch, num_kv_heads,
    q_len, head_dim]) and attend `query` ([batch, num_q_heads, q_len, head_dim]) over the layer's
    blocks, as an eager step does (see `compiled_step`). The K/V pool is written behind the compiler's
    back: nothing else in the graph reads it, and each layer's output feeds the next."""
    handler = getattr(_compiled, "handler", None)
    if handler is None:
        raise RuntimeError("hf_paged: a compiled forward ran outside `compiled_step` (no step to attend with)")
    return handler(query, key, value, layer_idx, scaling, sliding_window, softcap, sinks)


@step_attention.register_fake
def _(query, key, value, layer_idx, scaling, sliding_window, softcap, sinks):
    batch, heads, q_len, _ = query.shape
    return query.new_empty(batch, q_len, heads, value.shape[-1])


def _compiled_attention(module, query, key, value, dropout, scaling, sliding_window, softcap, s_aux, kwargs):
    """The compiled forward's attention call: the op above, for a layer the compiler traces."""
    layer_idx = getattr(module, "layer_idx", None)
    extra = sorted(k for k, v in kwargs.items()
                   if v is not None and v is not False and k not in _IGNORED_COMPILED_KWARGS)
    if dropout or not isinstance(layer_idx, int) or extra:
        raise UnsupportedModelError(
            f"hf_paged: {type(module).__name__}'s attention call cannot be compiled (dropout={dropout}, layer_idx="
            f"{layer_idx!r}, arguments {extra})")
    return step_attention(query, key, value, layer_idx, float(scaling), sliding_window,
                          None if softcap is None else float(softcap), s_aux)


# Keyword arguments a decoder hands its attention that the paged path ignores as an eager step does.
_IGNORED_COMPILED_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "position_embeddings"})


def _packed_temperature(module, query: torch.Tensor, meta: StepMetadata) -> torch.Tensor:  # [num_tokens, heads, dim]
    """Llama 4's NoPE layers scale each query by `log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`
    (attention temperature tuning) with `p = arange(q_len) + cache.get_seq_length()`: in an engine step
    (sequences packed in one row, no columns) that counts packed indices, not each token's position in
    its sequence. Rescale to the positions stock computes for each sequence alone. Where the packed index
    gave scale 1 (index < floor_scale - 1: every token of a step below ~8k tokens) the product is
    stock's exactly; above, the wrong scale is divided out first."""
    num_tokens = query.shape[0]
    device = query.device
    cu, seq_lens = meta.cu_seqlens_q.to(device).long(), meta.seq_lens.to(device).long()
    q_lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=device), q_lens, output_size=num_tokens)
    index = torch.arange(num_tokens, device=device)
    positions = index - cu[seq] + (seq_lens - q_lens)[seq]

    def scale(p):  # [num_tokens] float32, as the module computes it
        return torch.log1p(torch.floor((p.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    wrong, right = scale(index)[:, None, None], scale(positions)[:, None, None]
    if num_tokens + 1 >= module.floor_scale:
        query = query / wrong
    return (query * right).to(query.dtype)


def _is_written(written, layer_idx: int | None, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `key`/`value` are the blocks the cache handed layer `layer_idx` in the recorded step, or
    the blocks it handed out last (a module whose `layer_idx` is not its cache layer's)."""
    for blocks in (written[0].get(layer_idx), written[2]):
        if blocks is not None and key is blocks[0]() and value is blocks[1]():
            return True
    return False


def _layer_mask(meta: StepMetadata, layer_idx: int | None, group: int,
                sliding_window: int | None) -> tuple[int | None, int | None]:
    """(sliding_window, chunk_size) layer `layer_idx` attends with: the window its attention names,
    else its spec's (the config slides the layer, as transformers' DynamicCache and the model's own
    mask read it, but its attention names no window: PhiMoE, Qwen2-MoE), and its spec's chunk (Llama 4
    names none). Raises ValueError when its blocks are kept for less than that reads."""
    own = meta.mask_of(layer_idx)
    kept = meta.group_masks[group] if meta.group_masks else None
    if sliding_window is None:
        sliding_window = own.window
    if kept is not None and kept.window is not None and (sliding_window is None or sliding_window > kept.window):
        raise ValueError(
            f"hf_paged: layer {layer_idx} attends with sliding_window={sliding_window}, but its KV blocks are kept "
            f"for a window of {kept.window} tokens only (the model config's layer_types / sliding_window disagree "
            "with its attention)"
        )
    if kept is not None and kept.chunk is not None and own.chunk != kept.chunk:
        raise ValueError(
            f"hf_paged: layer {layer_idx} attends with attention_chunk_size={own.chunk}, but its KV blocks are kept "
            f"for chunks of {kept.chunk} tokens only"
        )
    return sliding_window, own.chunk


def _dense_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, s_aux,
                     indices=None, **kwargs):
    needs_eager = softcap is not None or s_aux is not None or kwargs.get("output_attentions", False)
    if needs_eager:
        if isinstance(attention_mask, LazyMask):
            mask = attention_mask.build("eager")
        else:
            mask = _additive_mask(attention_mask, query, key, sliding_window, getattr(module, "is_causal", True),
                                  _chunk_of(module))
        if indices is not None:
            mask = _keep_indexed(mask, indices, query, key)
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", _eager_attention)
        extra = {"softcap": softcap} if softcap is not None else {}
        if s_aux is not None:
            extra["s_aux"] = s_aux
        return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                     sliding_window=sliding_window, **extra, **kwargs)
    mask = attention_mask.build("sdpa") if isinstance(attention_mask, LazyMask) else attention_mask
    if mask is None and getattr(module, "is_causal", True) and 1 < query.shape[2] < key.shape[2]:
        # The model kept only the last queries (Gemma 4's KV-sharing layers, `logits_to_keep`) where sdpa's
        # mask was skipped: sdpa's own `is_causal` would align them top-left; they are the last positions.
        mask = _additive_mask(None, query, key, sliding_window, True, _chunk_of(module))
    if indices is not None:
        mask = _keep_indexed(mask, indices, query, key)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _keep_indexed(mask, indices: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """`mask` with every key the indexer did not pick for a query masked out, as transformers' DSA
    attention does for eager and sdpa (scatter the top-k into a bool mask; AND a bool mask, fill a float
    one with the dtype's min). `indices`: [batch, q_len, W] key columns, -1 (none) ignored; a None mask
    (sdpa's causal skip) is the causal mask."""
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if indices.dim() != 3 or indices.shape[1] != q_len or indices.shape[0] not in (1, batch):
        raise ValueError(f"hf_paged: indices of shape {tuple(indices.shape)} for {batch} rows of {q_len} queries; "
                         "the indexer's top-k is [batch, q_len, topk]")
    columns = indices.long().to(query.device)
    columns = columns.masked_fill(columns < 0, kv_len)  # -1 lands in a spare column, dropped below
    picked = torch.zeros(indices.shape[0], q_len, kv_len + 1, dtype=torch.bool, device=query.device)
    not_picked = ~picked.scatter_(-1, columns, True)[..., :kv_len].unsqueeze(1)  # [batch, 1, q_len, kv_len]
    if mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
        mask = (torch.arange(kv_len, device=query.device)[None, :] <= q_pos)[None, None]
    if mask.dtype == torch.bool:
        return mask & ~not_picked
    return mask.masked_fill(not_picked, torch.finfo(query.dtype).min)


def _chunk_of(module) -> int | None:
    """The attention chunk of a chunked-attention layer (Llama 4's, from its config's `layer_types`), else None."""
    config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if isinstance(idx, int) and types and idx < len(types) and types[idx] == "chunked_attention":
        return getattr(config, "attention_chunk_size", None)
    return None


def _additive_mask(mask, query: torch.Tensor, key: torch.Tensor, sliding_window: int | None, causal: bool = True,
                   chunk_size: int | None = None):
    """The eager (additive float) form of an sdpa mask, as transformers' `eager_mask` builds it: a bool
    mask becomes 0 / dtype-min; None (sdpa's skip: no padding) becomes the causal mask (sliding-window
    if the layer slides, chunked if it attends in chunks) for a causal module, and stays None (attend to
    everything) for another. Without padding, column i is position i, so chunks start at column 0."""
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
        if chunk_size is not None:
            mask &= k_pos // chunk_size == q_pos // chunk_size
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
