"""Indexers of indexed sparse attention in paged steps: each selects keys per sequence, from the pool.

DeepSeek V3.2 (DSA), GLM-5 (`glm_moe_dsa`), HY v4 and AXK2 give each indexed latent-attention layer
an indexer module: it projects a small key per token (`cache.update_indexer` keeps them), scores
every cached key against each query, and returns each query's top `index_topk` key positions, which
the attention reads (the "hf_paged" function gets them as `indices=`: `attention.sparse`).

The module scores a padded `[batch, q_len, kv_len]` problem under the model's mask. A paged step
has no such batch: an engine step packs every sequence into one row (`[1, num_tokens]`), and its
mask is a `LazyMask`. `install_indexers` wraps each indexer's forward: in a PAGED step it runs the
module's own forward (its projections, norm, rotary embedding and scoring, whatever the family) on
the step's sequences, batched by query count, each with a causal mask by position (a chunk of a
longer prompt and a speculative verify read every earlier key and none after) and a cache
(`_SequenceKeys`) that writes the new keys into the pool and hands back each sequence's cached keys,
read through its block table. The result is each packed query's top-k as positions in its own
sequence, -1 past the keys it has, `[batch, q_len, W]` in the call's layout (W: the step's widest
top-k). Any other call (a dense step, training, another cache) runs the module as it is.
"""

from __future__ import annotations

import inspect
import threading
import weakref

import torch

from ..attention.interface import UnsupportedModelError
from ..attention.metadata import PAGED, StepMetadata
from ..attention.sparse import read_index_keys, write_index_keys

_WRAPPED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_ARGS = ("hidden_states", "q_resid", "position_embeddings", "attention_mask")
# The last step's host facts and per-group batches (one forward at a time per thread): (step ref, plans).
_plans = threading.local()


