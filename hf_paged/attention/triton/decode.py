"""Split-KV ("flash-decoding") paged attention for steps with few queries per sequence.

The contract is `reference.paged_attention`; this kernel is built for decode (one query per
sequence) and speculative verify steps (k+1 queries), where a sequence has too few queries to keep
a GPU busy and the work must be spread over the key axis instead.

    pass 1  grid (num_seqs * num_q_tiles, num_kv_heads, num_splits)
            One program: the queries of one sequence's query tile, for all query heads of one KV
            head's GQA group, against one split of that sequence's keys. The group's heads and the
            tile's query tokens are flattened into the M rows of `tl.dot` (row m = query token
            m // GROUP, head m % GROUP), so each K/V byte is read once per KV head and split, and
            GQA never repeats K/V. Keys come BLOCK_N at a time, gathered through the block table;
            an fp32 online softmax keeps the running max, sum and output.
            num_splits == 1: the program normalises (adding the sink logit) and writes `out`.
            num_splits > 1: it writes its normalised partial output and log-sum-exp instead.
    pass 2  grid (num_tokens, num_q_heads), only when num_splits > 1
            Merges the splits' partials by their log-sum-exps, with the sink as one more logit.

Scores live in the log2 domain (`s * log2(e)`) so the softmax uses `exp2`; the log-sum-exps in the
partial buffers are log2 too. K/V tiles are cast to the query's dtype as they are loaded (a 16-bit
cache under an fp32 query), and V may be narrower or wider than Q/K (`head_dim_v`, BLOCK_DV): the
accumulator, the partials and the output have V's width.

A quantised cache (IS_QUANTIZED: one-byte int8 / fp8 payloads with float32 scales per token and KV
head, or per token) is dequantised in registers: each K/V tile is loaded with its BLOCK_N scales
through the same block-table lookup and becomes `payload.to(fp32) * scale`, rounded once to the
query's dtype (what `kv_quant.dequantize` computes), before the dots. No dequantised copy of the
cache is ever written.

Launch configuration: BLOCK_N and num_warps never change the result, so they are tunable; the
plan takes a winner recorded for the GPU and shape, or searches when HF_PAGED_AUTOTUNE=1, or the
heuristic (see `tuning` and `decode_configs`). GROUP, Q_PER_TILE, BLOCK_M and BLOCK_D/DV are what
the shapes dictate and are never tuned.

Plan and run: `plan_decode` fixes the query tiling, the split count, the config and the split-K
scratch once per step and layer kind (the partials are views of the cache's workspace, so a CUDA
graph's bucket always writes the same memory); `paged_decode(..., plan=)` only launches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import check_attention_inputs, kv_scale_args
from .tuning import (
    DEFAULT_SHARED_MEMORY,
    NEEDS_SEARCH,
    TuningKey,
    check_config,
    choose_config,
    device_name,
    dtype_name,
    dtype_size,
    keep_fitting,
    plan_config,
    shared_memory_limit,
    tile_misfit,
)

LOG2E = 1.4426950408889634
# Cap on query tokens x group heads per program (the M of tl.dot), by padded head_dim (the wider of
# K and V): keeps the fp32 accumulator [BLOCK_M, BLOCK_DV] and the query tile at <= 64 KiB of
# registers per program each.
_MAX_ROWS = {16: 128, 32: 128, 64: 128, 128: 128, 256: 64}
_MAX_SPLITS = 64
_MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed costs outweigh the parallelism it adds
# The tunable knobs' values (see `decode_configs`).
DECODE_BLOCK_N = (16, 32, 64, 128)
DECODE_NUM_WARPS = (2, 4, 8)


@triton.jit
def _tanh(x):
    # tanh through exp2 of a non-positive argument: no overflow, and the same on every backend.
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _key_range(seq_len, q_len, q_start, window, chunk, Q_PER_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr):
    """Keys [lo, hi) that the tile's queries q_start.. can see; lo is aligned down to BLOCK_N. The
    tile's first query has the lowest bound of the tile under both the window and the chunk."""
    first_pos = seq_len - q_len + q_start
    last_pos = seq_len - q_len + tl.minimum(q_len, q_start + Q_PER_TILE) - 1
    hi = last_pos + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    if HAS_CHUNK:
        lo = tl.maximum(lo, (first_pos // chunk) * chunk)
    if HAS_WINDOW or HAS_CHUNK:
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _paged_decode_kernel(
    query_ptr,  # [num_tokens, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    key_scales_ptr,  # [num_blocks, block_size, G, 1] fp32, G = num_kv_heads or 1, read only if IS_QUANTIZED
    value_scales_ptr,  # [num_blocks, block_size, G, 1] fp32, read only if IS_QUANTIZED
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [num_q_heads], read only if HAS_SINKS
    out_ptr,  # [num_tokens, num_q_heads, head_dim_v], written only if NUM_SPLITS == 1
    partial_out_ptr,  # [num_splits, num_tokens, num_q_heads, head_dim_v] fp32, if NUM_SPLITS > 1
    partial_lse_ptr,  # [num_splits, num_tokens, num_q_heads] fp32 (log2), if NUM_SPLITS > 1
    stride_q_token, stride_q_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_ks_block, stride_ks_slot, stride_ks_group,  # stride_ks_group 0 when G == 1
    stride_vs_block, stride_vs_slot, stride_vs_group,
    stride_bt_seq,
    stride_out_token, stride_out_head,
    stride_sinks,
    num_tokens,
    num_q_heads,
    head_dim,
    head_dim_v,
    num_q_tiles,
    scale,
    softcap,
    window,
    chunk,  # Llama 4's local chunk C: key p visible iff p >= (pos // C) * C (read only if HAS_CHUNK)
    GROUP: tl.constexpr,  # query heads per KV head
    Q_PER_TILE: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # >= Q_PER_TILE * GROUP, power of two, >= 16
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two >= 16
    BLOCK_DV: tl.constexpr,  # head_dim_v padded to a power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    IS_QUANTIZED: tl.constexpr,  # one-byte K/V payloads, dequantised with their scales on load
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no silent TF32), None (the default) otherwise
):
    seq = tl.program_id(0) // num_q_tiles
    q_start = (tl.program_id(0) % num_q_tiles) * Q_PER_TILE
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    cu_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - cu_start
    if q_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    # Rows: query token m // GROUP of the tile, query head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    row_token = rows // GROUP
    row_valid = (row_token < Q_PER_TILE) & (q_start + row_token < q_len)
    token = (cu_start + q_start + row_token).to(tl.int64)
    head = kv_head * GROUP + rows % GROUP
    q_pos = seq_len - q_len + q_start + row_token  # [BLOCK_M]
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    dims_v = tl.arange(0, BLOCK_DV)
    dim_v_valid = dims_v < head_dim_v

    q = tl.load(
        query_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :], other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    lo, hi = _key_range(seq_len, q_len, q_start, window, chunk, Q_PER_TILE, BLOCK_N, HAS_WINDOW, HAS_CHUNK)
    tiles_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), NUM_SPLITS)
    split_lo = lo + split * tiles_per_split * BLOCK_N
    split_hi = tl.minimum(hi, split_lo + tiles_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kc_head = key_cache_ptr + kv_head.to(tl.int64) * stride_kc_head
    vc_head = value_cache_ptr + kv_head.to(tl.int64) * stride_vc_head
    ks_group = key_scales_ptr + kv_head.to(tl.int64) * stride_ks_group
    vs_group = value_scales_ptr + kv_head.to(tl.int64) * stride_vs_group

    for start in range(split_lo, split_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_valid = k_pos < split_hi
        # Table entries past the sequence may be garbage: they are masked, never dereferenced.
        block = tl.load(block_table + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        k = tl.load(
            kc_head + block[:, None] * stride_kc_block + slot[:, None] * stride_kc_slot + dims[None, :],
            mask=k_valid[:, None] & dim_valid[None, :], other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            vc_head + block[:, None] * stride_vc_block + slot[:, None] * stride_vc_slot + dims_v[None, :],
            mask=k_valid[:, None] & dim_v_valid[None, :], other=0.0,
        )  # [BLOCK_N, BLOCK_DV]
        if IS_QUANTIZED:
            # Dequantise in fp32, then round once to the query's dtype (as kv_quant.dequantize).
            # Masked keys get scale 0 and payload 0, so they stay exact zeros.
            k_scale = tl.load(ks_group + block * stride_ks_block + slot * stride_ks_slot, mask=k_valid, other=0.0)
            v_scale = tl.load(vs_group + block * stride_vs_block + slot * stride_vs_slot, mask=k_valid, other=0.0)
            k = k.to(tl.float32) * k_scale[:, None]
            v = v.to(tl.float32) * v_scale[:, None]
        # Cast to the query's dtype on load: a 16-bit cache under an fp32 query is upcast exactly.
        k = k.to(q.dtype)
        v = v.to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = s * 1.4426950408889634
        allowed = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
        if HAS_WINDOW:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        if HAS_CHUNK:
            allowed &= k_pos[None, :] >= (q_pos[:, None] // chunk) * chunk
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no visible key so far keeps m = -inf; subtracting 0 instead avoids inf - inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_valid[:, None] & dim_v_valid[None, :]
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head * stride_sinks, mask=row_valid, other=0.0).to(tl.float32)
            sink = sink * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_fin)
            l_i = l_i * alpha + tl.exp2(sink - m_fin)
            acc = acc * alpha[:, None]
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims_v[None, :],
            o.to(out_ptr.dtype.element_ty), mask=out_mask,
        )
    else:
        # Partials are contiguous fp32 buffers. An empty split stores lse = -inf and o = 0.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        row = (split * num_tokens + token) * num_q_heads + head  # [BLOCK_M] int64
        tl.store(partial_out_ptr + row[:, None] * head_dim_v + dims_v[None, :], o, mask=out_mask)
        tl.store(partial_lse_ptr + row, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,  # [num_splits, num_tokens, num_q_heads, head_dim_v] fp32
    partial_lse_ptr,  # [num_splits, num_tokens, num_q_heads] fp32 (log2)
    sinks_ptr,  # [num_q_heads], read only if HAS_SINKS
    out_ptr,  # [num_tokens, num_q_heads, head_dim_v]
    stride_out_token, stride_out_head,
    stride_sinks,
    num_tokens,
    num_q_heads,
    head_dim_v,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= NUM_SPLITS
    BLOCK_DV: tl.constexpr,  # head_dim_v padded to a power of two
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, BLOCK_DV)
    dim_valid = dims < head_dim_v

    row = (splits * num_tokens + token) * num_q_heads + head  # [BLOCK_S]
    lse = tl.load(partial_lse_ptr + row, mask=split_valid, other=float("-inf"))
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head * stride_sinks).to(tl.float32) * 1.4426950408889634
    else:
        sink = float("-inf")  # a logit of -inf adds nothing below
    m = tl.maximum(tl.max(lse, axis=0), sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(lse - m)  # [BLOCK_S], 0 for empty splits
    total = tl.sum(weight, axis=0) + tl.exp2(sink - m)
    o = tl.load(
        partial_out_ptr + row[:, None] * head_dim_v + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :], other=0.0,
    )  # [BLOCK_S, BLOCK_DV]
    o = tl.sum(o * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims, o.to(out_ptr.dtype.element_ty),
             mask=dim_valid)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter / CPU: only the split logic matters, not occupancy


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _query_tiling(max_seqlen_q: int, group: int, block_d: int) -> tuple[int, int]:
    """(query tokens per program, BLOCK_M): as many tokens as fit in _MAX_ROWS rows (at least one,
    so a group wider than the cap still gets one program per query token)."""
    q_per_tile = max(1, min(max_seqlen_q, _MAX_ROWS.get(block_d, 64) // group))
    block_m = max(16, triton.next_power_of_2(q_per_tile * group))
    return q_per_tile, block_m


def _num_stages(block_n: int, block_d: int, block_dv: int, kv_bytes: int) -> int:
    # Software pipelining would buffer K and V tiles in shared memory per stage: 3 stages of 32 KiB,
    # or 2 when a stage is bigger (fp32, head_dim 256), to stay well inside ~227 KiB.
    return 3 if block_n * (block_d + block_dv) * kv_bytes <= 32 * 1024 else 2


@functools.lru_cache(maxsize=1024)
def tuning_key(
    device: torch.device,
    head_dim: int,
    head_dim_v: int,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    max_seqlen_q: int,
) -> TuningKey:
    """The `TuningKey` of a `paged_decode` launch: its BLOCK_M (query rows per program, from
    `max_seqlen_q` and the group) is part of it, so a decode step's winner never tiles a long verify step.
    Memoised: triton.cdiv / next_power_of_2 cost microseconds a call on the host, and this runs per launch."""
    _, block_m = _query_tiling(max(max_seqlen_q, 1), group, max(_block_d(head_dim), _block_d(head_dim_v)))
    return TuningKey("paged_decode", device_name(device), head_dim, head_dim_v, group, block_size,
                     dtype_name(dtype), dtype_name(kv_dtype), block_m)


@functools.lru_cache(maxsize=1024)
def heuristic_config(key: TuningKey) -> triton.Config:
    """The launch configuration when no winner is recorded or tuned: hand-picked, not measured."""
    block_d, block_dv = _block_d(key.head_dim), _block_d(key.head_dim_v)
    block_wide = max(block_d, block_dv)
    block_n = 64 if block_wide <= 128 else 32
    num_warps = 4 if key.block_m * block_wide <= 64 * 128 else 8
    return triton.Config({"BLOCK_N": block_n}, num_warps=num_warps,
                         num_stages=_num_stages(block_n, block_d, block_dv, dtype_size(key.kv_dtype)))


def decode_configs(key: TuningKey, shared_memory: int = DEFAULT_SHARED_MEMORY) -> list[triton.Config]:
    """The pruned candidates of a decode key, `heuristic_config` first.

    Candidates are DECODE_BLOCK_N x DECODE_NUM_WARPS, each with the num_stages `_num_stages` gives
    its BLOCK_N. num_stages is not searched, to keep the search's compiles few: the block-table
    gathers are not software-pipelined, and on sm_90 (ptxas, Triton 3.6 and 3.9) stages 3 and 4 give
    the same cubin; stages 1 and 2 differ in registers, and are left to a wider search on a GPU. `tuning.tile_misfit` drops what cannot fit
    the shared memory, would spill registers, or leaves warps idle (at BLOCK_M 16, a BLOCK_N of 16
    feeds two warps at most).

    Args:
        key: a `tuning_key`.
        shared_memory: bytes one program may use (`tuning.shared_memory_limit` of the device).
    """
    block_d, block_dv = _block_d(key.head_dim), _block_d(key.head_dim_v)
    kv_bytes = dtype_size(key.kv_dtype)
    elem_bytes = max(dtype_size(key.dtype), kv_bytes)  # K/V tiles are cast to the query's dtype on load
    configs = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=_num_stages(n, block_d, block_dv, kv_bytes))
               for n in DECODE_BLOCK_N for w in DECODE_NUM_WARPS]

    def misfit(c: triton.Config) -> str | None:
        return tile_misfit(block_m=key.block_m, block_n=c.kwargs["BLOCK_N"], block_d=block_d, block_dv=block_dv,
                           num_warps=c.num_warps, num_stages=c.num_stages, elem_bytes=elem_bytes,
                           shared_memory=shared_memory)

    return keep_fitting(heuristic_config(key), configs, misfit)


