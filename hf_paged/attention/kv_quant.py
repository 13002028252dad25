"""Quantised K/V: one-byte payloads plus float32 scales, quantised when written, dequantised when read.

The torch implementation of the contract the Triton kernels follow (`triton/store_kv.py` quantises in
its kernel, the attention kernels dequantise in registers). A quantised layer keeps, beside its
`[num_blocks, block_size, num_kv_heads, head_dim]` payload, one scales tensor per K and V:

    scales: [num_blocks, block_size, groups, channels] float32
        groups   = num_kv_heads (scheme "dynamic", "asymmetric", "unit"), or 1 ("dynamic_token")
        channels = 1 (scale), or 2 (scale, offset) for "asymmetric"

    stored:   q = round_or_cast((x - offset) / scale)        (offset = 0 unless asymmetric)
    read:     x' = q * scale + offset

Scales are per token, so a block is written token by token and no earlier row is ever rescaled; they
sit beside the blocks and move with them (copy-on-write, pool growth). A dynamic scale maps each row's
absolute maximum onto the dtype's largest value (`KVCacheDtype.qmax`), so it can neither saturate nor
collapse; an all-zero row gets scale 1.0 (its payload is zeros). NaN/inf in a row stay non-finite.
A checkpoint's per-layer `k_scale` / `v_scale` (compressed-tensors FP8) replace the dynamic scale:
every row of that layer is stored with it, saturating at the dtype's range.

The step's own tokens are attended from their stored (quantised) values too, exactly like earlier
tokens: a prefix-cache hit, a recomputed prefix and a chunked prefill all read identical K/V.

Rotation (`KVQuant.rotate`, on by default): before quantising, every K and V head row is multiplied by
a fixed orthonormal, symmetric Hadamard matrix R (block-diagonal over the largest power-of-two factor
of the head width), and the attention multiplies its queries by R and its output by R again (R R = I):

    (q R) . (k R) = q . k        softmax(.) (v R) R = softmax(.) v

so attention is unchanged in exact arithmetic, while a few large channels of K (which q shares) are
spread over the whole row, and the rounding error of q . k shrinks. Measured on SmolLM2
(`benchmarks/kv_quant.py`): it cuts int8's mean KL by about 4x and fp8's by about a quarter. Layers
with a checkpoint's static scales (calibrated on unrotated K/V) are not rotated. Applied in
`dispatch` for every backend (the kernels see rotated rows and queries) and in the dense gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import functools

import torch

from ..config import KVCacheDtype, kv_scale_channels, kv_scale_groups


@dataclass(frozen=True)
class KVQuant:
    """How one layer's cache quantises.

    Attributes:
        dtype: the payload's torch dtype (int8, float8_e4m3fn, float8_e5m2).
        qmax: the largest magnitude the payload holds.
        scheme: one of `config.KV_QUANT_SCHEMES`.
        key_scale, value_scale: a checkpoint's static per-layer scales, or None (dynamic).
    """

    dtype: torch.dtype
    qmax: float
    scheme: str = "dynamic"
    key_scale: float | None = None
    value_scale: float | None = None
    rotate: bool = False

    @classmethod
    def of(cls, kv_dtype: KVCacheDtype, scheme: str, key_scale: float | None = None,
           value_scale: float | None = None, rotate: bool = False) -> "KVQuant":
        static = key_scale is not None or value_scale is not None
        return cls(getattr(torch, kv_dtype.storage), kv_dtype.qmax, scheme, key_scale, value_scale,
                   rotate and not static)

    @property
    def is_int(self) -> bool:
        return not self.dtype.is_floating_point

    def scales_shape(self, num_kv_heads: int) -> tuple[int, int]:
        """(groups, channels) of one token's scales."""
        return kv_scale_groups(num_kv_heads, self.scheme), kv_scale_channels(self.scheme)


@dataclass
class KVScales:
    """A quantised layer's scales and how it quantises: what `store_kv` and `paged_attention` take
    beside the payload blocks.

    Attributes:
        key, value: [num_blocks, block_size, groups, channels] float32 (see the module docstring).
        quant: the layer's `KVQuant`.
    """

    key: torch.Tensor
    value: torch.Tensor
    quant: KVQuant


