"""The test oracle for every attention backend: deliberately naive, obviously right.

One sequence at a time, one token at a time where it matters: K/V are read position by position
through the block table, GQA is `repeat_interleave`, the mask is written out per position, and the
softmax runs in float64. Nothing here is optimised or shared with a backend (`torch_paged.py`, the
Triton kernels), so a bug in a backend cannot hide in its own oracle. Used by tests only; the
serving paths must never import it.
"""

from __future__ import annotations

import torch


def store_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    """The `store_kv` contract (shapes in `torch_paged.store_kv`), one token at a time: token `t` goes
    to block `slot // block_size`, offset `slot % block_size`; slot -1 is skipped."""
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t]
        value_cache[slot // block_size, slot % block_size] = value[t]


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    max_seqlen_k: int,
) -> torch.Tensor:  # [num_seqs, max_seqlen_k, num_kv_heads, head_dim]
    """Positions 0..max_seqlen_k-1 of every sequence: its blocks, in table order, laid end to end.
    Positions past a sequence's length come from whatever block the (padded) table names."""
    block_size = cache.shape[1]
    num_table_blocks = -(-max_seqlen_k // block_size)
    rows = []
    for table in block_tables.tolist():
        blocks = [cache[block_id] for block_id in table[:num_table_blocks]]
        row = torch.cat(blocks) if blocks else cache.new_zeros(0, *cache.shape[2:])
        rows.append(row[:max_seqlen_k])
    return torch.stack(rows) if rows else cache.new_zeros(0, max_seqlen_k, *cache.shape[2:])


def causal_attention(
    query: torch.Tensor,  # [q_len, num_q_heads, head_dim], the sequence's last q_len positions
    keys: torch.Tensor,  # [seq_len, num_kv_heads, head_dim], positions 0..seq_len-1
    values: torch.Tensor,  # [seq_len, num_kv_heads, head_dim_v]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads] learned per-head sink logits
    key_limits: torch.Tensor | None = None,  # [q_len] the last key position each query sees (None: its own)
    chunk_size: int | None = None,
) -> torch.Tensor:  # [q_len, num_q_heads, head_dim_v] float64
    """Dense causal attention of one sequence, in float64 (with `key_limits`, query i sees keys up to
    `key_limits[i]` instead of its own position: an image block attended both ways).

    Query `i` sits at position `seq_len - q_len + i` and sees key positions `p <= pos`; with a
    sliding window `w` only `p > pos - w` (the transformers convention); with a chunk `C` (Llama 4's
    local attention) only keys of its own chunk, `p >= (pos // C) * C`. Softcapping applies to the
    scaled scores before masking; a sink adds one logit per head to the softmax denominator that
    attends to nothing.
    """
    q_len, num_q_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    if q_len == 0:  # no new tokens: nothing to attend (and seq_len may be 0 too)
        return query.new_zeros(0, num_q_heads, values.shape[-1], dtype=torch.float64)
    group = num_q_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)  # q head h reads kv head h // group
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = (seq_len - q_len + torch.arange(q_len, device=query.device))[:, None]  # query i's position in the sequence
    p = torch.arange(seq_len, device=query.device)[None, :]  # key positions
    allowed = p <= (pos if key_limits is None else key_limits.to(query.device)[:, None])
    if sliding_window is not None:
        allowed &= p > pos - sliding_window
    if chunk_size is not None:
        chunk_of = torch.tensor([[i // chunk_size for i in range(seq_len)]], device=query.device)  # per key
        allowed &= chunk_of == chunk_of[0, pos]  # the query's own chunk: no key of an earlier one
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)  # [H, q, 1]
    if sinks is not None:
        sink = sinks.double().view(-1, 1, 1)
        row_max = torch.maximum(row_max, sink)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)  # the sink's share of the mass goes nowhere
    return torch.einsum("hqk,khd->qhd", weights / denom, v)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
                    max_seqlen_k, scale, sliding_window=None, softcap=None, sinks=None,
                    chunk_size=None) -> torch.Tensor:
    """The kernels' contract (arguments and shapes as in `torch_paged.paged_attention`), one
    sequence at a time: gather its `seq_len` K/V rows through its block table, then
    `causal_attention` in float64; the result is cast to the query's dtype and has the value
    cache's head width (which may differ from the key's)."""
    del max_seqlen_q, max_seqlen_k  # bounds for the kernels' grids; the oracle reads exact lengths
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    out = query.new_zeros(query.shape[0], query.shape[1], value_cache.shape[-1])
    for b, seq_len in enumerate(lens):
        if cu[b + 1] == cu[b]:
            continue
        keys = gather_kv(key_cache, block_tables[b : b + 1], seq_len)[0]
        values = gather_kv(value_cache, block_tables[b : b + 1], seq_len)[0]
        out[cu[b] : cu[b + 1]] = causal_attention(query[cu[b] : cu[b + 1]], keys, values, scale,
                                                  sliding_window, softcap, sinks,
                                                  chunk_size=chunk_size).to(query.dtype)
    return out