def default_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    num_q_heads: int,
    head_dim: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    device: torch.device,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
) -> int:
    """Splits of the key axis for `paged_decode` when the caller passes none.

    Aims for about two programs per SM: the pass-1 grid without splits is
    `num_seqs * num_q_tiles * num_kv_heads`, and the longest context is cut into more splits until
    that target is reached, but never into splits of fewer than _MIN_KEYS_PER_SPLIT keys (a sliding
    window or a local chunk caps the keys a query tile reads) and never more than _MAX_SPLITS.
    Depends on host ints only, so it is stable across a CUDA graph's replays with the same shapes.
    """
    q_per_tile, _ = _query_tiling(max(max_seqlen_q, 1), num_q_heads // max(num_kv_heads, 1), _block_d(head_dim))
    programs = max(1, num_seqs * triton.cdiv(max(max_seqlen_q, 1), q_per_tile) * num_kv_heads)
    keys = max_seqlen_k
    for bound in (sliding_window, chunk_size):
        if bound is not None:
            keys = min(keys, bound + q_per_tile - 1)
    wanted = triton.cdiv(2 * _num_sms(device), programs)
    useful = triton.cdiv(max(keys, 1), _MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, useful, _MAX_SPLITS))


@dataclass
class DecodePlan:
    """Everything `paged_decode` launches with besides the tensors: chosen once per step and layer
    kind (`plan_decode`), shared by every layer of that kind (FlashInfer's `plan()` result).

    Attributes:
        key: the launch's `TuningKey`.
        shape: (num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim, head_dim_v, block_size),
            what the plan was sized for; a launch with other shapes is refused.
        q_per_tile, block_m, num_q_tiles: the query tiling (`_query_tiling`).
        num_splits: splits of the key axis.
        config: the launch configuration (BLOCK_N, num_warps, num_stages); None until the first
            launch when an autotune search is pending (it needs real arguments), then its winner.
        partial_out: [num_splits, num_tokens, num_q_heads, head_dim_v] fp32, or None (one split).
        partial_lse: [num_splits, num_tokens, num_q_heads] fp32 (log2), or None (one split).
    """

    key: TuningKey
    shape: tuple[int, ...]
    q_per_tile: int
    block_m: int
    num_q_tiles: int
    num_splits: int
    config: triton.Config | None
    partial_out: torch.Tensor | None = None
    partial_lse: torch.Tensor | None = None


