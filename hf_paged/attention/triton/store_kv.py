"""Triton kernels that write new K/V rows into the paged cache (the contract is `reference.store_kv`,
and `kv_quant.quantize` for a quantised cache).

One program copies one token's K and V rows for a block of its KV heads into slot
`slot_mapping[token]` (`block_id * block_size + offset`); slot -1 means "do not write" (padding
tokens, or tokens whose K/V is already cached). The values are cast to each cache's dtype. K and V
may have different head widths (`head_dim_v`, as in multi-head latent attention).

A quantised cache (one-byte int8 / fp8 payloads, `scales` given) is quantised in the kernel, bit for
bit as `kv_quant.quantize` does in torch: per (token, KV head) row, or per token over all its heads
("dynamic_token", the program then loops over the heads twice), scale = amax|x| / qmax (1.0 for an
all-zero row), or the layer's static scale ("unit": 1.0); payload = x / scale saturated to
[-qmax, qmax], rounded half to even for int8, cast round-to-nearest-even for fp8. The row's scale is
stored at the same (block, offset, group) of the float32 scales tensor. Divisions are IEEE
(`div_rn`), as torch's, so payloads and scales match torch exactly.

Triton 3.9's interpreter (`TRITON_INTERPRET=1`) rounds fp32 -> fp8 casts wrongly (a rounding carry
into the exponent is dropped, halving a few percent of the values), so fp8 stores are refused on CPU
tensors; int8 stores, and fp8 loads (exact there), work under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_kv_scales

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


@triton.jit
def _load_rows(
    rows_ptr,  # [num_kv_heads, width] one token's K or V rows, any float dtype
    stride_head,
    heads,  # [BLOCK_H] int32
    num_kv_heads,
    width,  # head_dim or head_dim_v
    BLOCK_D: tl.constexpr,
):
    """[BLOCK_H, BLOCK_D] fp32 of rows `heads` (zeros outside `num_kv_heads` x `width`)."""
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < width)
    return tl.load(rows_ptr + heads[:, None] * stride_head + dims[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(
    slot_ptr,  # [num_kv_heads, width] one slot of the K or V cache, int8 / float8
    stride_head,
    heads,  # [BLOCK_H] int32
    num_kv_heads,
    width,  # head_dim or head_dim_v
    payload,  # [BLOCK_H, BLOCK_D] fp32, already quantised (in range, rounded for int8)
    BLOCK_D: tl.constexpr,
):
    """Cast `payload` to the cache's dtype into rows `heads` of the slot."""
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < width)
    tl.store(slot_ptr + heads[:, None] * stride_head + dims[None, :], payload.to(slot_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _row_amax(x):  # [BLOCK_H, BLOCK_D] fp32 -> ([BLOCK_H] fp32, [BLOCK_H] int32)
    """max |x| of each row, and whether the row holds a NaN (int32 0/1):
    torch.amax returns NaN there, while tl.max skips NaNs on GPU."""
    return tl.max(tl.abs(x), axis=1), tl.max((x != x).to(tl.int32), axis=1)


@triton.jit
def _dynamic_scale(amax, has_nan, qmax):  # [BLOCK_H] or scalar -> the same shape, fp32
    """amax / qmax, mapping the row's largest magnitude onto the dtype's; 1.0 for an all-zero row, and
    NaN for a row holding a NaN (as torch's amax), so a non-finite row stays non-finite when read."""
    scale = tl.where(amax == 0, 1.0, tl.math.div_rn(amax, qmax))
    return tl.where(has_nan == 0, scale, float("nan"))


@triton.jit
def _round_half_to_even(y):  # fp32, |y| <= 2**22
    # For |y| <= 2**22, adding 1.5 * 2**23 leaves no fraction bits in fp32's 24-bit significand, so the
    # IEEE add itself rounds to an integer, ties to even (torch.round); subtracting it back is exact.
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _quantize(x, scale, qmax, IS_INT: tl.constexpr):  # x [BLOCK_H, BLOCK_D] fp32, scale [BLOCK_H, 1] or scalar
    """x / scale saturated to [-qmax, qmax] (NaN stays NaN), and rounded half to even for int8 (whose
    qmax is an integer, so clamping before rounding equals torch's round-then-clamp)."""
    y = tl.math.div_rn(x, scale)  # IEEE division like torch's: no payload differs by a rounding step
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -qmax), qmax))
    if IS_INT:
        y = _round_half_to_even(y)
    return y


