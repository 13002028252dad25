"""Flash-attention prefill over the paged KV cache (varlen, causal, chunked-prefill aware).

Same contract as `reference.paged_attention`: the queries of a step are packed along the token
axis by `cu_seqlens_q`, and query `i` of sequence `b` sits at position
`seq_lens[b] - q_len[b] + i`. Every key it may see (the cached prefix and the step's own tokens,
already written by `store_kv`) is read from the paged cache through the block table:

    block_tables[b] = [7, 2, 9, ...]        key position p lives in block block_tables[b][p // block_size]
    key_cache[7]    = [block_size, num_kv_heads, head_dim]    at row p % block_size

Work split (one program = one query tile x one KV head):

    grid = (num_tokens // BLOCK_Q + num_seqs, num_kv_heads)

* A query tile holds BLOCK_Q consecutive tokens of ONE sequence. GQA/MQA is handled by packing:
  the tile's BLOCK_M rows are (token, head-in-group) pairs, `row = token * GROUP + h`, so the
  K/V tile of the KV head is loaded once and used by all `GROUP` query heads (no repeated K/V, and
  a decode row still fills the tile when the group is large). Rows past `BLOCK_Q * GROUP` or past
  the sequence's `q_len` are padding: computed, never stored.
* Sequence `b` owns tiles `first_tile(b) = cu_seqlens_q[b] // BLOCK_Q + b` onwards. `first_tile`
  is strictly increasing and leaves at least `ceil(q_len / BLOCK_Q)` ids per sequence, so the grid
  size needs only `num_tokens` (a host-side shape) and never reads `cu_seqlens_q` on the host: no
  device-to-host sync per layer. Each program binary-searches `cu_seqlens_q` for its sequence
  (log2(num_seqs) scalar loads) and exits at once if its tile starts past `q_len` (at most
  `num_seqs` such idle programs).
* Each program loops over key tiles of BLOCK_N positions, gathering the rows through the block
  table (per-position block lookup, so any block_size works, 1 included), with an fp32 online
  softmax in the log2 domain. Key tiles that are fully masked are never visited: the loop stops
  at the tile's last query position (causal end) and, with a sliding window or a local chunk
  (Llama 4: keys from `(pos // C) * C` on), starts at the tile holding the first position the
  earliest query of the tile can still see.
* K/V tiles are cast to the query's dtype as they are loaded (a 16-bit cache under an fp32 query).
  V may be narrower or wider than Q/K (`head_dim_v`, BLOCK_DV): the accumulator and the output
  have V's width.
* A quantised cache (IS_QUANTIZED: one-byte int8 / fp8 payloads, float32 scales per token and KV
  head or per token) is dequantised in registers: a tile's BLOCK_N scales come through the same
  block-table lookup, and the tile becomes `payload.to(fp32) * scale`, rounded once to the query's
  dtype (as `kv_quant.dequantize`), before the dots. No dequantised copy of the cache is written.

Launch configuration: ROWS (the rows a query tile aims for, which sets BLOCK_Q and BLOCK_M), BLOCK_N
and num_warps never change the result, so they are tunable; the launcher takes a winner recorded for
the GPU and shape, or searches when HF_PAGED_AUTOTUNE=1, or its heuristic (see `tuning` and
`prefill_configs`).
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

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) == exp2(x * LOG2E)
# The tunable knobs' values (see `prefill_configs`).
PREFILL_ROWS = (64, 128)
PREFILL_BLOCK_N = (32, 64, 128)
PREFILL_NUM_WARPS = (4, 8)
# Triton's default on CUDA, what every prefill launch got before it was tunable. Not searched: the
# block-table gathers are not software-pipelined (Triton 3.9, sm_90), num_stages changes nothing.
PREFILL_NUM_STAGES = 3


@triton.jit
def _tanh(x):
    # tl has no portable tanh (libdevice is CUDA-only and absent in the interpreter); this form
    # saturates cleanly to +-1 for large |x| (exp overflow gives 1/inf = 0).
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _find_seq(
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    tile_idx,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """Largest sequence `b` with `cu_seqlens_q[b] // BLOCK_Q + b <= tile_idx` (binary search)."""
    lo: tl.int32 = 0  # invariant: first_tile(lo) <= tile_idx (first_tile(0) == 0)
    hi = num_seqs  # invariant: first_tile(hi) > tile_idx, or hi == num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _flash_prefill_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim_v]
    query_ptr,  # [num_tokens, num_q_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    key_scales_ptr,  # [num_blocks, block_size, G, 1] fp32, G = num_kv_heads or 1 (read only if IS_QUANTIZED)
    value_scales_ptr,  # [num_blocks, block_size, G, 1] fp32 (read only if IS_QUANTIZED)
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    sinks_ptr,  # [num_q_heads] (read only if HAS_SINKS)
    num_seqs,
    num_tokens,
    scale,  # float: softmax scale on q.k
    softcap,  # float: cap (read only if HAS_SOFTCAP)
    sliding_window,  # int: window w, key p visible iff p > pos - w (read only if HAS_WINDOW)
    chunk_size,  # int: chunk C, key p visible iff p >= (pos // C) * C (read only if HAS_CHUNK)
    block_size,
    head_dim,
    head_dim_v,
    stride_ot, stride_oh,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ksb, stride_kss, stride_ksg,  # key scales; stride_ksg 0 when G == 1
    stride_vsb, stride_vss, stride_vsg,
    stride_bt,
    stride_sink,
    GROUP: tl.constexpr,  # num_q_heads // num_kv_heads
    BLOCK_Q: tl.constexpr,  # query tokens per tile (any positive int)
    BLOCK_M: tl.constexpr,  # rows per tile, power of two >= BLOCK_Q * GROUP and >= 16
    BLOCK_N: tl.constexpr,  # key positions per inner step, power of two >= 16
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of two >= 16
    BLOCK_DV: tl.constexpr,  # head_dim_v padded to a power of two >= 16
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    IS_QUANTIZED: tl.constexpr,  # one-byte K/V payloads, dequantised with their scales on load
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (tf32 would miss the fp32 tolerance), else None
):
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_seq(cu_seqlens_q_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tile_q_start = (tile_idx - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first token of the tile, in-sequence
    if tile_q_start >= q_len:
        return  # spare grid slot (the grid over-provisions by up to one tile per sequence)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # cached positions before this step's first query

    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_q_start + rows // GROUP  # [BLOCK_M] token index within the sequence
    q_head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] always a real head
    row_valid = (rows // GROUP < BLOCK_Q) & (q_idx < q_len)
    q_pos = context_len + q_idx  # [BLOCK_M] absolute position of each row's token
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_valid = offs_dv < head_dim_v
    token = (q_start + q_idx).to(tl.int64)
    row_valid = row_valid & (token < num_tokens)  # a cu_seqlens_q past num_tokens never writes out of bounds

    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(query_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

    # Online-softmax state, log2 domain. A sink is one extra logit with no value: start the running
    # max at it with a running sum of exp2(sink - sink) = 1, and it lands in the denominator only.
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + q_head * stride_sink).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Key range that any valid row of this tile can see; tiles outside it are skipped entirely.
    tile_q_last = tl.minimum(tile_q_start + BLOCK_Q, q_len) - 1
    kv_end = context_len + tile_q_last + 1  # causal end (<= seq_len)
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(context_len + tile_q_start - sliding_window + 1, 0)
    if HAS_CHUNK:  # the tile's first query starts the earliest chunk any row of the tile reads
        kv_start = tl.maximum(kv_start, ((context_len + tile_q_start) // chunk_size) * chunk_size)
    if HAS_WINDOW or HAS_CHUNK:
        kv_start = (kv_start // BLOCK_N) * BLOCK_N

    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(kv_start, kv_end, BLOCK_N):
        k_pos = start_n + offs_n  # [BLOCK_N]
        k_valid = k_pos < kv_end  # never touch table slots past the sequence (may hold garbage)
        block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // block_size, mask=k_valid, other=0)
        block = block.to(tl.int64)  # block * stride_kb overflows int32 on large caches
        in_block = k_pos % block_size
        k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh  # [BLOCK_N]

        k_t = tl.load(key_cache_ptr + k_off[None, :] + offs_d[:, None],
                      mask=d_valid[:, None] & k_valid[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        if IS_QUANTIZED:
            # Dequantise in fp32, then round once to the query's dtype (as kv_quant.dequantize); masked
            # keys get payload 0 and scale 0, so they stay exact zeros.
            k_scale = tl.load(key_scales_ptr + block * stride_ksb + in_block * stride_kss + kv_head * stride_ksg,
                              mask=k_valid, other=0.0)  # [BLOCK_N]
            k_t = k_t.to(tl.float32) * k_scale[None, :]
        # Cast to the query's dtype on load: a 16-bit cache under an fp32 query is upcast exactly.
        k_t = k_t.to(q.dtype)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        if HAS_SOFTCAP:
            s = softcap * _tanh(s * (scale / softcap)) * LOG2E
        else:
            s = s * (scale * LOG2E)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if HAS_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        if HAS_CHUNK:
            allowed = allowed & (k_pos[None, :] >= (q_pos[:, None] // chunk_size) * chunk_size)
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 instead so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)

        v = tl.load(value_cache_ptr + v_off[:, None] + offs_dv[None, :],
                    mask=k_valid[:, None] & dv_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        if IS_QUANTIZED:
            v_scale = tl.load(value_scales_ptr + block * stride_vsb + in_block * stride_vss + kv_head * stride_vsg,
                              mask=k_valid, other=0.0)  # [BLOCK_N]
            v = v.to(tl.float32) * v_scale[:, None]
        v = v.to(q.dtype)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    # Valid rows always see their own position (l_i > 0); the guard only keeps padding rows finite.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dv_valid[None, :])


def _padded_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _query_tile(rows: int, group: int, max_seqlen_q: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): fill `rows` rows with whole GQA groups, but take no more tokens than any
    sequence has this step (decode / speculative-verify rows in the batch get small tiles)."""
    block_q = max(1, min(rows // group, max(max_seqlen_q, 1)))
    return block_q, max(16, triton.next_power_of_2(block_q * group))


@functools.lru_cache(maxsize=1024)
def tuning_key(
    device: torch.device,
    head_dim: int,
    head_dim_v: int,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> TuningKey:
    """The `TuningKey` of a `flash_prefill` launch (no BLOCK_M: the tile's rows are a tuned knob).
    Memoised, as it runs per launch."""
    return TuningKey("flash_prefill", device_name(device), head_dim, head_dim_v, group, block_size,
                     dtype_name(dtype), dtype_name(kv_dtype))


def _heuristic(block_d: int) -> triton.Config:
    rows = 64  # target rows per tile: the tutorial's sweet spot for d <= 128 on Hopper/Ampere
    block_n = 64 if block_d <= 128 else 32  # d = 256: keep the K/V tiles and acc within registers
    num_warps = 4 if block_d <= 64 else 8
    return triton.Config({"BLOCK_N": block_n, "ROWS": rows}, num_warps=num_warps, num_stages=PREFILL_NUM_STAGES)


def heuristic_config(key: TuningKey) -> triton.Config:
    """The launch configuration when no winner is recorded or tuned: hand-picked, not measured."""
    return _heuristic(max(_padded_dim(key.head_dim), _padded_dim(key.head_dim_v)))


def _pick_tiles(head_dim: int, group: int, max_seqlen_q: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_D, num_warps) of the heuristic, `head_dim` being the wider of
    the K and V rows."""
    block_d = _padded_dim(head_dim)
    config = _heuristic(block_d)
    block_q, block_m = _query_tile(config.kwargs["ROWS"], group, max_seqlen_q)
    return block_q, block_m, config.kwargs["BLOCK_N"], block_d, config.num_warps


def prefill_configs(key: TuningKey, shared_memory: int = DEFAULT_SHARED_MEMORY) -> list[triton.Config]:
    """The pruned candidates of a prefill key, `heuristic_config` first.

    Candidates are PREFILL_ROWS x PREFILL_BLOCK_N x PREFILL_NUM_WARPS at PREFILL_NUM_STAGES.
    `tuning.tile_misfit` drops what cannot fit the shared memory or would spill registers, judged at
    the tile's full BLOCK_M (a step with shorter query runs only gets smaller tiles).

    Args:
        key: a `tuning_key`.
        shared_memory: bytes one program may use (`tuning.shared_memory_limit` of the device).
    """
    block_d, block_dv = _padded_dim(key.head_dim), _padded_dim(key.head_dim_v)
    elem_bytes = max(dtype_size(key.dtype), dtype_size(key.kv_dtype))  # K/V are cast to the query's dtype
    configs = [triton.Config({"BLOCK_N": n, "ROWS": r}, num_warps=w, num_stages=PREFILL_NUM_STAGES)
               for r in PREFILL_ROWS for n in PREFILL_BLOCK_N for w in PREFILL_NUM_WARPS]

    def misfit(c: triton.Config) -> str | None:
        # The widest tile a step can get: BLOCK_Q is capped by max_seqlen_q, never raised by it.
        _, block_m = _query_tile(c.kwargs["ROWS"], key.group, c.kwargs["ROWS"])
        return tile_misfit(block_m=block_m, block_n=c.kwargs["BLOCK_N"], block_d=block_d, block_dv=block_dv,
                           num_warps=c.num_warps, num_stages=c.num_stages, elem_bytes=elem_bytes,
                           shared_memory=shared_memory)

    return keep_fitting(heuristic_config(key), configs, misfit)


@dataclass
class PrefillPlan:
    """Everything `flash_prefill` launches with besides the tensors, chosen once per step and layer
    kind (`plan_prefill`) and shared by every layer of that kind.

    Attributes:
        key: the launch's `TuningKey`.
        shape: (num_q_heads, num_kv_heads, head_dim, head_dim_v, block_size) it was planned for.
        max_seqlen_q: the step's longest query run (it caps the query tile).
        config: the recorded or tuned configuration, None for the heuristic tiles below, or None
            with `is_search_pending` until the first launch has searched.
        tiles: (BLOCK_Q, BLOCK_M, BLOCK_N, num_warps, num_stages) to launch with; None while a
            search is pending.
    """

    key: TuningKey
    shape: tuple[int, ...]
    max_seqlen_q: int
    config: triton.Config | None
    tiles: tuple[int, int, int, int, int] | None
    is_search_pending: bool = False


def _tiles_of(config: triton.Config, group: int, max_seqlen_q: int) -> tuple[int, int, int, int, int]:
    block_q, block_m = _query_tile(config.kwargs["ROWS"], group, max_seqlen_q)
    return block_q, block_m, config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def plan_prefill(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int,
    block_size: int,
    dtype: torch.dtype,  # the query's
    kv_dtype: torch.dtype,  # the cache's
    max_seqlen_q: int,
    device: torch.device,
    config: triton.Config | None = None,
) -> PrefillPlan:
    """Plan `flash_prefill` launches of one shape: the launch configuration (given, settled,
    recorded, else the heuristic's `_pick_tiles`; `tuning.plan_config`) and the query tiles it gives
    for this step's `max_seqlen_q`. Host ints only."""
    if config is not None:
        check_config("flash_prefill", config, ("BLOCK_N", "ROWS"))
    group = num_q_heads // num_kv_heads
    key = tuning_key(device, head_dim, head_dim_v, group, block_size, dtype, kv_dtype)
    shape = (num_q_heads, num_kv_heads, head_dim, head_dim_v, block_size)
    if config is None:
        config = plan_config(key, lambda: prefill_configs(key, shared_memory_limit(device)), device)
        if config is NEEDS_SEARCH:  # the first launch searches on its arguments
            return PrefillPlan(key, shape, max_seqlen_q, None, None, is_search_pending=True)
    if config is None:  # the heuristic, through `_pick_tiles` (which tests may narrow)
        block_q, block_m, block_n, _, num_warps = _pick_tiles(max(head_dim, head_dim_v), group, max_seqlen_q)
        tiles = (block_q, block_m, block_n, num_warps, PREFILL_NUM_STAGES)
    else:
        tiles = _tiles_of(config, group, max_seqlen_q)
    return PrefillPlan(key, shape, max_seqlen_q, config, tiles)


def flash_prefill(
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
    scales=None,  # kv_quant.KVScales of a quantised (int8 / fp8) cache, or None
    config: triton.Config | None = None,
    plan: PrefillPlan | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim_v]
    """Varlen causal flash attention over the paged KV cache; see `reference.paged_attention`.

    Args:
        query: packed queries of all sequences; `cu_seqlens_q[-1]` must equal `num_tokens` (not
            checked: that needs a device sync; rows past `num_tokens` are dropped, never written).
        key_cache, value_cache: the paged cache, already holding this step's K/V; V's head width
            may differ from K's. The query's dtype, or fp16/bf16 under an fp32 query (upcast on load), or
            one-byte int8 / fp8 payloads with `scales`.
        block_tables: physical block of each logical block; slots past a sequence's length are
            never read, so they may hold anything.
        seq_lens: cache length of each sequence including this step's tokens (`>= q_len`).
        cu_seqlens_q: query offsets; a sequence may have `q_len == 0`.
        max_seqlen_q: only sizes the query tiles (a smaller value than the true maximum is still
            correct, just slower). max_seqlen_k: only checked against the block-table capacity.
        scale: factor on `q . k` before softcap and softmax.
        sliding_window: `w >= 1`; a query at `pos` sees keys `pos - w < p <= pos`.
        chunk_size: `C >= 1` (Llama 4's local attention); a query at `pos` sees keys
            `(pos // C) * C <= p <= pos` (with a window too, both bounds).
        softcap: `c > 0`; scores become `c * tanh(s / c)` before masking.
        sinks: per-query-head logit added to the softmax denominator only.
        scales: a quantised cache's `kv_quant.KVScales` (`.key` / `.value` `[num_blocks, block_size, G, 1]`
            float32, G = num_kv_heads or 1); K/V are dequantised in registers as they are read. The
            "asymmetric" scheme is refused.
        config: a `triton.Config` of `BLOCK_N`, `ROWS`, num_warps and num_stages to launch with instead
            of the recorded, tuned or heuristic one (`tuning.choose_config`); any such config gives the
            same result.
        plan: a `plan_prefill` result for these shapes and this `max_seqlen_q` (a step's layers share
            one): its tiles are launched as they are, nothing is looked up; `config` must then be None.
            Without one, the call plans for itself.

    Returns:
        `[num_tokens, num_q_heads, head_dim_v]` in `query`'s dtype.
    """
    shapes = check_attention_inputs("flash_prefill", query, key_cache, value_cache, block_tables, seq_lens,
                                    cu_seqlens_q, max_seqlen_k, sliding_window, softcap, sinks, scales=scales,
                                    chunk_size=chunk_size)
    num_tokens, num_q_heads, head_dim = shapes.num_tokens, shapes.num_q_heads, shapes.head_dim
    num_seqs, block_size, num_kv_heads = shapes.num_seqs, shapes.block_size, shapes.num_kv_heads
    head_dim_v = shapes.head_dim_v
    is_empty = num_tokens == 0 or num_seqs == 0
    if plan is None and is_empty:
        if config is not None:
            check_config("flash_prefill", config, ("BLOCK_N", "ROWS"))
    elif plan is None:
        plan = plan_prefill(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            head_dim_v=head_dim_v, block_size=block_size, dtype=query.dtype,
                            kv_dtype=key_cache.dtype, max_seqlen_q=max_seqlen_q, device=query.device, config=config)
    elif config is not None:
        raise ValueError("flash_prefill: pass config to plan_prefill, not with a plan")
    elif plan.shape != (num_q_heads, num_kv_heads, head_dim, head_dim_v, block_size) \
            or plan.max_seqlen_q != max_seqlen_q:
        raise ValueError(f"flash_prefill: the plan was made for (num_q_heads, num_kv_heads, head_dim, head_dim_v, "
                         f"block_size) = {plan.shape} and max_seqlen_q={plan.max_seqlen_q}, not these inputs")

    out = query.new_empty(num_tokens, num_q_heads, head_dim_v)
    if is_empty:
        return out.zero_()

    group = num_q_heads // num_kv_heads
    block_d, block_dv = _padded_dim(head_dim), _padded_dim(head_dim_v)
    key_scales, value_scales, scale_strides = kv_scale_args(scales, num_kv_heads, out)

    def run(block_q: int, block_m: int, block_n: int, num_warps: int, num_stages: int) -> None:
        grid = (num_tokens // block_q + num_seqs, num_kv_heads)
        _flash_prefill_kernel[grid](
            out, query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens, cu_seqlens_q,
            sinks if sinks is not None else out,  # dummy pointer, never read
            num_seqs, num_tokens, float(scale), float(softcap) if softcap is not None else 1.0,
            int(sliding_window) if sliding_window is not None else 0,
            int(chunk_size) if chunk_size is not None else 1,
            block_size, head_dim, head_dim_v,
            out.stride(0), out.stride(1),
            query.stride(0), query.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            *scale_strides,
            block_tables.stride(0),
            sinks.stride(0) if sinks is not None else 0,
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
            HAS_WINDOW=sliding_window is not None, HAS_CHUNK=chunk_size is not None, HAS_SOFTCAP=softcap is not None,
            HAS_SINKS=sinks is not None,
            IS_QUANTIZED=scales is not None,
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
            num_warps=num_warps,
            num_stages=num_stages,
        )

    def launch(config: triton.Config) -> None:
        run(*_tiles_of(config, group, max_seqlen_q))

    if plan.is_search_pending:  # an autotune search was pending at planning: run it on these arguments, once
        key = plan.key
        plan.config = choose_config(key, lambda: prefill_configs(key, shared_memory_limit(query.device)), launch,
                                    query.device) or heuristic_config(key)
        plan.tiles, plan.is_search_pending = _tiles_of(plan.config, group, max_seqlen_q), False
    run(*plan.tiles)
    return out
