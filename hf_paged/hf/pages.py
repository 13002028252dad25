"""Byte pages: the K/V storage of a pool whose layers differ in K/V shape (Gemma 4's full layers keep
`num_global_key_value_heads` heads of `global_head_dim`, its sliding layers more heads of a smaller
`head_dim`).

Layers of one shape keep one contiguous `[num_blocks, block_size, heads, dim]` tensor per storage slot
(`PagedLayer`). With several shapes a block is instead one row of a K page buffer and one of a V page
buffer, and each layer's K/V a strided view at its element offset in the page (`config.kv_layout`
balances the groups by bytes, so nothing is padded to the largest layer):

    page_k elements per token, block_size tokens per block:

    keys   [num_blocks, block_size * page_k]
    block b: | layer a: bs*h_a*d_a | layer c: bs*h_c*d_c | ... |     (the layers of the group holding b)
    layer a's K = keys[:, bs*off_a : bs*(off_a + h_a*d_a)].view(num_blocks, bs, h_a, d_a)
                  (block stride bs*page_k: not contiguous, the kernels read it by its strides)

A block id means the same bytes in every group, exactly as with slot tensors: whichever group holds
block b, its layers' views cover that group's part of row b.
"""

from __future__ import annotations

import torch

from ..kv_spec import KVShape
from . import pool_memory


class PageBuffers:
    """The K and V page buffers of one pool, allocated at the first write (device and dtype of the
    states) and grown with the pool.

    Args:
        block_size: tokens per block.
        page_k, page_v: elements per token of one block's K (V) page (`KVLayout.page_k` / `page_v`).
    """

    def __init__(self, block_size: int, page_k: int, page_v: int):
        self.block_size = block_size
        self.page_k, self.page_v = page_k, page_v
        self.keys: torch.Tensor | None = None  # [num_blocks, block_size * page_k]
        self.values: torch.Tensor | None = None  # [num_blocks, block_size * page_v]

    @property
    def is_allocated(self) -> bool:
        return self.keys is not None

    def allocate(self, num_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        # zeros, not empty: padding columns of the dense path read never-written slots
        self.keys = pool_memory.zeros((num_blocks, self.block_size * self.page_k), dtype, device)
        self.values = pool_memory.zeros((num_blocks, self.block_size * self.page_v), dtype, device)

    def views(self, shape: KVShape, offset_k: int, offset_v: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V: [num_blocks, block_size, num_kv_heads, head_dim] (V: head_dim_v) views
        whose block stride is the page."""
        bs, n = self.block_size, self.keys.shape[0]
        width_k, width_v = shape.num_kv_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim_v
        keys = self.keys[:, bs * offset_k: bs * (offset_k + width_k)].view(n, bs, shape.num_kv_heads, shape.head_dim)
        values = self.values[:, bs * offset_v: bs * (offset_v + width_v)].view(n, bs, shape.num_kv_heads,
                                                                                 shape.head_dim_v)
        return keys, values

    def resize(self, num_blocks: int) -> None:
        """Grow both buffers to `num_blocks` rows, keeping the existing blocks (new tensors: every
        layer's views must be taken again)."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            if old is None or old.shape[0] >= num_blocks:
                continue
            new = old.new_zeros(num_blocks, old.shape[1])
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks `src[i]` -> `dst[i]` (copy-on-write): every layer of the page at once."""
        if self.keys is None:
            return
        with torch.inference_mode(self.keys.is_inference()):
            src, dst = src.to(self.keys.device), dst.to(self.keys.device)
            for buffer in (self.keys, self.values):
                if buffer.element_size() == 1:  # float8 has no advanced indexing on some torch builds
                    buffer = buffer.view(torch.uint8)
                buffer[dst] = buffer[src]

    def bytes_per_block(self) -> int:
        """Bytes of one block's K and V pages as allocated."""
        return self.keys[0].numel() * self.keys.element_size() + self.values[0].numel() * self.values.element_size()
