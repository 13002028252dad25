"""Torch reference implementations of the paged-attention kernels.

These are the CPU path of the "hf_paged" attention and the oracle for the Triton kernels. They are
vectorised over sequences and tokens (no Python loop over either), and they gather K/V through the
block table exactly as the kernels read it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = do not write
) -> None:
    """Write each token's K/V row into its slot (`block_id * block_size + offset`); skip slot -1."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if slot_mapping.numel() == 0:
        return
    num_kv_heads, head_dim = key_cache.shape[2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def slots_of(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    positions: torch.Tensor,  # [n] shared by every sequence, or [num_seqs, n]
    block_size: int,
) -> torch.Tensor:  # [num_seqs, n] int64
    """Physical slot (`block_id * block_size + offset`) of each token position, via the block table."""
    if positions.dim() == 1:
        positions = positions.expand(block_tables.shape[0], -1)
    blocks = block_tables.long().gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    max_seqlen_k: int,
) -> torch.Tensor:  # [num_seqs, max_seqlen_k, num_kv_heads, head_dim]
    """Read positions 0..max_seqlen_k-1 of every sequence through its block table. Positions past a
    sequence's length come from whatever block the (padded) table names; callers mask them."""
    pos = torch.arange(max_seqlen_k, device=cache.device)
    return cache.flatten(0, 1)[slots_of(block_tables, pos, cache.shape[1])]


class AttentionPlan:
    """Index and mask tensors that depend only on the step's metadata, not on the layer: built once
    per forward and shared by every layer (the masks are memoised per sliding window)."""

    def __init__(
        self,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32
        cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
        max_seqlen_q: int,
        max_seqlen_k: int,
        block_size: int,
    ):
        device = seq_lens.device
        num_seqs = seq_lens.shape[0]
        self.max_seqlen_q, self.max_seqlen_k = max_seqlen_q, max_seqlen_k
        self.num_tokens = int(cu_seqlens_q[-1]) if num_seqs else 0
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        self.seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens)  # [T]
        self.q_idx = torch.arange(self.num_tokens, device=device) - cu_seqlens_q[:-1].long()[self.seq_ids]  # [T]
        pos = torch.arange(max_seqlen_k, device=device)
        self.slots = slots_of(block_tables, pos, block_size)  # [S, Kmax]
        self.q_pos = (seq_lens.long() - q_lens)[:, None] + torch.arange(max_seqlen_q, device=device)  # [S, Qmax]
        self.k_pos = pos
        self.is_pad_row = torch.arange(max_seqlen_q, device=device)[None, :] >= q_lens[:, None]  # [S, Qmax]
        # Every row has max_seqlen_k keys and single-token queries: no mask at all is needed.
        self.is_uniform_decode = bool(max_seqlen_q == 1 and (q_lens == 1).all() and (seq_lens == max_seqlen_k).all())
        self._masks: dict[int | None, torch.Tensor] = {}

    def mask(self, sliding_window: int | None) -> torch.Tensor:  # [S, Qmax, Kmax] bool, True = attend
        if sliding_window not in self._masks:
            k_pos, q_pos = self.k_pos[None, None, :], self.q_pos[:, :, None]
            allowed = k_pos <= q_pos
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            # Query rows past a sequence's q_len are padding: let them see key 0 so no row is all -inf.
            allowed[..., 0] |= self.is_pad_row
            self._masks[sliding_window] = allowed
        return self._masks[sliding_window]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], packed by cu_seqlens_q
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this step's
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads] learned per-head sink logits
    plan: AttentionPlan | None = None,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    """Causal attention of each sequence's new queries over its cached prefix plus themselves.

    Query `i` of sequence `b` sits at position `seq_lens[b] - q_len[b] + i`. It sees key positions
    `p <= pos` and, with a sliding window `w`, only `p > pos - w` (the transformers convention).
    Softcapping (`softcap * tanh(s / softcap)`) is applied to the scaled scores before masking, and
    a sink adds one extra logit per head to the softmax denominator that attends to nothing.
    `plan` (from `AttentionPlan` on the same metadata) skips rebuilding the per-step indices.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    num_kv_heads = key_cache.shape[2]
    out = query.new_zeros(num_tokens, num_q_heads, value_cache.shape[-1])
    if num_tokens == 0 or max_seqlen_k == 0:
        return out
    if plan is None:
        plan = AttentionPlan(block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, key_cache.shape[1])

    q_pad = query.new_zeros(num_seqs, max_seqlen_q, num_q_heads, head_dim)
    q_pad[plan.seq_ids, plan.q_idx] = query
    k = key_cache.flatten(0, 1)[plan.slots].to(query.dtype).transpose(1, 2)  # [S, Hkv, Kmax, D]
    v = value_cache.flatten(0, 1)[plan.slots].to(query.dtype).transpose(1, 2)
    q = q_pad.transpose(1, 2)  # [S, Hq, Qmax, D]
    needs_mask = sliding_window is not None or not plan.is_uniform_decode
    if softcap is None and sinks is None:
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=plan.mask(sliding_window)[:, None] if needs_mask else None, scale=scale,
            enable_gqa=num_q_heads != num_kv_heads,
        )
    else:
        o = _attention_math(q, k, v, plan.mask(sliding_window), scale, softcap, sinks)
    return o.transpose(1, 2)[plan.seq_ids, plan.q_idx]


def _attention_math(q, k, v, allowed, scale, softcap, sinks):
    """Explicit softmax attention in fp32, for the features SDPA lacks (softcap, sinks)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)
