"""`PagedLayer`: one layer's K/V blocks, a transformers `CacheLayerMixin`.

Its tensors (and a quantised layer's scales) are allocated on the layer's first write, with the
device, dtype and head shape of the states it receives; layers of different KV groups that share a
storage slot share its tensors (`config.kv_layout`). The layer belongs to a `KVOwner`, which sizes,
grows and copies its blocks; its Cache-API answers (lengths, reset) are those of the owner's
`PagedCache` adapter.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..attention.kv_quant import KVQuant, KVScales


class PagedLayer(CacheLayerMixin):
    """One layer's K/V blocks. Allocated on the layer's first `update`, on the device and with the
    head shape of the states it receives; resized only when the shared pool grows."""

    is_compileable = False
    is_croppable = True

    def __init__(self, kv, is_sliding: bool = False, group: int = 0, slot: int = 0):
        super().__init__()
        self._kv = kv
        self.is_sliding = is_sliding
        self.group = group  # its KV group: which block table of each sequence it reads
        self.slot = slot  # its storage slot: layers of other groups in the same slot share its tensors
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
        self.keys = torch.zeros(num_blocks, block_size, num_kv_heads, key_states.shape[3], dtype=dtype,
                                device=self.device)
        self.values = torch.zeros(num_blocks, block_size, value_states.shape[1], value_states.shape[3],
                                  dtype=dtype, device=self.device)
        if kv.cache_config.kv_dtype.is_quantized:
            quant = self.quant or kv.default_quant
            shape = (num_blocks, block_size, *quant.scales_shape(num_kv_heads))
            self.scales = KVScales(torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device),
                                   quant)
        self.is_initialized = True

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
        growth only); with `like`, a layer of the same slot already resized, share its new tensors."""
        if not self.is_initialized or self.keys.shape[0] == num_blocks:
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
        """Copy whole blocks `src[i]` -> `dst[i]` (copy-on-write), payload and scales alike."""
        if self.is_initialized:
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