def plan_decode(
    *,
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int,
    block_size: int,
    dtype: torch.dtype,  # the query's
    kv_dtype: torch.dtype,  # the cache's
    max_seqlen_q: int,
    max_seqlen_k: int,
    device: torch.device,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    config: triton.Config | None = None,
    workspace=None,  # a `workspace.Workspace` for the split-K partials; None allocates them
    chunk_size: int | None = None,
) -> DecodePlan:
    """Plan `paged_decode` launches of one shape: the query tiling, the split count
    (`default_num_splits` unless given), the launch configuration (given, settled, recorded or the
    heuristic; `tuning.plan_config`) and the split-K scratch (views of `workspace` when given, so
    every layer and every step of the same bucket writes the same memory). Host ints only: no device
    sync, nothing read from the tensors, so a CUDA graph captures its launches as planned."""
    if num_splits is not None and (int(num_splits) != num_splits or num_splits < 1):
        raise ValueError(f"paged_decode: num_splits must be a positive int or None, got {num_splits}")
    if config is not None:
        check_config("paged_decode", config, ("BLOCK_N",))
    max_seqlen_q = max(max_seqlen_q, 1)
    group = num_q_heads // num_kv_heads
    block_wide = max(_block_d(head_dim), _block_d(head_dim_v))  # tiles are sized for the wider of K and V
    q_per_tile, block_m = _query_tiling(max_seqlen_q, group, block_wide)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, num_q_heads, max(head_dim, head_dim_v),
                                        max_seqlen_q, max_seqlen_k, device, sliding_window, chunk_size)
    num_splits = int(num_splits)
    key = tuning_key(device, head_dim, head_dim_v, group, block_size, dtype, kv_dtype, max_seqlen_q)
    if config is None:
        config = plan_config(key, lambda: decode_configs(key, shared_memory_limit(device)), device)
        if config is not NEEDS_SEARCH:
            config = config or heuristic_config(key)
        else:
            config = None  # the first launch searches on its arguments
    plan = DecodePlan(key, (num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim, head_dim_v, block_size),
                      q_per_tile, block_m, triton.cdiv(max_seqlen_q, q_per_tile), num_splits, config)
    if num_splits > 1 and num_tokens > 0:
        partial = (num_splits, num_tokens, num_q_heads)
        if workspace is None:
            plan.partial_out = torch.empty(*partial, head_dim_v, device=device, dtype=torch.float32)
            plan.partial_lse = torch.empty(*partial, device=device, dtype=torch.float32)
        else:
            plan.partial_out = workspace.get("decode_partial_out", (*partial, head_dim_v), torch.float32, device)
            plan.partial_lse = workspace.get("decode_partial_lse", partial, torch.float32, device)
    return plan


