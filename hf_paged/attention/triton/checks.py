"""Input checks shared by the paged-attention launchers (clear ValueErrors before any launch), and
the quantised cache's scale arguments they pass their kernels."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
# One-byte payloads of a quantised cache (`kv_quant`), always read together with their float32 scales.
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class AttentionShapes:
    num_tokens: int
    num_q_heads: int
    head_dim: int  # of the query and the keys
    num_seqs: int
    block_size: int
    num_kv_heads: int
    head_dim_v: int  # of the values and the output
    num_scale_groups: int = 0  # a quantised cache's scale groups per token (num_kv_heads or 1); 0 unquantised


def can_read_kv_dtype(query_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the kernels can attend with a `query_dtype` query over a `kv_dtype` K/V cache.

    K/V tiles are cast to the query's dtype right after they are loaded, so a 16-bit cache under an
    fp32 query is read exactly (fp16/bf16 -> fp32 loses nothing). The other mixes (a wider cache, or
    fp16 against bf16) would round K/V on every read, so they are refused rather than silently lossy.
    A one-byte quantised payload (int8, fp8 e4m3/e5m2) is read under any float query: its tiles are
    dequantised in fp32 with their scales and rounded once to the query's dtype, as `kv_quant.dequantize`
    does (the launchers then insist on the scales, see `check_kv_scales`).
    """
    return (kv_dtype == query_dtype or (query_dtype == torch.float32 and kv_dtype in _HALF_DTYPES)
            or kv_dtype in QUANTIZED_DTYPES)


@functools.lru_cache(maxsize=None)
def has_fp8e4nv(device: torch.device) -> bool:
    """Whether Triton can convert float8_e4m3fn on `device`: NVIDIA sm_89+ (older GPUs only have e5m2).
    CPU tensors (the interpreter) and ROCm are left to Triton."""
    if device.type != "cuda" or torch.version.hip is not None:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def check_kv_scales(
    kernel: str,
    scales,  # kv_quant.KVScales or None
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
) -> int:
    """Validate a quantised cache's scales against its payload for the launcher named `kernel`.

    Returns the number of scale groups per token (`num_kv_heads`, or 1 for "dynamic_token"), or 0
    when `scales` is None (an unquantised cache). Raises ValueError when a one-byte cache comes
    without scales (or scales with a wider cache), for the "asymmetric" scheme (the kernels read
    symmetric scales only), and for scales of the wrong dtype, shape or device (any strides are
    fine: the kernels index them by stride).
    """

    def fail(message: str):
        raise ValueError(f"{kernel}: {message}")

    is_quantized = key_cache.dtype in QUANTIZED_DTYPES
    if scales is None:
        if is_quantized:
            fail(f"a {key_cache.dtype} cache is a quantised payload: pass its scales (kv_quant.KVScales) so it "
                 "can be quantised / dequantised")
        return 0
    quant = scales.quant
    if not is_quantized:
        fail(f"scales were given for a {key_cache.dtype} cache; only int8 / float8_e4m3fn / float8_e5m2 "
             "caches are quantised")
    if quant.scheme == "asymmetric":
        fail("kv_quant_scheme='asymmetric' (a scale and an offset per row) is implemented on the torch path "
             "only; the Triton kernels read symmetric scales ('dynamic', 'dynamic_token', 'unit'); or set "
             "HF_PAGED_BACKEND=torch")
    if quant.dtype != key_cache.dtype or value_cache.dtype != key_cache.dtype:
        fail(f"scales.quant.dtype is {quant.dtype} but the caches hold {key_cache.dtype} / {value_cache.dtype}")
    if key_cache.dtype == torch.float8_e4m3fn and not has_fp8e4nv(key_cache.device):
        fail("a float8_e4m3fn cache needs an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper) in Triton; use "
             "kv_cache_dtype='fp8_e5m2' or 'int8' here, or HF_PAGED_BACKEND=torch")
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    groups = None
    for name, t in (("scales.key", scales.key), ("scales.value", scales.value)):
        if t.dtype != torch.float32:
            fail(f"{name} must be float32, got {t.dtype}")
        if (t.dim() != 4 or tuple(t.shape[:2]) != (num_blocks, block_size) or t.shape[2] not in (1, num_kv_heads)
                or t.shape[3] != 1):
            fail(f"{name} must be [num_blocks={num_blocks}, block_size={block_size}, groups, 1] with groups "
                 f"num_kv_heads={num_kv_heads} or 1, got {tuple(t.shape)}")
        if groups is not None and t.shape[2] != groups:
            fail(f"scales.key and scales.value must have the same groups, got {groups} and {t.shape[2]}")
        groups = t.shape[2]
        if t.device != key_cache.device:
            fail(f"{name} is on {t.device} but the caches are on {key_cache.device}")
    expected, _ = quant.scales_shape(num_kv_heads)
    if groups != expected:
        fail(f"scheme {quant.scheme!r} keeps {expected} scale group(s) per token, but the scales hold {groups}")
    return groups


