"""Indexed sparse attention over latent rows, the torch path (DeepSeek V3.2's DSA, GLM-5, HY v4, AXK2).

An indexed layer's small indexer scores every cached token of a sequence and keeps each query's top
`index_topk`; attention then reads those tokens only. The pool keeps one row per token and layer
(`hf.layer.LatentLayer`): latent | rotary key | indexer key. Here:

* `write_index_keys` / `read_index_keys`: the indexer keys' columns of the rows, written by slot and
  read by sequence position through a block table;
* `sparse_latent_attention`: absorbed latent attention (`latent`) of each packed query over the rows
  of its selected positions only:

    indices [T, W]  position p of the query's sequence (-1: none)
       |  block_tables[seq(t), p // block_size] * block_size + p % block_size
       v
    rows [num_blocks, block_size, 1, L + R] --gather--> [T, W, L + R] -> softmax(q . k) @ rows[..., :L]

Works on tensors, block tables and slots only; it never sees a request or transformers.
"""

from __future__ import annotations

import torch

from .slots import slots_of

# Elements gathered per chunk of queries ([tokens, W, L + R] in fp32): bounds a long prefill's scratch.
_GATHER_BUDGET = 1 << 24


def _flat(cache: torch.Tensor) -> torch.Tensor:  # [num_slots, ...]
    """`cache` [num_blocks, block_size, ...] viewed by slot (a view, never a copy: writes must land)."""
    return cache.view(-1, *cache.shape[2:])


def write_index_keys(
    index_keys: torch.Tensor,  # [num_blocks, block_size, 1, I], a strided view of the rows
    slot_mapping: torch.Tensor,  # [n] int64, -1 = do not write (the slot already holds it: a prefix-cache hit)
    keys: torch.Tensor,  # [n, I]
) -> None:
    """Write each token's indexer key into its slot, cast to the cache's dtype; skip slot -1."""
    if keys.shape[0] != slot_mapping.shape[0] or keys.shape[-1] != index_keys.shape[-1]:
        raise ValueError(f"write_index_keys: {tuple(keys.shape)} keys for {slot_mapping.shape[0]} slots of a cache "
                         f"{index_keys.shape[-1]} wide")
    keep = slot_mapping >= 0
    slot_mapping, keys = slot_mapping[keep], keys[keep]
    if slot_mapping.numel():
        _flat(index_keys).index_copy_(0, slot_mapping.to(index_keys.device), keys[:, None].to(index_keys.dtype))


def read_index_keys(
    index_keys: torch.Tensor,  # [num_blocks, block_size, 1, I]
    block_tables: torch.Tensor,  # [n, max_blocks] int32, one row per sequence
    seq_lens: torch.Tensor,  # [n] tokens each sequence holds
    num_keys: int,  # T: positions 0 .. T - 1 of every sequence
    dtype: torch.dtype,
) -> torch.Tensor:  # [n, T, I], zeros past each sequence's length
    """The indexer keys of positions `0 .. num_keys - 1` of each sequence, read through its block table."""
    device = index_keys.device
    positions = torch.arange(num_keys, device=device)[None, :]
    seq_lens = seq_lens.to(device).long()[:, None]
    # Past a sequence's end its table may hold nothing: read its last token, then zero it.
    slots = slots_of(block_tables.to(device), positions.minimum(seq_lens - 1).clamp(min=0), index_keys.shape[1])
    keys = _flat(index_keys)[slots][:, :, 0].to(dtype)
    return keys.masked_fill((positions >= seq_lens)[..., None], 0)


def token_sequences(cu_seqlens_q: torch.Tensor, num_tokens: int) -> torch.Tensor:  # [num_tokens] int64
    """The sequence of each packed token (`cu_seqlens_q` [num_seqs + 1])."""
    cu = cu_seqlens_q.long()
    tokens = torch.arange(num_tokens, device=cu.device)
    return torch.searchsorted(cu[1:], tokens, right=True)


def sparse_latent_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, L + R], the absorbed query (`latent.absorb_query`)
    rows: torch.Tensor,  # [num_blocks, block_size, 1, L + R] (a strided view of the rows is fine)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, where each sequence's queries start
    indices: torch.Tensor,  # [num_tokens, W] integer positions in the token's sequence, -1 = none
    scale: float,
    latent_dim: int,  # L: V is rows[..., :L]
    sinks: torch.Tensor | None = None,  # [num_heads] learned sink logits (HY v4), as transformers' eager
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, L]
    """Each query attends to the rows of its `indices` only (fp32 softmax; -1 entries weigh 0).

    Every selected position must be one its sequence holds (the indexer's top-k of the causal keys);
    which ones is the caller's choice, so causality is in `indices`, not here.

    Raises:
        ValueError: shapes that do not fit together, or non-integer indices.
    """
    if query.dim() != 3 or rows.dim() != 4 or rows.shape[2] != 1 or query.shape[-1] != rows.shape[-1]:
        raise ValueError(f"sparse_latent_attention: query {tuple(query.shape)} must be [num_tokens, heads, D] over "
                         f"rows {tuple(rows.shape)} [num_blocks, block_size, 1, D]")
    if indices.dim() != 2 or indices.shape[0] != query.shape[0] or indices.dtype.is_floating_point \
            or indices.dtype == torch.bool:
        raise ValueError(f"sparse_latent_attention: indices must be [num_tokens={query.shape[0]}, W] integer "
                         f"positions, got {tuple(indices.shape)} {indices.dtype}")
    if not 0 < latent_dim <= rows.shape[-1]:
        raise ValueError(f"sparse_latent_attention: latent_dim={latent_dim} must be in 1..{rows.shape[-1]}")
    num_tokens, num_heads, _ = query.shape
    width = indices.shape[1]
    out = query.new_zeros(num_tokens, num_heads, latent_dim)
    if num_tokens == 0 or width == 0:
        return out
    device, block_size = rows.device, rows.shape[1]
    indices = indices.to(device).long()
    seqs = token_sequences(cu_seqlens_q.to(device), num_tokens)
    tables = block_tables.to(device).long()
    flat = _flat(rows)
    sink = None if sinks is None else sinks.to(device).float().view(1, num_heads, 1)
    step = max(1, _GATHER_BUDGET // (width * rows.shape[-1]))
    for start in range(0, num_tokens, step):
        part = slice(start, min(start + step, num_tokens))
        picked = indices[part]  # [t, W]
        valid = picked >= 0
        pos = picked.clamp(min=0)
        slots = tables[seqs[part, None], pos // block_size] * block_size + pos % block_size
        kv = flat[slots][:, :, 0].float()  # [t, W, L + R]
        scores = torch.einsum("thd,twd->thw", query[part].float(), kv) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        if sink is not None:
            probs = torch.softmax(torch.cat([scores, sink.expand(scores.shape[0], -1, 1)], dim=-1), dim=-1)[..., :-1]
        else:
            # A query with no key at all (never one of a sequence's own tokens) gets 0, not NaN.
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[part] = torch.einsum("thw,twl->thl", probs, kv[..., :latent_dim]).to(out.dtype)
    return out