def paged_decode(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], packed by cu_seqlens_q
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this step's
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads]
    num_splits: int | None = None,
    scales=None,  # kv_quant.KVScales of a quantised (int8 / fp8) cache, or None
    config: triton.Config | None = None,
    plan: DecodePlan | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim_v]
    """Causal attention of each sequence's few new queries over its paged K/V, split along the keys.

    Same semantics as `reference.paged_attention` (query `i` of sequence `b` sits at position
    `seq_lens[b] - q_len[b] + i`; sliding window keeps keys `p > pos - w`; a chunk `C` keeps keys
    `p >= (pos // C) * C`, both bounds when both are given; softcap applies to the
    scaled scores before masking; a sink is one extra per-head logit in the softmax denominator;
    sequences with q_len 0 are allowed; this step's K/V must already be in the cache). Built for
    `max_seqlen_q` up to ~16 (decode, speculative verify); longer query runs are tiled and stay
    correct, but a prefill kernel suits them better.

    Args:
        query: `[num_tokens, num_q_heads, head_dim]` fp16/bf16/fp32, last dim contiguous.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` and
            `[..., head_dim_v]` (V's width may differ), in the query's dtype, or fp16/bf16 under an
            fp32 query (upcast on load), or one-byte int8 / fp8 payloads with `scales`.
        block_tables: `[num_seqs, max_blocks_per_seq]` int32; entries past a sequence's length are
            never read, so they may hold anything.
        seq_lens: `[num_seqs]` int32. cu_seqlens_q: `[num_seqs + 1]` int32.
        max_seqlen_q, max_seqlen_k: host-side upper bounds of the query and key lengths.
        scale: softmax scale. sliding_window: window `w >= 1` or None. softcap: `> 0` or None.
        chunk_size: local-attention chunk `C >= 1` (Llama 4) or None.
        sinks: `[num_q_heads]` sink logits (any float dtype) or None.
        num_splits: splits of the key axis; None picks `default_num_splits`.
        scales: a quantised cache's `kv_quant.KVScales` (`.key` / `.value` `[num_blocks, block_size, G, 1]`
            float32, G = num_kv_heads or 1); K/V are dequantised in registers as they are read. The
            "asymmetric" scheme is refused.
        config: a `triton.Config` of `BLOCK_N`, num_warps and num_stages to launch with instead of the
            recorded, tuned or heuristic one (`tuning.choose_config`); any such config gives the same result.
        plan: a `plan_decode` result for these shapes (a step's layers share one): its tiling, split
            count, config and scratch are used as they are, so the launch computes, looks up and
            allocates nothing but its output; `num_splits` and `config` must then be None. Without
            one, the call plans for itself.

    Returns:
        `[num_tokens, num_q_heads, head_dim_v]` in query's dtype.
    """
    shapes = check_attention_inputs("paged_decode", query, key_cache, value_cache, block_tables, seq_lens,
                                    cu_seqlens_q, max_seqlen_k, sliding_window, softcap, sinks, scales=scales,
                                    chunk_size=chunk_size)
    num_tokens, num_q_heads, head_dim = shapes.num_tokens, shapes.num_q_heads, shapes.head_dim
    num_seqs, block_size, num_kv_heads = shapes.num_seqs, shapes.block_size, shapes.num_kv_heads
    head_dim_v = shapes.head_dim_v
    is_empty = num_tokens == 0 or max_seqlen_k == 0 or num_seqs == 0
    if plan is None and is_empty:  # nothing to launch: check the arguments, plan nothing
        if num_splits is not None and (int(num_splits) != num_splits or num_splits < 1):
            raise ValueError(f"paged_decode: num_splits must be a positive int or None, got {num_splits}")
        if config is not None:
            check_config("paged_decode", config, ("BLOCK_N",))
    elif plan is None:
        plan = plan_decode(num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, head_dim_v=head_dim_v, block_size=block_size,
                           dtype=query.dtype, kv_dtype=key_cache.dtype, max_seqlen_q=max_seqlen_q,
                           max_seqlen_k=max_seqlen_k, device=query.device, sliding_window=sliding_window,
                           num_splits=num_splits, config=config, chunk_size=chunk_size)
    elif num_splits is not None or config is not None:
        raise ValueError("paged_decode: pass num_splits and config to plan_decode, not with a plan")
    elif plan.shape != (num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim, head_dim_v, block_size):
        raise ValueError(f"paged_decode: the plan was made for (num_tokens, num_seqs, num_q_heads, num_kv_heads, "
                         f"head_dim, head_dim_v, block_size) = {plan.shape}, not these inputs")

    out = query.new_empty(num_tokens, num_q_heads, head_dim_v)
    if is_empty:
        return out.zero_()

    group = num_q_heads // num_kv_heads
    block_d, block_dv = _block_d(head_dim), _block_d(head_dim_v)
    q_per_tile, block_m, num_q_tiles, num_splits = plan.q_per_tile, plan.block_m, plan.num_q_tiles, plan.num_splits
    partial_out = plan.partial_out if num_splits > 1 else out  # unused with one split
    partial_lse = plan.partial_lse if num_splits > 1 else out
    sinks_arg = sinks if sinks is not None else out  # unused without HAS_SINKS
    stride_sinks = sinks.stride(0) if sinks is not None else 0
    key_scales, value_scales, scale_strides = kv_scale_args(scales, num_kv_heads, out)

    def launch(config: triton.Config) -> None:
        _paged_decode_kernel[(num_seqs * num_q_tiles, num_kv_heads, num_splits)](
            query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens, cu_seqlens_q,
            sinks_arg, out, partial_out, partial_lse,
            query.stride(0), query.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            *scale_strides,
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            stride_sinks,
            num_tokens,
            num_q_heads,
            head_dim,
            head_dim_v,
            num_q_tiles,
            float(scale),
            float(softcap) if softcap is not None else 1.0,
            int(sliding_window) if sliding_window is not None else 0,
            int(chunk_size) if chunk_size is not None else 1,
            GROUP=group,
            Q_PER_TILE=q_per_tile,
            BLOCK_M=block_m,
            BLOCK_N=config.kwargs["BLOCK_N"],
            BLOCK_D=block_d,
            BLOCK_DV=block_dv,
            BLOCK_SIZE=block_size,
            NUM_SPLITS=num_splits,
            HAS_WINDOW=sliding_window is not None,
            HAS_CHUNK=chunk_size is not None,
            HAS_SOFTCAP=softcap is not None,
            HAS_SINKS=sinks is not None,
            IS_QUANTIZED=scales is not None,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )

    config = plan.config
    if config is None:  # an autotune search was pending at planning: run it on these arguments, once
        key = plan.key
        config = plan.config = choose_config(key, lambda: decode_configs(key, shared_memory_limit(query.device)),
                                             launch, query.device) or heuristic_config(key)
    launch(config)
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            partial_out, partial_lse, sinks_arg, out,
            out.stride(0), out.stride(1),
            stride_sinks,
            num_tokens,
            num_q_heads,
            head_dim_v,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_DV=block_dv,
            HAS_SINKS=sinks is not None,
        )
    return out