@triton.jit
def _token_scale(
    rows_ptr,  # [num_kv_heads, width] one token's K or V rows
    stride_head,
    num_kv_heads,
    width,  # head_dim or head_dim_v
    qmax,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One dynamic scale for all of a token's heads (scalar fp32): a first pass over its rows."""
    amax = tl.zeros([BLOCK_H], tl.float32)
    has_nan = tl.zeros([BLOCK_H], tl.int32)
    for h in range(0, num_kv_heads, BLOCK_H):
        x = _load_rows(rows_ptr, stride_head, h + tl.arange(0, BLOCK_H), num_kv_heads, width, BLOCK_D)
        row_amax, row_nan = _row_amax(x)
        amax = tl.maximum(amax, row_amax)
        has_nan = tl.maximum(has_nan, row_nan)
    return _dynamic_scale(tl.max(amax, axis=0), tl.max(has_nan, axis=0), qmax)


@triton.jit
def _store_kv_quantized_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim_v]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] int8 / float8
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim_v] int8 / float8
    key_scales_ptr,  # [num_blocks, block_size, G, 1] fp32, G = num_kv_heads or 1 (PER_TOKEN)
    value_scales_ptr,  # [num_blocks, block_size, G, 1] fp32
    slot_mapping_ptr,  # [num_tokens] int64
    stride_key_token, stride_key_head,
    stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_ks_block, stride_ks_slot, stride_ks_group,
    stride_vs_block, stride_vs_slot, stride_vs_group,
    num_kv_heads,
    head_dim,
    head_dim_v,
    key_static_scale,  # float, read only if K_STATIC
    value_static_scale,  # float, read only if V_STATIC
    qmax,  # float: the payload's largest magnitude (127, 448, 57344)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= max(head_dim, head_dim_v), power of two
    PER_TOKEN: tl.constexpr,  # G == 1 < num_kv_heads: one scale per token, all heads in this program
    K_STATIC: tl.constexpr,  # K rows use key_static_scale instead of their amax
    V_STATIC: tl.constexpr,
    IS_INT: tl.constexpr,  # int8 payload (round half to even), else fp8 (the cast rounds)
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    key_rows = key_ptr + token * stride_key_token
    value_rows = value_ptr + token * stride_value_token
    kc_slot = key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    vc_slot = value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    ks_slot = key_scales_ptr + block * stride_ks_block + offset * stride_ks_slot
    vs_slot = value_scales_ptr + block * stride_vs_block + offset * stride_vs_slot

    if PER_TOKEN:
        if K_STATIC:
            k_scale = key_static_scale
        else:
            k_scale = _token_scale(key_rows, stride_key_head, num_kv_heads, head_dim, qmax, BLOCK_H, BLOCK_D)
        if V_STATIC:
            v_scale = value_static_scale
        else:
            v_scale = _token_scale(value_rows, stride_value_head, num_kv_heads, head_dim_v, qmax, BLOCK_H, BLOCK_D)
        for h in range(0, num_kv_heads, BLOCK_H):
            heads = h + tl.arange(0, BLOCK_H)
            key = _load_rows(key_rows, stride_key_head, heads, num_kv_heads, head_dim, BLOCK_D)
            value = _load_rows(value_rows, stride_value_head, heads, num_kv_heads, head_dim_v, BLOCK_D)
            _store_rows(kc_slot, stride_kc_head, heads, num_kv_heads, head_dim, _quantize(key, k_scale, qmax, IS_INT),
                        BLOCK_D)
            _store_rows(vc_slot, stride_vc_head, heads, num_kv_heads, head_dim_v,
                        _quantize(value, v_scale, qmax, IS_INT), BLOCK_D)
        tl.store(ks_slot, k_scale)
        tl.store(vs_slot, v_scale)
    else:
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_valid = heads < num_kv_heads
        key = _load_rows(key_rows, stride_key_head, heads, num_kv_heads, head_dim, BLOCK_D)  # [BLOCK_H, BLOCK_D]
        value = _load_rows(value_rows, stride_value_head, heads, num_kv_heads, head_dim_v, BLOCK_D)
        if K_STATIC:
            k_scale = key_static_scale + tl.zeros([BLOCK_H], tl.float32)
        else:
            k_amax, k_nan = _row_amax(key)
            k_scale = _dynamic_scale(k_amax, k_nan, qmax)  # [BLOCK_H]
        if V_STATIC:
            v_scale = value_static_scale + tl.zeros([BLOCK_H], tl.float32)
        else:
            v_amax, v_nan = _row_amax(value)
            v_scale = _dynamic_scale(v_amax, v_nan, qmax)
        _store_rows(kc_slot, stride_kc_head, heads, num_kv_heads, head_dim,
                    _quantize(key, k_scale[:, None], qmax, IS_INT), BLOCK_D)
        _store_rows(vc_slot, stride_vc_head, heads, num_kv_heads, head_dim_v,
                    _quantize(value, v_scale[:, None], qmax, IS_INT), BLOCK_D)
        tl.store(ks_slot + heads * stride_ks_group, k_scale, mask=head_valid)
        tl.store(vs_slot + heads * stride_vs_group, v_scale, mask=head_valid)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim_v]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = do not write
    scales=None,  # kv_quant.KVScales of a quantised cache, or None
) -> None:
    """Write each token's K/V row into its slot of the paged cache, casting to each cache's dtype, or
    quantising into a one-byte cache.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]` and `[..., head_dim_v]`, any float dtype,
            last dim contiguous.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` and
            `[..., head_dim_v]`, any float dtype each, last dim contiguous, or one-byte payloads (int8,
            float8_e4m3fn, float8_e5m2) of a quantised cache together with `scales`. Written in place.
        slot_mapping: `[num_tokens]` int64; slot `s` is row `s % block_size` of block `s // block_size`,
            and -1 skips the token. Slots are not range-checked (that would need a host sync): an
            out-of-range slot is an out-of-bounds write.
        scales: a quantised cache's `kv_quant.KVScales`: `.key` / `.value` `[num_blocks, block_size, G, 1]`
            float32 (G = num_kv_heads, or 1 for "dynamic_token"), written at the same slots; `.quant`
            says how (`kv_quant.quantize` is the torch reference). The "asymmetric" scheme is refused.
            fp8 payloads need a GPU (see the module docstring).
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
    num_scale_groups = check_kv_scales("store_kv", scales, key_cache, value_cache)
    if scales is not None and scales.quant.dtype.is_floating_point and key_cache.device.type == "cpu":
        raise ValueError(
            f"store_kv: a {scales.quant.dtype} cache cannot be written on CPU tensors: Triton's interpreter "
            "(TRITON_INTERPRET=1) rounds fp32 -> fp8 casts wrongly (a rounding carry into the exponent is "
            "dropped); use a GPU, an int8 cache, or HF_PAGED_BACKEND=torch"
        )
    if num_tokens == 0:
        return

    block_d = triton.next_power_of_2(max(head_dim, head_dim_v))
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_ELEMENTS_PER_PROGRAM // block_d))
    if scales is not None:
        _store_kv_quantized(key, value, key_cache, value_cache, slot_mapping, scales, num_scale_groups,
                            block_h, block_d)
        return
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


def _store_kv_quantized(key, value, key_cache, value_cache, slot_mapping, scales, num_scale_groups, block_h, block_d):
    """Launch the quantising store (inputs already validated by `store_kv`)."""
    quant = scales.quant
    num_tokens, num_kv_heads, head_dim = key.shape
    # As `kv_quant.quantize`: a checkpoint's static scale, else 1.0 for "unit", else the row's amax.
    key_static = quant.key_scale if quant.key_scale is not None else (1.0 if quant.scheme == "unit" else None)
    value_static = quant.value_scale if quant.value_scale is not None else (1.0 if quant.scheme == "unit" else None)
    per_token = num_scale_groups != num_kv_heads
    grid = (num_tokens, 1 if per_token else triton.cdiv(num_kv_heads, block_h))
    ks, vs = scales.key, scales.value
    _store_kv_quantized_kernel[grid](
        key, value, key_cache, value_cache, ks, vs, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        num_kv_heads,
        head_dim,
        value.shape[2],
        float(key_static) if key_static is not None else 1.0,
        float(value_static) if value_static is not None else 1.0,
        float(quant.qmax),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        PER_TOKEN=per_token,
        K_STATIC=key_static is not None,
        V_STATIC=value_static is not None,
        IS_INT=quant.is_int,
    )
