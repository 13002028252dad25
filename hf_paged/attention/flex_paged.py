"""The FlexAttention backend ("flex", `HF_PAGED_BACKEND=flex`): paged attention through PyTorch's
FlexAttention, compiled by Inductor (a C++ kernel on the CPU, a Triton one on CUDA).

The whole pool is one key sequence: the cache `[num_blocks, block_size, Hkv, D]` is viewed, without
a copy, as `[1, Hkv, num_blocks * block_size, D]`, and a `BlockMask` whose KV tiles are the cache's
blocks lists, for every query tile, the physical blocks of its sequence (its block-table row). The
mask function maps a slot back to its position in the sequence (`block_pos`: each block's index in
its sequence's table, the same for every sequence that shares it by prefix caching) and applies
causality, the sliding window and the local chunk (keys from `(pos // C) * C` on) there. Blocks a
query sees whole skip the mask function (the "full" tiles). GQA runs without repeating K/V
(`enable_gqa`), softcapping is a score modifier, and a sink rescales the output by its share of the
denominator (from the returned log-sum-exp).

Two kinds of call per step and KV group, each one compiled kernel per shape bucket:

* the short runs (decode, speculative verify) together: queries `[1, Hq, T, D]`, one query per tile,
  each tile listing its own sequence's blocks; T is padded to a power of two;
* each long run (a prefill chunk over its cached prefix) alone: queries `[1, Hq, Q, D]` in tiles of
  `PREFILL_TILE`, Q padded to a power of two (at least one tile).

Shapes are static per bucket (the CPU template does not compile dynamic shapes in this torch), so a
server compiles each bucket once, the first time a step of that shape comes, and never per step;
`compile_seconds` records the first call of every bucket (compile included), and the first
compile is logged. What it takes is declared in `backend.py` (its `Capabilities`): quantised
caches, K/V of another dtype than the query, strided (byte-page) caches (the pool is viewed as one
key sequence), calls autograd would differentiate, and sinks on the CPU (Inductor's CPU template
returns no log-sum-exp) run on the torch path (`torch_paged`) instead.

Owns the flex plans and kernels; it knows no request, cache or transformers object.
"""

from __future__ import annotations

import logging
import time

import torch

from ..config import MAX_DECODE_QUERY_LEN

logger = logging.getLogger(__name__)

PREFILL_TILE = 64  # query rows per tile of a long run
# Distinct compiled shapes kept by torch.compile for the one flex function: every bucket of a server
# (powers of two of T and Q, per feature set and pool size) fits.
RECOMPILE_LIMIT = 64

compile_seconds: dict[tuple, float] = {}  # bucket -> seconds of its first call (compile included)
_warned: list[bool] = []  # the compile limit was reached (said once)
_compiled = None


