"""The cache layers of a paged pool, transformers `CacheLayerMixin`s: `PagedLayer` (a layer's K/V
blocks), `LatentLayer` (a latent-attention layer's rows) and `SharedLayer` (a layer that reads
another layer's K/V and stores none).

A `PagedLayer`'s tensors (and a quantised layer's scales) are allocated on the layer's first write,
with the device, dtype and head shape of the states it receives; layers of different KV groups that
share a storage slot share its tensors (`config.kv_layout`). When the layers differ in K/V shape its
tensors are views of the pool's page buffers instead (`pages.py`). The layer belongs to a `KVOwner`,
which sizes, grows and copies its blocks; its Cache-API answers (lengths, reset) are those of the
owner's `PagedCache` adapter.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

try:
    from transformers.cache_utils import DummyLayer
except ImportError:  # transformers < 5.23: no layer class for layers that store nothing; ours says the same

    class DummyLayer:
        """A cache layer that stores nothing (a layer reading another's K/V): what transformers' own
        `DummyLayer` is from 5.23 on."""

        is_compileable = True
        is_croppable = True

        def __init__(self, **kwargs):
            self.is_initialized = True
            self.keys = self.values = None

        def update(self, key_states, value_states, *args, **kwargs):
            if key_states is None and value_states is None:
                return None, None
            raise NotImplementedError("this cache layer reads another layer's K/V; it stores none")

        def offload(self): ...
        def prefetch(self): ...
        def reset(self): ...
        def crop(self, tokens_to_remove: int): ...
        def reorder_cache(self, beam_idx): ...
        def batch_repeat_interleave(self, repeats: int): ...
        def batch_select_indices(self, indices): ...

        def get_max_length(self) -> int:
            return -1

from ..attention.kv_quant import KVQuant, KVScales
from ..kv_spec import FullAttention, LayerSpec, SharedKV
from . import pool_memory


class PagedLayer(CacheLayerMixin):
    """One layer's K/V blocks. Allocated on the layer's first `update`, on the device and with the
    head shape of the states it receives; resized only when the shared pool grows.

    Args:
        kv: the owning `KVOwner`.
        spec: the layer's `kv_spec.LayerSpec` (its own kind, whatever its blocks are kept for).
        group: its KV group: which block table of each sequence it reads.
        slot: its storage slot: layers of other groups in the same slot share its tensors.
        offset_k, offset_v: with per-layer K/V shapes, its element offsets per token in the page.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, kv, spec: LayerSpec | None = None, group: int = 0, slot: int = 0, offset_k: int = 0,
                 offset_v: int = 0):
        super().__init__()
        self._kv = kv
        self.spec = spec if spec is not None else FullAttention()
        # Sliding and chunked alike: transformers sizes both masks from the first layer that says so, and
        # its DynamicCache keeps a chunked layer as a sliding one of the chunk.
        self.is_sliding = self.spec.reach is not None
        self.group = group
        self.slot = slot
        self.offset_k, self.offset_v = offset_k, offset_v
        # A quantised layer's scales and scheme (`kv_quant.KVScales`), set with its tensors; None unquantised.
        self.scales: KVScales | None = None
        self.quant: KVQuant | None = None  # set before initialisation (a checkpoint's static scales)

    def belongs_to(self, kv) -> bool:
        """Whether this layer is one of `kv`'s (a model's own copy of a cache layer carries a copied owner)."""
        return self._kv is kv

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        kv = self._kv
        num_blocks, block_size = kv.pool.num_blocks, kv.block_size
        dtype = kv.kv_dtype or key_states.dtype
        self.device = key_states.device
        num_kv_heads = key_states.shape[1]
        if kv.pages is not None:  # per-layer K/V shapes: a view of the page buffers
            self._view_pages(key_states, value_states, dtype)
            return
        owner = kv.slot_owner(self.slot)
        if owner is not None:  # another group's layer already holds this slot's tensors: share them
            shape = (num_blocks, block_size, num_kv_heads, key_states.shape[3])
            if tuple(owner.keys.shape) != shape or owner.values.shape[2:] != value_states.shape[1:4:2] \
                    or owner.keys.dtype != dtype or owner.device != self.device:
                raise ValueError(
                    f"hf_paged: layers sharing KV storage slot {self.slot} differ in K/V shape, dtype or device "
                    f"({tuple(owner.keys.shape)} {owner.keys.dtype} vs {shape} {dtype}); this model's sliding and "
                    "full layers cannot share one block pool; load it with attn_implementation='sdpa' or 'eager'"
                )
            self.keys, self.values = owner.keys, owner.values
            if owner.scales is not None:
                self.scales = KVScales(owner.scales.key, owner.scales.value, self.quant or kv.default_quant)
            self.is_initialized = True
            return
        # zeros, not empty: padding columns of the dense path read never-written slots
        self.keys = pool_memory.zeros((num_blocks, block_size, num_kv_heads, key_states.shape[3]), dtype,
                                      self.device)
        self.values = pool_memory.zeros((num_blocks, block_size, value_states.shape[1], value_states.shape[3]),
                                        dtype, self.device)
        if kv.cache_config.kv_dtype.is_quantized:
            quant = self.quant or kv.default_quant
            shape = (num_blocks, block_size, *quant.scales_shape(num_kv_heads))
            self.scales = KVScales(torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device),
                                   quant)
        self.is_initialized = True

    def _view_pages(self, key_states: torch.Tensor, value_states: torch.Tensor, dtype: torch.dtype) -> None:
        pages, shape = self._kv.pages, self.spec.shape
        got = (key_states.shape[1], key_states.shape[3], value_states.shape[3])
        if got != (shape.num_kv_heads, shape.head_dim, shape.head_dim_v):
            raise ValueError(
                f"hf_paged: a layer wrote K/V of {got[0]} heads x {got[1]} (V {got[2]}), but the config gives it "
                f"{shape.num_kv_heads} x {shape.head_dim} (V {shape.head_dim_v}); its blocks are sized from the config "
                "when the layers differ in K/V shape")
        if not pages.is_allocated:
            pages.allocate(self._kv.pool.num_blocks, dtype, self.device)
        elif pages.keys.dtype != dtype or pages.keys.device != self.device:
            raise ValueError(
                f"hf_paged: layers whose K/V shapes differ share one page buffer ({pages.keys.dtype} on "
                f"{pages.keys.device}), but this layer writes {dtype} on {self.device}; load the model on one device")
        self.keys, self.values = pages.views(shape, self.offset_k, self.offset_v)
        self.is_initialized = True

    def paged_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (key, value) blocks a PAGED step hands the layer's attention."""
        return self.keys, self.values

    def payload(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding its tokens' K/V, each [num_blocks, block_size, heads, width] (what a
        K/V transfer moves)."""
        return self.keys, self.values

    def _tensors(self) -> list[tuple[object, str]]:
        """(owner, attribute) of every tensor with a block dimension: K, V and a quantised layer's scales."""
        pairs = [(self, "keys"), (self, "values")]
        if self.scales is not None:
            pairs += [(self.scales, "key"), (self.scales, "value")]
        return pairs

    @property
    def key_scales(self) -> torch.Tensor | None:  # [num_blocks, block_size, groups, channels] or None
        return None if self.scales is None else self.scales.key

    @property
    def value_scales(self) -> torch.Tensor | None:
        return None if self.scales is None else self.scales.value

    def resize(self, num_blocks: int, like: "PagedLayer | None" = None) -> None:
        """Grow the block dimension to `num_blocks`, keeping existing blocks and their scales (pool
        growth only); with `like`, a layer of the same slot already resized, share its new tensors.
        A view of page buffers (already grown by the owner) takes its view again."""
        if not self.is_initialized or self.keys.shape[0] == num_blocks:
            return
        if self._kv.pages is not None:
            self.keys, self.values = self._kv.pages.views(self.spec.shape, self.offset_k, self.offset_v)
            return
        if like is not None:
            self.keys, self.values = like.keys, like.values
            if self.scales is not None:
                self.scales.key, self.scales.value = like.scales.key, like.scales.value
            return
        for owner, name in self._tensors():
            old = getattr(owner, name)
            new = old.new_zeros(num_blocks, *old.shape[1:])
            new[: old.shape[0]] = old
            setattr(owner, name, new)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks `src[i]` -> `dst[i]` (copy-on-write), payload and scales alike (a view of
        page buffers: the owner copies the pages whole)."""
        if self.is_initialized and self._kv.pages is None:
            # Tensors first written inside an engine forward are inference tensors: copy-on-write
            # before the next forward must write them in the same mode.
            with torch.inference_mode(self.keys.is_inference()):
                src, dst = src.to(self.device), dst.to(self.device)
                for owner, name in self._tensors():
                    tensor = getattr(owner, name)
                    if tensor.element_size() == 1:  # float8 has no advanced indexing on some torch builds
                        tensor = tensor.view(torch.uint8)
                    tensor[dst] = tensor[src]

    def bytes_per_block(self) -> int:
        """Bytes one block of this (initialised) layer takes: K and V payload plus their scales."""
        return sum(getattr(o, n)[0].numel() * getattr(o, n).element_size() for o, n in self._tensors())

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("PagedLayer is written through PagedCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._kv.cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._kv.cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._kv.cache.reset()


class SharedLayer(DummyLayer):
    """A layer that attends over another layer's K/V (`kv_spec.SharedKV`: Gemma 3n's and Gemma 4's
    "reuse" layers). It never writes (the model hands it its source's states, `shared_kv_states`),
    owns no blocks and no tensors, and is a transformers `DummyLayer` (`Cache.is_dummy`), as in stock's
    `DynamicCache`; the attention reads its source's blocks with its own mask.

    Attributes:
        spec: its `SharedKV` spec (`source`: the layer whose K/V it reads).
        group, slot: its source's (which block table its attention reads).
    """

    def __init__(self, spec: SharedKV, group: int = 0, slot: int = 0):
        super().__init__()
        self.spec = spec
        self.source = spec.source
        self.is_sliding = spec.reach is not None
        self.group, self.slot = group, slot


class LatentLayer(PagedLayer):
    """A multi-head latent attention layer's blocks (`kv_spec.LatentAttention`): one row per token,
    `rows [num_blocks, block_size, 1, L + R + I]` = the latent (`kv_lora_rank` L), the rotary key
    (`qk_rope_head_dim` R) and, for indexed sparse attention, the indexer's key (`index_head_dim` I).

    Views of the rows (no copies): `keys` the latent and `values` the rotary key (what the model passes
    to `cache.update`, written and gathered as any layer's K and V), `kv_rows` the latent and rotary key
    together (the one K "head" absorbed attention reads; its V is `keys`), `index_keys` the indexer's.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        kv, shape = self._kv, self.spec.shape
        got = (key_states.shape[1], key_states.shape[3], value_states.shape[3])
        if got != (1, shape.head_dim, shape.head_dim_v):
            raise ValueError(
                f"hf_paged: a latent-attention layer wrote K/V of {got[0]} heads x {got[1]} (V {got[2]}), but the "
                f"config gives it one latent of {shape.head_dim} and a rotary key of {shape.head_dim_v}")
        self.device = key_states.device
        dtype = kv.kv_dtype or key_states.dtype
        # zeros, not empty: padding columns of the dense path read never-written slots
        self.rows = pool_memory.zeros((kv.pool.num_blocks, kv.block_size, 1, self.spec.row_width), dtype,
                                      self.device)
        self._take_views()
        self.is_initialized = True

    def _take_views(self) -> None:
        latent, rope = self.spec.shape.head_dim, self.spec.shape.head_dim_v
        self.keys = self.rows[..., :latent]
        self.values = self.rows[..., latent:latent + rope]
        self.kv_rows = self.rows[..., :latent + rope]
        self.index_keys = self.rows[..., latent + rope:] if self.spec.index_dim else None

    def paged_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_rows, self.keys

    def payload(self) -> tuple[torch.Tensor, ...]:
        return (self.rows,)

    def _tensors(self) -> list[tuple[object, str]]:
        return [(self, "rows")]

    def resize(self, num_blocks: int, like: "PagedLayer | None" = None) -> None:
        if not self.is_initialized or self.rows.shape[0] == num_blocks:
            return
        if like is not None:
            self.rows = like.rows
        else:
            new = self.rows.new_zeros(num_blocks, *self.rows.shape[1:])
            new[: self.rows.shape[0]] = self.rows
            self.rows = new
        self._take_views()
