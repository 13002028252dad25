"""Moving a kept sequence's K/V between two engines serving the same model (disaggregated prefill).

A transfer buffer is flat and contiguous, in the pool's dtype: per storage slot in slot order, the
slot's K (`[num_tokens, num_kv_heads, head_dim]`) then its V. `KVOwner.export` and
`KVOwner.import_tokens` are the public calls; this module holds their bodies.
"""

from __future__ import annotations

import torch

from ..core import KVSequence


def check_transferable(kv) -> None:  # kv: a KVOwner
    """Raise ValueError unless `kv`'s K/V can be exported and imported token by token (one KV group,
    no quantisation scales, every layer's tensors allocated)."""
    if len(kv.layout.groups) != 1:
        raise ValueError("moving K/V between engines needs one KV group: build the engines with "
                         "enable_hybrid_kv=False for this sliding-window model")
    if kv.cache_config.kv_dtype.is_quantized:
        raise ValueError(f"moving K/V between engines does not carry quantisation scales "
                         f"(kv_cache_dtype={kv.cache_config.kv_cache_dtype!r}); use an unquantised cache")
    if len(kv.slot_owners()) != kv.layout.num_slots:
        raise ValueError("moving K/V needs every layer's tensors: run one forward (a warm-up) first")


def export_tokens(kv, seq: KVSequence) -> torch.Tensor:  # [seq.num_tokens * kv.kv_numel_per_token()]
    """A copy of the K/V of every token of `seq` as one transfer buffer."""
    check_transferable(kv)
    index = _token_slots(seq.block_tables[0], seq.num_tokens, kv.block_size)
    parts = []
    for layer in kv.slot_owners():
        for tensor in (layer.keys, layer.values):
            parts.append(tensor.view(-1, *tensor.shape[2:]).index_select(0, index.to(tensor.device)).reshape(-1))
    return torch.cat(parts)


def import_tokens(kv, token_ids: list[int], buffer: torch.Tensor) -> KVSequence:
    """A new sequence holding `token_ids` whose K/V are `buffer` (see `KVOwner.import_tokens`); the
    caller keeps it."""
    check_transferable(kv)
    per_token = kv.kv_numel_per_token()
    if buffer.dim() != 1 or buffer.numel() != len(token_ids) * per_token:
        raise ValueError(f"a K/V buffer of {tuple(buffer.shape)} does not hold {len(token_ids)} tokens of "
                         f"{per_token} elements")
    seq = kv.new_sequence(for_paged_steps=False)
    owners = kv.slot_owners()
    kv.ensure_free_blocks([seq], [token_ids], owners[0].keys.dtype)
    result = kv.manager.append_tokens(seq, token_ids, register=False)
    slots = torch.tensor(result.group_slots[0], dtype=torch.long)
    written = slots >= 0  # -1: a block taken from the prefix cache, already holding these K/V
    try:
        offset, n = 0, len(token_ids)
        for layer in owners:
            for tensor in (layer.keys, layer.values):
                row = tensor[0, 0].numel()
                part = buffer[offset: offset + n * row].view(n, *tensor.shape[2:])
                offset += n * row
                flat = tensor.view(-1, *tensor.shape[2:])
                with torch.inference_mode(tensor.is_inference()):
                    flat[slots[written].to(tensor.device)] = part[written.to(part.device)].to(tensor.device,
                                                                                           tensor.dtype)
    except BaseException:
        kv.manager.free(seq)
        raise
    kv.manager.commit_full_blocks(result.new_full_blocks)
    return seq


def _token_slots(table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:  # [num_tokens] long
    blocks = torch.tensor(table, dtype=torch.long)
    positions = torch.arange(num_tokens)
    return blocks[positions // block_size] * block_size + positions % block_size
