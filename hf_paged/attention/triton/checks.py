"""Input checks shared by the paged-attention launchers: clear ValueErrors before any launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionShapes:
    num_tokens: int
    num_q_heads: int
    head_dim: int  # of the query and the keys
    num_seqs: int
    block_size: int
    num_kv_heads: int
    head_dim_v: int  # of the values and the output


def can_read_kv_dtype(query_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the kernels can attend with a `query_dtype` query over a `kv_dtype` K/V cache.

    K/V tiles are cast to the query's dtype right after they are loaded, so a 16-bit cache under an
    fp32 query is read exactly (fp16/bf16 -> fp32 loses nothing). The other mixes (a wider cache, or
    fp16 against bf16) would round K/V on every read, so they are refused rather than silently lossy.
    """
    return kv_dtype == query_dtype or (query_dtype == torch.float32 and kv_dtype in _HALF_DTYPES)


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
) -> AttentionShapes:
    """Validate the `reference.paged_attention` contract for a Triton launcher named `kernel`.

    Returns the shapes the launcher needs. Raises ValueError naming the offending argument.
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
             f"bfloat16 cache), got {query.dtype} and {key_cache.dtype}; use kv_cache_dtype='auto' or "
             "HF_PAGED_BACKEND=torch")
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
    if softcap is not None and not softcap > 0:
        fail(f"softcap must be > 0 or None, got {softcap}")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != num_q_heads or not sinks.is_floating_point()):
        fail(f"sinks must be a float [num_q_heads={num_q_heads}] tensor, got {sinks.dtype} {tuple(sinks.shape)}")
    devices = {t.device for t in (query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q)}
    if sinks is not None:
        devices.add(sinks.device)
    if len(devices) != 1:
        fail(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return AttentionShapes(num_tokens, num_q_heads, head_dim, num_seqs, block_size, num_kv_heads, head_dim_v)
