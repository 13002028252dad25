"""Triton kernel that writes new K/V rows into the paged cache (the contract is `reference.store_kv`).

One program copies one token's K and V rows for a block of its KV heads into slot
`slot_mapping[token]` (`block_id * block_size + offset`); slot -1 means "do not write" (padding
tokens, or tokens whose K/V is already cached). The values are cast to each cache's dtype. K and V
may have different head widths (`head_dim_v`, as in multi-head latent attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements one program copies per tensor: keeps registers bounded for wide models.
_MAX_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim_v]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_key_token, stride_key_head,
    stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    num_kv_heads,
    head_dim,
    head_dim_v,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= max(head_dim, head_dim_v), power of two
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_valid = heads[:, None] < num_kv_heads
    k_mask = head_valid & (dims[None, :] < head_dim)
    v_mask = head_valid & (dims[None, :] < head_dim_v)

    key = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=k_mask)
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :], mask=v_mask
    )
    kc_ptrs = key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + heads[:, None] * stride_kc_head
    vc_ptrs = value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + heads[:, None] * stride_vc_head
    tl.store(kc_ptrs + dims[None, :], key.to(key_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(vc_ptrs + dims[None, :], value.to(value_cache_ptr.dtype.element_ty), mask=v_mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim_v]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = do not write
) -> None:
    """Write each token's K/V row into its slot of the paged cache, casting to each cache's dtype.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]` and `[..., head_dim_v]`, any float dtype,
            last dim contiguous.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` and
            `[..., head_dim_v]`, any float dtype each, last dim contiguous. Written in place.
        slot_mapping: `[num_tokens]` int64; slot `s` is row `s % block_size` of block `s // block_size`,
            and -1 skips the token. Slots are not range-checked (that would need a host sync): an
            out-of-range slot is an out-of-bounds write.
    """
    if key.dim() != 3 or value.dim() != 3 or value.shape[:2] != key.shape[:2]:
        raise ValueError(
            f"store_kv: key and value must be [num_tokens, num_kv_heads, head_dim] and [num_tokens, num_kv_heads, "
            f"head_dim_v], got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or value_cache.dim() != 4 or value_cache.shape[:3] != key_cache.shape[:3]:
        raise ValueError(
            "store_kv: key_cache and value_cache must be [num_blocks, block_size, num_kv_heads, head_dim] and "
            f"[num_blocks, block_size, num_kv_heads, head_dim_v], got {tuple(key_cache.shape)} and "
            f"{tuple(value_cache.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    head_dim_v = value.shape[2]
    for name, rows, cache in (("key", key, key_cache), ("value", value, value_cache)):
        if tuple(cache.shape[2:]) != tuple(rows.shape[1:]):
            raise ValueError(
                f"store_kv: {name} rows are [{rows.shape[1]}, {rows.shape[2]}] but the {name} cache holds "
                f"[{cache.shape[2]}, {cache.shape[3]}] per slot"
            )
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"store_kv: slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"store_kv: {name} must be contiguous in its last (head_dim) dimension")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"store_kv: all tensors must be on one device, got {sorted(map(str, devices))}")
    if num_tokens == 0:
        return

    block_d = triton.next_power_of_2(max(head_dim, head_dim_v))
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_ELEMENTS_PER_PROGRAM // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_kv_heads,
        head_dim,
        head_dim_v,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
