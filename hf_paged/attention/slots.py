"""K/V rows by slot on the torch path: the write (`store_kv`), the dense gather for non-paged
attention implementations (`gather_dense`), and the addressing both use.

A slot is `block_id * block_size + offset`. A cache is `[num_blocks, block_size, num_kv_heads,
head_dim]`, either flat (its blocks end to end: slots index a `[num_slots, ...]` view) or a byte
page's slice (a strided view whose block stride is the whole page, where layers of other shapes sit
beside it): rows are then addressed by `(block, offset)`, never through a copy of the pool.
Re-exported by `torch_paged`; knows nothing of requests or transformers.
"""

from __future__ import annotations

import torch

from .kv_quant import KVScales, dequantize, dynamic_scales, quantize, rotate


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim_v]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = do not write
    has_skipped_slots: bool = True,  # False: the caller knows there is no -1 (no check, no host sync)
    scales: KVScales | None = None,  # a quantised cache's scales: rows are quantised into the payload
) -> None:
    """Write each token's K/V row into its slot (`block_id * block_size + offset`); skip slot -1.

    K and V may have different head widths (`head_dim_v != head_dim`, e.g. the latent and rotary
    parts that DeepSeek's multi-head latent attention caches); each cache keeps its own. Rows are
    cast to each cache's dtype, or, with `scales`, quantised (`kv_quant.quantize`) and their scales
    written to the same slots."""
    if has_skipped_slots:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    if scales is None:
        for rows, cache in ((key, key_cache), (value, value_cache)):
            _write_slots(cache, slot_mapping, rows.to(cache.dtype))
        return
    quant = scales.quant
    for rows, cache, scale_cache, static in ((key, key_cache, scales.key, quant.key_scale),
                                             (value, value_cache, scales.value, quant.value_scale)):
        payload, row_scales = quantize(rows, quant, static)
        # one-byte payloads move as uint8 (index_copy_ has no float8 kernel on every device)
        _write_slots(cache.view(torch.uint8), slot_mapping, payload.view(torch.uint8))
        _write_slots(scale_cache, slot_mapping, row_scales)


def is_flat(cache: torch.Tensor) -> bool:
    """Whether `cache` [num_blocks, block_size, ...] can be viewed as [num_slots, ...]: its blocks lie
    end to end (False for a byte page's slice, whose block stride is the whole page)."""
    return cache.stride(0) == cache.shape[1] * cache.stride(1)


def _write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slot // block_size, slot % block_size] = rows, in place, for any block stride."""
    if is_flat(cache):
        # view, not flatten: a cache whose slots cannot be viewed flat must fail, not fill a copy
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)
    else:  # a strided view (a byte page's slice): address each row by (block, offset)
        block_size = cache.shape[1]
        cache.index_put_((slots // block_size, slots % block_size), rows)


def _read_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # [*slots.shape, *cache.shape[2:]]
    """cache[slot // block_size, slot % block_size], for any block stride."""
    if is_flat(cache):
        return cache.flatten(0, 1)[slots]
    return cache[slots // cache.shape[1], slots % cache.shape[1]]


def slots_of(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    positions: torch.Tensor,  # [n] shared by every sequence, or [num_seqs, n]
    block_size: int,
) -> torch.Tensor:  # [num_seqs, n] int64
    """Physical slot (`block_id * block_size + offset`) of each token position, via the block table."""
    if positions.dim() == 1:
        positions = positions.expand(block_tables.shape[0], -1)
    blocks = block_tables.long().gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def gather_dense(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    step,  # the forward's `StepMetadata` (DENSE mode)
    dtype: torch.dtype,
    scales: KVScales | None = None,  # a quantised cache's scales: dequantised in the gather
    group: int = 0,  # the layer's KV group (its block tables)
    first_kept: list[int] | None = None,  # per row, first token position the group still holds
) -> tuple[torch.Tensor, torch.Tensor]:  # [batch, num_kv_heads, num_columns, head_dim], same with head_dim_v
    """K/V in transformers' padded column order for sdpa/eager, zeros at padding columns, each at
    its own head width. The gather index is built once per step (on `step.dense_index`) and shared
    by every layer."""
    device = key_cache.device
    index = step.dense_index.get(group)
    if index is None or index[0].device != device:
        columns = torch.arange(step.num_columns, device=device)
        tok = columns[None, :] - step.num_padding.to(device)[:, None]  # [batch, num_columns]
        valid = tok >= 0
        if first_kept is not None:  # released sliding-window blocks: zeros, like padding
            valid &= tok >= torch.as_tensor(first_kept, device=device)[:, None]
        index = step.dense_index[group] = (slots_of(step.block_tables_of(group).to(device), tok.clamp(min=0),
                                                    key_cache.shape[1]), valid)
    slots, valid = index
    out = []
    for cache, scale_cache in ((key_cache, None if scales is None else scales.key),
                               (value_cache, None if scales is None else scales.value)):
        if scale_cache is None:
            gathered = _read_slots(cache, slots)  # [batch, num_columns, heads, dim]
        else:  # one-byte payloads move as uint8 (advanced indexing of float8 is missing on some torch builds)
            gathered = _read_slots(cache.view(torch.uint8), slots).view(cache.dtype)
        if scale_cache is None:
            gathered = gathered.to(dtype)
        else:
            gathered = dequantize(gathered, _read_slots(scale_cache, slots), dtype,
                                  nan_scaled=dynamic_scales(scales.quant))
            if scales.quant.rotate:
                gathered = rotate(gathered)
        gathered = gathered.masked_fill(~valid[:, :, None, None], 0)
        out.append(gathered.transpose(1, 2).contiguous())
    return out[0], out[1]