@functools.lru_cache(maxsize=16)
def _rotation(dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:  # [dim, dim]
    """Orthonormal symmetric Hadamard matrix, block-diagonal over the largest power of two dividing
    `dim` (Sylvester's construction: H_2n = [[H, H], [H, -H]] / sqrt(2)); identity for odd `dim`."""
    n = dim & -dim
    with torch.inference_mode(False):  # cached: must stay usable under autograd, even if first built in inference
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = h / h.shape[0] ** 0.5
        return torch.block_diag(*[h] * (dim // n)).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
    """`x @ R` over the last dimension (R R = I, so this also undoes itself)."""
    return x @ _rotation(x.shape[-1], x.device, x.dtype)


def quantize(
    rows: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] any float dtype
    quant: KVQuant,
    static_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # payload [num_tokens, num_kv_heads, head_dim], scales [num_tokens, G, C]
    """Quantise rows with `quant` (a static scale, when given, replaces the dynamic one)."""
    x = rows.float()
    num_tokens, num_kv_heads, _ = x.shape
    if quant.scheme == "asymmetric":  # int8: [lo, hi] onto [-128, 127]
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        span = hi - lo
        scale = torch.where(span == 0, torch.ones_like(span), span / 255.0)
        offset = lo + 128.0 * scale
        q = ((x - offset) / scale).round_().clamp_(-128, 127).to(quant.dtype)
        return q, torch.cat([scale, offset], dim=-1)  # [T, H, 2]
    if static_scale is not None or quant.scheme == "unit":
        scale = x.new_full((num_tokens, 1, 1), 1.0 if static_scale is None else float(static_scale))
    else:
        dims = (-2, -1) if quant.scheme == "dynamic_token" else (-1,)
        amax = x.abs().amax(dim=dims, keepdim=True)  # [T, H or 1, 1]
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / quant.qmax)  # NaN/inf stay non-finite
    y = x / scale
    if quant.is_int:
        y = y.round_()
    q = y.clamp_(-quant.qmax, quant.qmax).to(quant.dtype)  # saturating (a static scale may overflow)
    groups, _ = quant.scales_shape(num_kv_heads)
    return q, scale.expand(num_tokens, groups, 1).contiguous()


def dequantize(
    payload: torch.Tensor,  # [..., num_kv_heads, head_dim] int8 / float8
    scales: torch.Tensor,  # [..., groups, channels] float32
    dtype: torch.dtype,
    out: torch.Tensor | None = None,  # [..., num_kv_heads, head_dim] of `dtype`, written in place
    nan_scaled: bool = False,  # every row holding a NaN has a NaN scale (`dynamic_scales(quant)`)
) -> torch.Tensor:
    """`payload * scale (+ offset)` in `dtype` (the query's), into `out` when given."""
    if out is None:
        out = torch.empty(payload.shape, dtype=dtype, device=payload.device)
    scale = scales[..., :1]
    if payload.dtype == torch.float8_e4m3fn and nan_scaled:
        # torch's e4m3 -> fp32 conversion is scalar on CPU (~15x int8's); the bits of e4m3 `s eeee mmm`
        # shifted into fp16's `s 0eeee mmm0000000` are the same value times 2**-8, subnormals included,
        # in three vectorised integer passes. Only the NaN codes come out finite (+-480), and a NaN row's
        # dynamic scale is NaN, so they still read back NaN.
        bits = payload.view(torch.int8).to(torch.int16)  # sign-extended
        bits.bitwise_left_shift_(7).bitwise_and_(-16385)  # clear bit 14 (0xBFFF): s0eeeemmm0000000
        payload, scale = bits.view(torch.float16), scale * 256.0
    if dtype != torch.float32 and dtype != torch.float64:  # scale in fp32, then round once to dtype
        result = payload.float().mul_(scale)  # int8 / fp8 (and the fp16 bit trick) are exact in fp32
        if scales.shape[-1] == 2:
            result.add_(scales[..., 1:])
        return out.copy_(result)
    out.copy_(payload)
    out.mul_(scale)
    if scales.shape[-1] == 2:
        out.add_(scales[..., 1:])
    return out


def dynamic_scales(quant: KVQuant) -> bool:
    """Whether every row's scale comes from its own values (so a NaN row has a NaN scale)."""
    return quant.scheme in ("dynamic", "dynamic_token") and quant.key_scale is None and quant.value_scale is None