def indexer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's indexer modules: an attention module's `indexer` that names `index_topk`."""
    found = []
    for module in model.modules():
        indexer = getattr(module, "indexer", None)
        if isinstance(indexer, torch.nn.Module) and hasattr(indexer, "index_topk") and indexer not in found:
            found.append(indexer)
    return found


def indexer_refusal(model: torch.nn.Module) -> str | None:
    """Why the model's indexers cannot run per sequence in paged steps (None: they can, or it has
    none): a forward that does not take the arguments transformers' DSA indexers take
    (`hidden_states, q_resid, position_embeddings, attention_mask, ..., cache`), or no `layer_idx`."""
    for module in indexer_modules(model):
        if module in _WRAPPED:  # its own forward was checked when it was wrapped
            continue
        params = inspect.signature(module.forward).parameters
        missing = [name for name in (*_ARGS, "cache") if name not in params
                   and not (name == "cache" and "past_key_values" in params)]
        if missing or not isinstance(getattr(module, "layer_idx", None), int):
            return (f"its {type(module).__name__} takes no {missing or ['layer_idx']}, so paged steps cannot run it "
                    "per sequence")
    return None


def install_indexers(model: torch.nn.Module) -> bool:
    """Make every indexer module of `model` select per sequence in paged steps (idempotent). Returns
    False when the model has none.

    Raises:
        UnsupportedModelError: an indexer that could not be run per sequence (`indexer_refusal`).
    """
    reason = indexer_refusal(model)
    if reason is not None:
        raise UnsupportedModelError(f"hf_paged: model_type={model.config.model_type!r}: {reason}; load it with "
                                    "attn_implementation='sdpa'")
    modules = indexer_modules(model)
    for module in modules:
        if module not in _WRAPPED:
            module.forward = _per_sequence(module, module.forward)
            _WRAPPED.add(module)
    return bool(modules)


def is_installed(model: torch.nn.Module) -> bool:
    """Whether every indexer module of `model` is wrapped (True for a model without one)."""
    return all(m in _WRAPPED for m in indexer_modules(model))


def _per_sequence(module: torch.nn.Module, forward):
    signature = inspect.signature(forward)
    module_ref = weakref.ref(module)  # the wrapper lives on the module: no cycle through it

    def wrapped(*args, **kwargs):
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:  # arguments the module's own forward will name in its error (or rename: past_key_values)
            return forward(*args, **kwargs)
        cache = bound.get("cache", bound.get("past_key_values"))
        step = _paged_step(cache, module_ref().layer_idx)
        if step is None:
            return forward(*args, **kwargs)
        return _select(module_ref(), forward, cache, step, bound)

    return wrapped


def _paged_step(cache, layer_idx: int) -> StepMetadata | None:
    """The PAGED step `cache` (a `PagedCache`) is running, whose layer `layer_idx` it has just written; else None."""
    kv = getattr(cache, "kv", None)
    step = getattr(kv, "step", None)
    if not isinstance(step, StepMetadata) or step.mode != PAGED:
        return None
    if layer_idx not in step.layers_done:
        raise UnsupportedModelError(
            f"hf_paged: indexer of layer {layer_idx} ran before its layer's cache.update in a paged step; its keys "
            "are stored beside that layer's latents, so attn_implementation='hf_paged' cannot serve this model")
    return step


class _SequenceKeys:
    """The cache an indexer sees for a batch of sequences: `update_indexer` stores their new keys in the
    pool and returns every key they hold, `[n, T, I]` (zeros past a sequence's end, where the mask is)."""

    def __init__(self, index_keys: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, num_keys: int):
        self.index_keys, self.slots, self.block_tables = index_keys, slots, block_tables
        self.seq_lens, self.num_keys = seq_lens, num_keys

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:  # [n, T, I]
        keys = indexer_key_states
        write_index_keys(self.index_keys, self.slots.reshape(-1), keys.reshape(-1, keys.shape[-1]))
        return read_index_keys(self.index_keys, self.block_tables, self.seq_lens, self.num_keys, keys.dtype)


class _Batch:
    """Sequences of one query count, selected in one call: their packed tokens `[n, q]`, query
    positions, causal mask `[n, q, T]` (T: their longest), block tables and slots."""

    def __init__(self, rows: list[int], cu: list[int], seq_lens: list[int], step: StepMetadata, group: int,
                 device: torch.device):
        q_len = cu[rows[0] + 1] - cu[rows[0]]
        self.num_keys = max(seq_lens[r] for r in rows)
        lens = torch.tensor([seq_lens[r] for r in rows], device=device)
        self.tokens = torch.tensor([list(range(cu[r], cu[r] + q_len)) for r in rows], device=device)  # [n, q]
        self.positions = (lens - q_len)[:, None] + torch.arange(q_len, device=device)  # [n, q]
        self.mask = torch.arange(self.num_keys, device=device)[None, None, :] <= self.positions[..., None]
        self.seq_lens = lens
        self.block_tables = step.block_tables_of(group).to(device)[torch.tensor(rows, device=device)]
        self.slots = step.slot_mapping_of(group).to(device)[self.tokens]


def _batches(step: StepMetadata, group: int, device: torch.device) -> tuple[int, list[_Batch]]:
    """(the longest sequence, the step's batches): the same for every indexed layer of the group, so made
    once per step (reading the query and key counts on the host once)."""
    last = getattr(_plans, "last", None)
    if last is None or last[0]() is not step:
        last = _plans.last = (weakref.ref(step), {})
    key = (group, str(device))
    if key not in last[1]:
        cu, seq_lens = step.cu_seqlens_q.tolist(), step.seq_lens.tolist()
        by_len: dict[int, list[int]] = {}
        for row in range(len(seq_lens)):
            if cu[row + 1] > cu[row]:
                by_len.setdefault(cu[row + 1] - cu[row], []).append(row)
        batches = [_Batch(rows, cu, seq_lens, step, group, device) for rows in by_len.values()]
        last[1][key] = (max(seq_lens, default=0), batches)
    return last[1][key]


def _packed(step: StepMetadata, value: torch.Tensor) -> torch.Tensor:  # [num_tokens, ...]
    """A per-token tensor of the call, `[batch, q_len, ...]` (batch 1 broadcast), at the step's real tokens."""
    if value.dim() < 3 or value.shape[1] != step.q_len or value.shape[0] not in (1, step.batch_size):
        raise ValueError(f"hf_paged: an indexer argument of shape {tuple(value.shape)} is not per token of the "
                         f"step's [{step.batch_size}, {step.q_len}] batch")
    value = value.expand(step.batch_size, *value.shape[1:])
    flat = value.reshape(step.batch_size * step.q_len, *value.shape[2:])
    return flat if step.token_index is None else flat[step.token_index.to(value.device)]


def _select(module, forward, cache, step: StepMetadata, args: dict) -> torch.Tensor:  # [batch, q_len, W] int32
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("hf_paged: indexed sparse attention selects keys per sequence (host-side batching), "
                           "which a CUDA graph cannot capture")
    missing = [name for name in _ARGS[:3] if name not in args]
    if missing:
        raise TypeError(f"hf_paged: the indexer of layer {module.layer_idx} was called without {missing}")
    layer = cache.kv.layers[module.layer_idx]
    index_keys = getattr(layer, "index_keys", None)
    if index_keys is None:
        raise UnsupportedModelError(
            f"hf_paged: layer {module.layer_idx} has an indexer but its cache layer keeps no indexer keys (its "
            "config's layer_types does not say indexed_attention); load it with attn_implementation='sdpa'")
    device = args["hidden_states"].device
    longest, batches = _batches(step, step.group_of(module.layer_idx), device)
    hidden, q_resid = _packed(step, args["hidden_states"]), _packed(step, args["q_resid"])
    cos, sin = (_packed(step, t) for t in args["position_embeddings"])
    width = min(module.index_topk, longest)
    cache_name = "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"  # < 5.24
    out = torch.full((hidden.shape[0], width), -1, dtype=torch.int32, device=device)
    for batch in batches:
        tokens = batch.tokens
        keys = _SequenceKeys(index_keys, batch.slots, batch.block_tables, batch.seq_lens, batch.num_keys)
        picked = forward(hidden[tokens], q_resid[tokens], (cos[tokens], sin[tokens]), batch.mask, batch.positions,
                         **{cache_name: keys})  # [n, q, k], k = min(index_topk, T)
        # Past a query's own keys the top-k holds masked (-inf) picks when it has fewer than k keys.
        picked = picked.masked_fill(~batch.mask.gather(-1, picked.long()), -1)
        out[tokens.flatten(), :picked.shape[-1]] = picked.reshape(-1, picked.shape[-1]).to(torch.int32)
    return _unpacked(step, out)


def _unpacked(step: StepMetadata, packed: torch.Tensor) -> torch.Tensor:  # [batch, q_len, W], -1 at padding
    if step.token_index is None:
        return packed.view(step.batch_size, step.q_len, packed.shape[-1])
    out = packed.new_full((step.batch_size * step.q_len, packed.shape[-1]), -1)
    out[step.token_index.to(packed.device)] = packed
    return out.view(step.batch_size, step.q_len, packed.shape[-1])