def _kernel():
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _Call:
    """One flex launch: a block mask over the pool and the query rows it covers."""

    def __init__(self, rows: list[tuple[int, int, int]], q_tile: int, padded: int, block_tables: list[list[int]],
                 seq_lens: list[int], block_size: int, num_blocks: int, device: torch.device):
        # rows: (query token index in the packed query, its sequence, its position), in tile order
        self.token_index = torch.tensor([t for t, _, _ in rows], device=device)  # [T]
        self.num_rows = len(rows)
        self.padded = padded
        self.q_tile = q_tile
        tiles = padded // q_tile
        q_pos = torch.full((padded,), -1, dtype=torch.int64)
        q_pos[:len(rows)] = torch.tensor([p for _, _, p in rows], dtype=torch.int64)
        self.q_pos = q_pos.to(device)  # [padded], -1 on padding rows (they see nothing)
        # per tile: its sequence's blocks up to the tile's last query, split into partial and full
        self._tiles = []
        for tile in range(tiles):
            members = rows[tile * q_tile:(tile + 1) * q_tile]
            if not members:
                self._tiles.append((None, 0, 0))
                continue
            seq = members[0][1]
            first, last = min(p for _, _, p in members), max(p for _, _, p in members)
            self._tiles.append((seq, first, last))
        self.block_tables, self.block_size = block_tables, block_size
        self.num_blocks, self.device = num_blocks, device
        self._masks: dict[tuple[int | None, int | None], object] = {}

    def mask(self, sliding_window: int | None, block_pos: torch.Tensor, chunk_size: int | None = None):
        """The `BlockMask` of this call under `sliding_window` and `chunk_size`, memoised (every layer
        of the kind shares it)."""
        kind = (sliding_window, chunk_size)
        if kind in self._masks:
            return self._masks[kind]
        from torch.nn.attention.flex_attention import BlockMask

        size = self.block_size
        tiles = len(self._tiles)
        partial = torch.zeros(1, 1, tiles, self.num_blocks, dtype=torch.int32)
        full = torch.zeros(1, 1, tiles, self.num_blocks, dtype=torch.int32)
        num_partial = torch.zeros(1, 1, tiles, dtype=torch.int32)
        num_full = torch.zeros(1, 1, tiles, dtype=torch.int32)
        for tile, (seq, first, last) in enumerate(self._tiles):
            if seq is None:
                continue
            lo = 0 if sliding_window is None else max(0, first - sliding_window + 1)
            if chunk_size is not None:
                lo = max(lo, first // chunk_size * chunk_size)
            # every query of the tile sees keys from `common` on (up to `first`)
            common = 0 if sliding_window is None else last - sliding_window + 1
            if chunk_size is not None:
                common = max(common, last // chunk_size * chunk_size)
            whole, part = [], []
            table = self.block_tables[seq]
            for b in range(lo // size, last // size + 1):
                start, end = b * size, b * size + size - 1
                # seen whole by every query of the tile: inside [common, first]
                seen_whole = end <= first and start >= common
                (whole if seen_whole else part).append(table[b])
            num_partial[0, 0, tile], num_full[0, 0, tile] = len(part), len(whole)
            partial[0, 0, tile, :len(part)] = torch.tensor(part, dtype=torch.int32)
            full[0, 0, tile, :len(whole)] = torch.tensor(whole, dtype=torch.int32)
        q_pos = self.q_pos

        def mask_mod(b, h, q_idx, kv_idx):
            pos = block_pos[kv_idx // size] * size + kv_idx % size
            qp = q_pos[q_idx]
            seen = pos <= qp
            if sliding_window is not None:
                seen = seen & (pos > qp - sliding_window)
            if chunk_size is not None:
                seen = seen & (pos >= torch.div(qp, chunk_size, rounding_mode="floor") * chunk_size)
            return seen

        mask = BlockMask.from_kv_blocks(
            num_partial.to(self.device), partial.to(self.device), num_full.to(self.device), full.to(self.device),
            BLOCK_SIZE=(self.q_tile, size), mask_mod=mask_mod, seq_lengths=(self.padded, self.num_blocks * size),
            compute_q_blocks=False)
        self._masks[kind] = mask
        return mask


class FlexPlan:
    """What every layer of a step's KV group shares: the calls (short runs together, each long run
    alone), their query rows and masks, and the block -> position table."""

    def __init__(
        self,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32
        cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
        block_size: int,
        num_blocks: int,  # the pool's
    ):
        device = block_tables.device
        cu = cu_seqlens_q.tolist()
        lens = seq_lens.tolist()
        q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        self.num_tokens = cu[-1] if lens else 0
        tables = block_tables.tolist()
        block_pos = torch.zeros(num_blocks, dtype=torch.int64)
        for s, n in enumerate(lens):
            used = -(-n // block_size)
            if used and q_lens[s] > 0:
                block_pos[torch.tensor(tables[s][:used], dtype=torch.int64)] = torch.arange(used)
        self.block_pos = block_pos.to(device)  # [num_blocks]

        def rows_of(s):
            return [(cu[s] + i, s, lens[s] - q_lens[s] + i) for i in range(q_lens[s])]

        short = [r for s, n in enumerate(q_lens) if 0 < n <= MAX_DECODE_QUERY_LEN for r in rows_of(s)]
        self.calls: list[_Call] = []
        if short:
            self.calls.append(_Call(short, 1, _pow2(len(short)), tables, lens, block_size, num_blocks, device))
        for s, n in enumerate(q_lens):
            if n > MAX_DECODE_QUERY_LEN:
                padded = max(PREFILL_TILE, _pow2(n))
                self.calls.append(_Call(rows_of(s), PREFILL_TILE, padded, tables, lens, block_size, num_blocks, device))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], packed by cu_seqlens_q
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    plan: FlexPlan,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads]
    chunk_size: int | None = None,
) -> torch.Tensor | None:  # [num_tokens, num_q_heads, head_dim_v]
    """`torch_paged.paged_attention`'s contract over `plan`'s calls (see the module docstring); None
    when a call's shape is past the compile limit (`RECOMPILE_LIMIT` shapes): the caller runs the
    torch path instead."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    head_dim_v = value_cache.shape[3]
    keys = key_cache.view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)  # [1, Hkv, N, D]
    values = value_cache.view(1, num_blocks * block_size, num_kv_heads, head_dim_v).transpose(1, 2)
    out = query.new_zeros(num_tokens, num_q_heads, head_dim_v)
    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)
    kernel = _kernel()
    for call in plan.calls:
        q = query.new_zeros(call.padded, num_q_heads, head_dim)
        q[:call.num_rows] = query[call.token_index]
        q = q.transpose(0, 1)[None]  # [1, Hq, padded, D]
        mask = call.mask(sliding_window, plan.block_pos, chunk_size)
        bucket = (call.padded, call.q_tile, num_blocks, block_size, num_q_heads, num_kv_heads, head_dim, head_dim_v,
                  query.dtype, query.device.type, sliding_window is not None, chunk_size is not None,
                  softcap is not None)
        first = bucket not in compile_seconds
        start = time.perf_counter()
        # Past the limit torch.compile would run flex eagerly, which reads this block mask wrongly
        # (measured: garbage slots attended); it must fail instead, and the torch path run the call.
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
                result = kernel(q, keys, values, score_mod=score_mod, block_mask=mask, scale=scale,
                                enable_gqa=num_q_heads != num_kv_heads, return_lse=sinks is not None)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            if not _warned:
                _warned.append(True)
                logger.warning("hf_paged flex: %d shapes compiled, the most it keeps; calls of new shapes run on "
                               "the torch path", RECOMPILE_LIMIT)
            return None
        o, lse = result if sinks is not None else (result, None)
        if first:
            compile_seconds[bucket] = time.perf_counter() - start
            logger.info("hf_paged flex: compiled a kernel for %d query rows (tile %d) over %d blocks in %.1f s",
                        call.padded, call.q_tile, num_blocks, compile_seconds[bucket])
        o = o[0, :, :call.num_rows].transpose(0, 1)  # [T, Hq, Dv]
        if sinks is not None:  # a sink's share of the denominator: out * sum / (sum + e^sink)
            lse = lse[0, :, :call.num_rows].transpose(0, 1)  # [T, Hq]
            o = o * torch.sigmoid(lse - sinks.to(lse.dtype)[None, :])[..., None].to(o.dtype)
        out[call.token_index] = o
    return out
