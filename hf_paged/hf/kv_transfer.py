"""Moving a kept sequence's K/V between two engines serving the same model (disaggregated prefill).

A transfer buffer is flat and contiguous, in the pool's dtype: per storage slot in slot order, the
slot's K (`[num_tokens, num_heads, head_dim]`) then its V, for the pool's KV heads or a range of them
(`heads`, local indices: a tensor-parallel rank holds only its share, and moves each of its heads to
the rank of the other engine that holds it). `KVOwner.export` and `KVOwner.import_tokens` are the
public calls for whole buffers; a tensor-parallel engine splits them: rank 0 does the bookkeeping
(`token_slots`, `reserve`, `commit`) and every rank moves its own heads (`gather`, `write`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import KVSequence

Heads = tuple[int, int] | None  # [first, end) of the pool's (local) KV heads; None: all of them


@dataclass
class Reserved:
    """Blocks taken for an import whose K/V are not written yet (`reserve`): `slots` per token (-1
    where a prefix-cached block already holds it), the full blocks to publish once every rank wrote."""

    seq: KVSequence
    slots: list[int]
    new_full_blocks: list


def check_transferable_layout(kv) -> None:  # kv: a KVOwner
    """Raise ValueError when `kv`'s layers differ in K/V shape (its storage slots are byte pages, not
    one shape per slot, so no per-token transfer buffer describes them) or carry a per-sequence state
    (a recurrent layer's, which no per-token buffer holds)."""
    if kv.states is not None:
        raise ValueError("moving K/V between engines does not carry the per-sequence state of recurrent layers yet "
                         f"(model_type={kv.model_config.model_type!r} has {len(kv.state_layers)} Mamba / linear-"
                         "attention layers): serve this model from one engine")
    if kv.has_latent_kv and kv.cache_config.tensor_parallel_size > 1:
        raise ValueError("moving K/V between engines is not supported yet for a tensor-parallel engine of a latent-"
                         "attention model (every rank holds the whole latent row, where the transfer splits K/V by "
                         "head over the ranks): serve it disaggregated with tensor_parallel_size=1 workers")
    if not kv.layout.uniform_shape:
        raise ValueError("moving K/V between engines is not supported yet for a model whose layers differ in K/V "
                         "shape (KV heads or head size, as Gemma 4's full and sliding layers do)")


def check_transferable(kv) -> None:  # kv: a KVOwner
    """Raise ValueError unless `kv`'s K/V can be exported and imported token by token (one KV group,
    one K/V shape for every layer, no quantisation scales, every layer's tensors allocated)."""
    check_transferable_layout(kv)
    if len(kv.layout.groups) != 1:
        raise ValueError("moving K/V between engines needs one KV group: build the engines with "
                         "enable_hybrid_kv=False for this sliding-window or chunked-attention model")
    if kv.cache_config.kv_dtype.is_quantized:
        raise ValueError(f"moving K/V between engines does not carry quantisation scales "
                         f"(kv_cache_dtype={kv.cache_config.kv_cache_dtype!r}); use an unquantised cache")
    if len(kv.slot_owners()) != kv.layout.num_slots:
        raise ValueError("moving K/V needs every layer's tensors: run one forward (a warm-up) first")


def token_slots(kv, seq: KVSequence) -> list[int]:
    """The pool slot of every token of `seq`, in order (rank 0's bookkeeping; every rank gathers there)."""
    return _token_slots(seq.block_tables[0], seq.num_tokens, kv.block_size).tolist()


def numel(kv, num_tokens: int, heads: Heads = None) -> int:
    """Elements of a transfer buffer of `num_tokens` tokens (for `heads` only)."""
    per_token = 0
    for layer in kv.slot_owners():
        for tensor in layer.payload():
            lo, hi = _range(heads, tensor)
            per_token += (hi - lo) * tensor.shape[-1]
    return num_tokens * per_token


def gather(kv, slots: list[int], heads: Heads = None) -> torch.Tensor:  # [numel(kv, len(slots), heads)]
    """A copy of the K/V at `slots` (for `heads`) as one transfer buffer."""
    check_transferable(kv)
    parts = []
    for layer in kv.slot_owners():
        index = torch.tensor(slots, dtype=torch.long, device=layer.keys.device)
        for tensor in layer.payload():
            lo, hi = _range(heads, tensor)
            flat = tensor.view(-1, *tensor.shape[2:])  # [num_blocks * block_size, num_heads, head_dim]
            parts.append(flat.index_select(0, index)[:, lo:hi].reshape(-1))
    return torch.cat(parts)


def export_tokens(kv, seq: KVSequence) -> torch.Tensor:  # [seq.num_tokens * kv.kv_numel_per_token()]
    """A copy of the K/V of every token of `seq` as one transfer buffer."""
    check_transferable(kv)
    return gather(kv, token_slots(kv, seq))


def reserve(kv, token_ids: list[int]) -> Reserved:
    """Take blocks for a new sequence holding `token_ids` (shared where the prefix cache holds them);
    nothing is published in the prefix cache until `commit`. Undo with `kv.manager.free(reserved.seq)`."""
    check_transferable(kv)
    seq = kv.new_sequence(for_paged_steps=False)
    kv.ensure_free_blocks([seq], [token_ids], kv.slot_owners()[0].keys.dtype)
    result = kv.manager.append_tokens(seq, token_ids, register=False)
    return Reserved(seq, list(result.group_slots[0]), result.new_full_blocks)


def write(kv, slots: list[int], buffer: torch.Tensor, heads: Heads = None) -> None:
    """Store a transfer buffer's K/V (for `heads`) at `slots`, skipping the -1 ones (already cached).

    Raises:
        ValueError: `buffer` does not hold exactly `len(slots)` tokens of this layout.
    """
    n = len(slots)
    expected = numel(kv, n, heads)
    if buffer.dim() != 1 or buffer.numel() != expected:
        raise ValueError(f"a K/V buffer of {tuple(buffer.shape)} does not hold {n} tokens ({expected} elements)")
    index = torch.tensor(slots, dtype=torch.long)
    written = index >= 0
    offset = 0
    for layer in kv.slot_owners():
        for tensor in layer.payload():
            lo, hi = _range(heads, tensor)
            size = n * (hi - lo) * tensor.shape[-1]
            part = buffer[offset: offset + size].view(n, hi - lo, tensor.shape[-1])
            offset += size
            flat = tensor.view(-1, *tensor.shape[2:])
            with torch.inference_mode(tensor.is_inference()):
                flat[index[written].to(tensor.device), lo:hi] = part[written.to(part.device)].to(tensor.device,
                                                                                                tensor.dtype)


def commit(kv, reserved: Reserved) -> KVSequence:
    """Publish the reserved sequence's full blocks in the prefix cache (every rank wrote its K/V)."""
    kv.manager.commit_full_blocks(reserved.new_full_blocks)
    return reserved.seq


def import_tokens(kv, token_ids: list[int], buffer: torch.Tensor) -> KVSequence:
    """A new sequence holding `token_ids` whose K/V are `buffer` (see `KVOwner.import_tokens`); the
    caller keeps it."""
    check_transferable(kv)
    per_token = kv.kv_numel_per_token()
    if buffer.dim() != 1 or buffer.numel() != len(token_ids) * per_token:
        raise ValueError(f"a K/V buffer of {tuple(buffer.shape)} does not hold {len(token_ids)} tokens of "
                         f"{per_token} elements")
    reserved = reserve(kv, token_ids)
    try:
        write(kv, reserved.slots, buffer)
    except BaseException:
        kv.manager.free(reserved.seq)
        raise
    return commit(kv, reserved)


def _range(heads: Heads, tensor: torch.Tensor) -> tuple[int, int]:
    num_heads = tensor.shape[2]
    if heads is None:
        return 0, num_heads
    lo, hi = heads
    if not 0 <= lo < hi <= num_heads:
        raise ValueError(f"K/V heads [{lo}, {hi}) are not within this pool's {num_heads}")
    return lo, hi


def _token_slots(table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:  # [num_tokens] long
    blocks = torch.tensor(table, dtype=torch.long)
    positions = torch.arange(num_tokens)
    return blocks[positions // block_size] * block_size + positions % block_size