def kv_scale_args(
    scales,  # kv_quant.KVScales (already validated by `check_kv_scales`) or None
    num_kv_heads: int,
    dummy: torch.Tensor,  # any tensor on the kernel's device, passed where there are no scales
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(key scales, value scales, their six block / slot / group strides) for an attention kernel.

    A G == 1 scales tensor ("dynamic_token") gets group stride 0, so every KV head reads its token's
    one scale. Without scales: the dummy twice and zero strides (the kernel never reads them)."""
    if scales is None:
        return dummy, dummy, (0,) * 6
    ks, vs = scales.key, scales.value
    per_head = ks.shape[2] == num_kv_heads
    return ks, vs, (ks.stride(0), ks.stride(1), ks.stride(2) if per_head else 0,
                    vs.stride(0), vs.stride(1), vs.stride(2) if per_head else 0)


def check_attention_inputs(
    kernel: str,
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    max_seqlen_k: int,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [num_q_heads]
    max_head_dim: int = 256,
    scales=None,  # kv_quant.KVScales of a quantised cache, or None
    chunk_size: int | None = None,
) -> AttentionShapes:
    """Validate the `reference.paged_attention` contract for a Triton launcher named `kernel`.

    Returns the shapes the launcher needs (`num_scale_groups`: 0 unquantised, else the scale groups
    per token). Raises ValueError naming the offending argument.
    """

    def fail(message: str):
        raise ValueError(f"{kernel}: {message}")

    if query.dim() != 3:
        fail(f"query must be [num_tokens, num_q_heads, head_dim], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or value_cache.dim() != 4 or value_cache.shape[:3] != key_cache.shape[:3]:
        fail("key_cache and value_cache must be [num_blocks, block_size, num_kv_heads, head_dim] and "
             f"[num_blocks, block_size, num_kv_heads, head_dim_v], got {tuple(key_cache.shape)} and "
             f"{tuple(value_cache.shape)}")
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    head_dim_v = value_cache.shape[3]
    if cache_head_dim != head_dim:
        fail(f"query head_dim {head_dim} != key_cache head_dim {cache_head_dim}")
    if max(head_dim, head_dim_v) > max_head_dim:
        fail(f"head_dim {head_dim} / head_dim_v {head_dim_v} > {max_head_dim} is not supported")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        fail(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.dtype not in _FLOAT_DTYPES:
        fail(f"query must be float16, bfloat16 or float32, got {query.dtype}")
    if key_cache.dtype != value_cache.dtype:
        fail(f"key_cache and value_cache must share a dtype, got {key_cache.dtype} and {value_cache.dtype}")
    if not can_read_kv_dtype(query.dtype, key_cache.dtype):
        fail(f"query, key_cache and value_cache must share a dtype (or be a float32 query over a float16/"
             f"bfloat16 cache, or a quantised int8/fp8 cache with scales), got {query.dtype} and "
             f"{key_cache.dtype}; use kv_cache_dtype='auto' or HF_PAGED_BACKEND=torch")
    num_scale_groups = check_kv_scales(kernel, scales, key_cache, value_cache)
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            fail(f"{name} must be contiguous in its last (head_dim) dimension, strides {t.stride()}")
    for name, t, ndim in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1),
                          ("cu_seqlens_q", cu_seqlens_q, 1)):
        if t.dtype != torch.int32:
            fail(f"{name} must be int32, got {t.dtype}")
        if t.dim() != ndim or (t.stride(-1) != 1 and t.shape[-1] > 1):
            fail(f"{name} must be a {ndim}-D tensor contiguous in its last dimension, got shape "
                 f"{tuple(t.shape)} strides {t.stride()}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs or cu_seqlens_q.shape[0] != num_seqs + 1:
        fail(f"inconsistent batch: block_tables has {num_seqs} rows, seq_lens {seq_lens.shape[0]}, "
             f"cu_seqlens_q {cu_seqlens_q.shape[0]} (must be num_seqs + 1)")
    if block_tables.shape[1] * block_size < max_seqlen_k:
        fail(f"block_tables has {block_tables.shape[1]} columns of {block_size} tokens, fewer than "
             f"max_seqlen_k={max_seqlen_k} (the block-table capacity)")
    if sliding_window is not None and sliding_window < 1:
        fail(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if chunk_size is not None and chunk_size < 1:
        fail(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if softcap is not None and not softcap > 0:
        fail(f"softcap must be > 0 or None, got {softcap}")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != num_q_heads or not sinks.is_floating_point()):
        fail(f"sinks must be a float [num_q_heads={num_q_heads}] tensor, got {sinks.dtype} {tuple(sinks.shape)}")
    devices = {t.device for t in (query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q)}
    if sinks is not None:
        devices.add(sinks.device)
    if len(devices) != 1:
        fail(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return AttentionShapes(num_tokens, num_q_heads, head_dim, num_seqs, block_size, num_kv_heads, head_dim_v,
                           num_scale_groups)
