"""Absorbed multi-head latent attention (MLA: DeepSeek V2/V3, Kimi K2, MiniCPM3) over paged latent rows.

An MLA layer caches one row per token, shared by all its query heads (one "KV head"):

    rows[block, slot, 0, :]  =  latent c_kv [L]  |  rotary key k_rot [R]  |  (indexer key, other columns)
    key_cache   = rows[..., :L + R]      K of every query head
    V           = rows[..., :L]          the same storage: never copied, never expanded

With the key up-projection absorbed into the query (`q_abs = [q_nope @ W_UK | q_rot]`, width L + R per
head), attention is `softmax(q_abs . K^T * scale) @ V`, of width L; the caller applies W_UV after.
As in FlashMLA and vLLM's Triton MLA decode, the head dimension is split into the latent part
(BLOCK_L, the next power of two of L, masked) and the rotary part (BLOCK_R), and the latent tile is
loaded once per key tile and used twice: as K (scores) and as V (output).

    pass 1  grid (num_seqs * num_q_tiles, num_head_tiles, num_splits)
            One program: the query tokens of one sequence's query tile times the query heads of one
            head tile, flattened into the M rows of `tl.dot` (row m = query token m // HEADS, head
            head_tile * HEADS + m % HEADS): all heads read the one KV head, so each row byte is read
            once per program for up to BLOCK_M query rows. Keys come BLOCK_N at a time, gathered
            through the block table (any block_size, 1 included), under the causal mask; an fp32
            online softmax in the log2 domain keeps the running max, sum and [BLOCK_M, BLOCK_L] output.
            num_splits == 1: the program normalises and writes `out`.
            num_splits > 1: it writes its normalised partial output and log2-sum-exp instead.
    pass 2  grid (num_tokens, num_q_heads), only when num_splits > 1
            Merges the splits' partials by their log-sum-exps.

One kernel serves decode, speculative verify and prefill runs in the same call (query i of a
sequence with q_len queries sits at position seq_len - q_len + i and sees keys 0..that position).
Decode has few rows per sequence, so the key axis is split (flash-decoding) to fill the GPU; runs
longer than `MAX_DECODE_QUERY_LEN` are never split (their tiles already fill it, and the partials
would grow with their tokens). Sizes: BLOCK_M * BLOCK_L is capped at 16 x 512 (the fp32 accumulator
and the query tile stay at 32 KiB and 18 KiB of registers per program at L=512, R=64), so H=128 runs
in 8 head tiles, like vLLM's BLOCK_H=16.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...config import MAX_DECODE_QUERY_LEN
from .checks import QUANTIZED_DTYPES, can_read_kv_dtype, check_attention_inputs

# The widest latent and rotary parts the kernel tiles; wider heads go to the torch path (None).
MAX_LATENT_DIM = 1024
MAX_ROPE_DIM = 256
# Query rows per program x padded latent width: the fp32 accumulator stays [16, 512] or smaller.
_MAX_ROW_ELEMENTS = 16 * 512
_MAX_ROWS = 128
_MAX_SPLITS = 64
_MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed costs outweigh the parallelism it adds
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _latent_attention_kernel(
    query_ptr,  # [num_tokens, num_q_heads, latent_dim + rope_dim]: q_abs = [q_nope @ W_UK | q_rot]
    rows_ptr,  # [num_blocks, block_size, 1, >= latent_dim + rope_dim]: latent | rotary key | ...
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_q_heads, latent_dim], written only if NUM_SPLITS == 1
    partial_out_ptr,  # [num_splits, num_tokens, num_q_heads, latent_dim] fp32, if NUM_SPLITS > 1
    partial_lse_ptr,  # [num_splits, num_tokens, num_q_heads] fp32 (log2), if NUM_SPLITS > 1
    stride_q_token, stride_q_head,
    stride_rows_block, stride_rows_slot,
    stride_bt_seq,
    stride_out_token, stride_out_head,
    num_tokens,
    num_q_heads,
    latent_dim,
    rope_dim,
    num_q_tiles,
    qk_scale,  # the softmax scale times log2(e)
    HEADS: tl.constexpr,  # query heads per program
    Q_PER_TILE: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # >= Q_PER_TILE * HEADS, power of two, >= 16
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,  # latent_dim padded to a power of two >= 16
    BLOCK_R: tl.constexpr,  # rope_dim padded to a power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    NUM_SPLITS: tl.constexpr,
    HAS_ROPE: tl.constexpr,  # rope_dim > 0
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no silent TF32), None (the default) otherwise
):
    seq = tl.program_id(0) // num_q_tiles
    q_start = (tl.program_id(0) % num_q_tiles) * Q_PER_TILE
    head_tile = tl.program_id(1)
    split = tl.program_id(2)

    cu_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - cu_start
    if q_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    row_token = rows // HEADS
    head = head_tile * HEADS + rows % HEADS
    row_valid = (row_token < Q_PER_TILE) & (q_start + row_token < q_len) & (head < num_q_heads)
    token = (cu_start + q_start + row_token).to(tl.int64)
    q_pos = seq_len - q_len + q_start + row_token  # [BLOCK_M]
    dims_l = tl.arange(0, BLOCK_L)
    dim_l_valid = dims_l < latent_dim
    dims_r = tl.arange(0, BLOCK_R)
    dim_r_valid = dims_r < rope_dim

    q_row = query_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head
    q_lat = tl.load(q_row + dims_l[None, :], mask=row_valid[:, None] & dim_l_valid[None, :], other=0.0)
    if HAS_ROPE:
        q_rot = tl.load(q_row + latent_dim + dims_r[None, :], mask=row_valid[:, None] & dim_r_valid[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_R]

    # Causal: the tile's last query sees keys [0, hi); the splits cut that range into whole key tiles.
    hi = seq_len - q_len + tl.minimum(q_len, q_start + Q_PER_TILE)
    tiles_per_split = tl.cdiv(tl.cdiv(hi, BLOCK_N), NUM_SPLITS)
    split_lo = split * tiles_per_split * BLOCK_N
    split_hi = tl.minimum(hi, split_lo + tiles_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    for start in range(split_lo, split_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_valid = k_pos < split_hi
        # Table entries past the sequence may be garbage: they are masked, never dereferenced.
        block = tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        k_row = rows_ptr + block[:, None] * stride_rows_block + (k_pos % BLOCK_SIZE)[:, None] * stride_rows_slot
        # The latent tile is both K's first L columns and V: one load, two dots. Cast to the query's
        # dtype on load (a 16-bit cache under an fp32 query is upcast exactly).
        kv = tl.load(k_row + dims_l[None, :], mask=k_valid[:, None] & dim_l_valid[None, :],
                     other=0.0).to(q_lat.dtype)  # [BLOCK_N, BLOCK_L]
        s = tl.dot(q_lat, tl.trans(kv), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if HAS_ROPE:
            k_rot = tl.load(k_row + latent_dim + dims_r[None, :], mask=k_valid[:, None] & dim_r_valid[None, :],
                            other=0.0).to(q_lat.dtype)  # [BLOCK_N, BLOCK_R]
            s += tl.dot(q_rot, tl.trans(k_rot), input_precision=DOT_PRECISION)
        s = s * qk_scale
        allowed = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no visible key so far keeps m = -inf; subtracting 0 instead avoids inf - inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_valid[:, None] & dim_l_valid[None, :]
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims_l[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials are contiguous fp32 buffers. An empty split stores lse = -inf and o = 0.
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        row = (split * num_tokens + token) * num_q_heads + head  # [BLOCK_M] int64
        tl.store(partial_out_ptr + row[:, None] * latent_dim + dims_l[None, :], o, mask=out_mask)
        tl.store(partial_lse_ptr + row, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,  # [num_splits, num_tokens, num_q_heads, latent_dim] fp32
    partial_lse_ptr,  # [num_splits, num_tokens, num_q_heads] fp32 (log2)
    out_ptr,  # [num_tokens, num_q_heads, latent_dim]
    stride_out_token, stride_out_head,
    num_tokens,
    num_q_heads,
    latent_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= NUM_SPLITS
    BLOCK_L: tl.constexpr,  # latent_dim padded to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    lse = tl.load(partial_lse_ptr + (splits * num_tokens + token) * num_q_heads + head, mask=splits < NUM_SPLITS,
                  other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2(lse - m), axis=0)
    dims = tl.arange(0, BLOCK_L)
    dim_valid = dims < latent_dim
    # One split's row at a time: a [BLOCK_S, BLOCK_L] tile would not fit registers at L=512.
    o = tl.zeros([BLOCK_L], tl.float32)
    for split in range(NUM_SPLITS):
        row = (split * num_tokens + token) * num_q_heads + head
        weight = tl.exp2(tl.load(partial_lse_ptr + row) - m)  # 0 for an empty split
        o += weight * tl.load(partial_out_ptr + row * latent_dim + dims, mask=dim_valid, other=0.0)
    o = o / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims, o.to(out_ptr.dtype.element_ty),
             mask=dim_valid)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter / CPU: only the split logic matters, not occupancy


def _pad(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _tiling(num_q_heads: int, max_seqlen_q: int, block_l: int) -> tuple[int, int, int]:
    """(heads per program, query tokens per program, BLOCK_M). Heads first: a decode row fills the
    tile with its heads; the heads are cut into equal tiles when they exceed the row cap, and the
    remaining rows take as many query tokens as fit."""
    max_rows = min(_MAX_ROWS, max(16, _MAX_ROW_ELEMENTS // block_l))
    heads = triton.cdiv(num_q_heads, triton.cdiv(num_q_heads, max_rows))
    q_per_tile = max(1, min(max_seqlen_q, max_rows // heads))
    return heads, q_per_tile, _pad(q_per_tile * heads)


def default_num_splits(programs: int, max_seqlen_q: int, max_seqlen_k: int, device: torch.device) -> int:
    """Splits of the key axis: about two programs per SM for decode and verify runs, never a split of
    fewer than _MIN_KEYS_PER_SPLIT keys, and none for prefill runs (see the module docstring)."""
    if max_seqlen_q > MAX_DECODE_QUERY_LEN:
        return 1
    wanted = triton.cdiv(2 * _num_sms(device), max(programs, 1))
    useful = triton.cdiv(max(max_seqlen_k, 1), _MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, useful, _MAX_SPLITS))


def latent_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, latent_dim + rope_dim], packed by cu_seqlens_q
    key_cache: torch.Tensor,  # [num_blocks, block_size, 1, latent_dim + rope_dim], a view of wider rows
    latent_dim: int,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this step's
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor | None:  # [num_tokens, num_q_heads, latent_dim]
    """Causal absorbed latent attention of each sequence's queries over its paged latent rows.

    `out[t, h] = softmax(query[t, h] . K^T * scale) @ V` over the keys its position sees, with
    K = `key_cache[b, s, 0]` gathered through the block table and V = its first `latent_dim` columns
    (read in place from the same rows). Decode, verify and prefill runs may be mixed in one call;
    sequences with q_len 0 are allowed; this step's rows must already be in the cache.

    Args:
        query: `[num_tokens, num_q_heads, L + R]` fp16/bf16/fp32, last dim contiguous.
        key_cache: `[num_blocks, block_size, 1, L + R]`, any block and slot strides (a view of
            `[..., W]` rows with W >= L + R), in the query's dtype or fp16/bf16 under an fp32 query.
        latent_dim: L, 1 <= L <= L + R: V is `key_cache[..., :L]`.
        block_tables: `[num_seqs, max_blocks_per_seq]` int32; entries past a sequence's length are
            never read, so they may hold anything.
        seq_lens: `[num_seqs]` int32. cu_seqlens_q: `[num_seqs + 1]` int32.
        max_seqlen_q, max_seqlen_k: host-side upper bounds of the query and key lengths.
        scale: softmax scale.
        num_splits: splits of the key axis; None picks `default_num_splits`.

    Returns:
        `[num_tokens, num_q_heads, L]` in the query's dtype, or None for a call the kernel does not
        take (another dtype mix, a quantised cache, a strided last dimension, L > MAX_LATENT_DIM or
        R > MAX_ROPE_DIM), which the torch path then runs.

    Raises:
        ValueError: malformed inputs (shapes, index dtypes, devices, num_splits), naming the problem.
    """
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape[2] != 1:
        raise ValueError(f"latent_attention: query must be [num_tokens, num_q_heads, L + R] and key_cache "
                         f"[num_blocks, block_size, 1, L + R], got {tuple(query.shape)} and {tuple(key_cache.shape)}")
    head_dim = key_cache.shape[3]
    if not 0 < latent_dim <= head_dim:
        raise ValueError(f"latent_attention: latent_dim must be in [1, {head_dim}] (key_cache's width), "
                         f"got {latent_dim}")
    if num_splits is not None and (int(num_splits) != num_splits or num_splits < 1):
        raise ValueError(f"latent_attention: num_splits must be a positive int or None, got {num_splits}")
    rope_dim = head_dim - latent_dim
    if (query.dtype not in _FLOAT_DTYPES or key_cache.dtype in QUANTIZED_DTYPES
            or not can_read_kv_dtype(query.dtype, key_cache.dtype)
            or query.stride(-1) != 1 or key_cache.stride(-1) != 1
            or latent_dim > MAX_LATENT_DIM or rope_dim > MAX_ROPE_DIM):
        return None
    shapes = check_attention_inputs("latent_attention", query, key_cache, key_cache[..., :latent_dim], block_tables,
                                    seq_lens, cu_seqlens_q, max_seqlen_k, None, None, None,
                                    max_head_dim=MAX_LATENT_DIM + MAX_ROPE_DIM)
    num_tokens, num_q_heads, num_seqs, block_size = (shapes.num_tokens, shapes.num_q_heads, shapes.num_seqs,
                                                      shapes.block_size)
    out = query.new_empty(num_tokens, num_q_heads, latent_dim)
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_k == 0:
        return out.zero_()

    block_l, block_r = _pad(latent_dim), _pad(rope_dim)
    max_seqlen_q = max(int(max_seqlen_q), 1)
    heads, q_per_tile, block_m = _tiling(num_q_heads, max_seqlen_q, block_l)
    num_q_tiles = triton.cdiv(max_seqlen_q, q_per_tile)
    num_head_tiles = triton.cdiv(num_q_heads, heads)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs * num_q_tiles * num_head_tiles, max_seqlen_q, max_seqlen_k,
                                        query.device)
    num_splits = int(num_splits)
    if num_splits > 1:
        partial_out = torch.empty(num_splits, num_tokens, num_q_heads, latent_dim, device=query.device,
                                  dtype=torch.float32)
        partial_lse = torch.empty(num_splits, num_tokens, num_q_heads, device=query.device, dtype=torch.float32)
    else:
        partial_out = partial_lse = out  # never touched with one split

    # Hand-picked, as vLLM's MLA decode (BLOCK_H 16, BLOCK_N 32, 4 warps, 2 stages at L=512): a key
    # tile of 32 rows of 576 halves is 36 KiB of shared memory per stage.
    block_n = 32 if block_l + block_r > 256 else 64
    kv_bytes = key_cache.element_size()
    num_stages = 2 if block_n * (block_l + block_r) * kv_bytes > 32 * 1024 else 3
    _latent_attention_kernel[(num_seqs * num_q_tiles, num_head_tiles, num_splits)](
        query, key_cache, block_tables, seq_lens, cu_seqlens_q, out, partial_out, partial_lse,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_tokens,
        num_q_heads,
        latent_dim,
        rope_dim,
        num_q_tiles,
        float(scale) * 1.4426950408889634,
        HEADS=heads,
        Q_PER_TILE=q_per_tile,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        HAS_ROPE=rope_dim > 0,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        num_warps=4,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            partial_out, partial_lse, out,
            out.stride(0), out.stride(1),
            num_tokens,
            num_q_heads,
            latent_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_L=block_l,
        )
    return out
