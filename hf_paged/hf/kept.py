"""Kept sequences: what a finished `retain_kv` request leaves to its caller, held in a `KVOwner` until
a new request takes it (`take`), it is freed (`free`, or `release_later` from any thread), or the pool
runs dry (`evict_kept`); and the K/V transfer calls of disaggregated serving, which move kept
sequences between engines (`kv_transfer`). A mixin of `KVOwner`, which owns the blocks they hold.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from ..core import KVSequence
from . import kv_transfer

logger = logging.getLogger(__name__)


class KeptSequences:
    """`KVOwner`'s kept sequences and K/V transfer (see the module docstring). Needs the owner's
    `manager`, `state_slots`, `fork_sequence` and `_held` (by seq_id) / `_to_release` (a deque)."""

    # ------------------------------------------------------------------ kept sequences
    def keep(self, seq: KVSequence, num_tokens: int) -> bool:
        """Hold `seq` for a caller, shortened to its first `num_tokens` tokens; returns whether it is
        held (a sliding group that released what that needs frees it instead)."""
        extra = seq.num_tokens - num_tokens
        if extra > 0:
            try:
                if self.state_slots is not None:  # a recurrent state cannot drop tokens: recompute instead
                    raise ValueError("a kept sequence with a recurrent state cannot be shortened")
                self.manager.truncate(seq, extra)
            except ValueError:
                self.manager.free(seq)
                return False
        self._held[seq.seq_id] = seq
        return True

    def holds(self, seq: KVSequence) -> bool:
        """Whether `seq` is kept here (not evicted, freed or taken)."""
        return self._held.get(seq.seq_id) is seq

    @property
    def num_kept(self) -> int:
        return len(self._held)

    def take(self, seq: KVSequence) -> bool:
        """Hand a kept sequence over to a request (no longer kept here); False if it is gone."""
        if not self.holds(seq):
            return False
        del self._held[seq.seq_id]
        return True

    def free(self, seqs: Iterable[KVSequence | None]) -> None:
        """Free kept sequences (those no longer held are skipped)."""
        for seq in seqs:
            if seq is not None and self.holds(seq):
                del self._held[seq.seq_id]
                self.manager.free(seq)

    def release_later(self, seqs: Iterable[KVSequence]) -> None:
        """`free` from any thread and any moment (a finaliser): done at the next `apply_releases`."""
        self._to_release.extend(seqs)

    def apply_releases(self) -> None:
        while self._to_release:
            self.free([self._to_release.popleft()])

    def trim(self, seq: KVSequence, num_tokens: int) -> bool:
        """Shorten a kept sequence to its first `num_tokens` tokens; returns whether it is still held."""
        if not self.holds(seq):
            return False
        if seq.num_tokens > num_tokens:
            try:
                if self.state_slots is not None:  # a recurrent state cannot drop tokens: recompute instead
                    raise ValueError("a kept sequence with a recurrent state cannot be shortened")
                self.manager.truncate(seq, seq.num_tokens - num_tokens)
            except ValueError:
                del self._held[seq.seq_id]
                self.manager.free(seq)
                return False
        return True

    def fork(self, seq: KVSequence) -> KVSequence | None:
        """A second kept sequence sharing `seq`'s blocks (copy-on-write), or None if `seq` is not held."""
        if not self.holds(seq):
            return None
        fork = self.fork_sequence(seq)
        self._held[fork.seq_id] = fork
        return fork

    def export(self, seq: KVSequence) -> torch.Tensor:  # [seq.num_tokens * kv_numel_per_token()]
        """The K/V of every token of a kept sequence as one contiguous flat buffer in the pool's dtype:
        per storage slot in slot order, its K ([num_tokens, num_kv_heads, head_dim]) then its V. A
        copy: the blocks may be freed as soon as this returns."""
        if not self.holds(seq):
            raise ValueError("export_kv takes a sequence this engine keeps (kept_kv)")
        return kv_transfer.export_tokens(self, seq)

    def import_tokens(self, token_ids: list[int], kv: torch.Tensor) -> KVSequence:
        """Keep a new sequence holding `token_ids` whose K/V are `kv` (an `export` buffer of another
        engine serving the same model). Blocks already held for a prefix of the tokens (prefix cache)
        are shared instead of written; the full blocks written are published in the prefix cache only
        after their K/V are in place.

        Raises:
            ValueError: `kv` does not hold exactly `len(token_ids)` tokens of this pool's layout, or
                the K/V cannot move (`check_transferable`).
            NoFreeBlocksError: a fixed pool has no room (nothing is changed).
        """
        seq = kv_transfer.import_tokens(self, token_ids, kv)
        self._held[seq.seq_id] = seq
        return seq

    # A tensor-parallel engine moves K/V in parts: rank 0 keeps the books, every rank moves its own heads.
    def token_slots(self, seq: KVSequence) -> list[int]:
        """The pool slot of every token of a kept sequence (rank 0 tells the other ranks where to gather)."""
        if not self.holds(seq):
            raise ValueError("kv_token_slots takes a sequence this engine keeps (kept_kv)")
        return kv_transfer.token_slots(self, seq)

    def gather(self, slots: list[int], heads: kv_transfer.Heads = None) -> torch.Tensor:
        """A transfer buffer of the K/V at `slots`, for this pool's KV heads `heads` ([first, end), or all)."""
        return kv_transfer.gather(self, slots, heads)

    def reserve_import(self, token_ids: list[int]) -> kv_transfer.Reserved:
        """Blocks for `token_ids`, not yet written nor published (`write_transfer`, then `commit_import`, or
        `cancel_import`)."""
        return kv_transfer.reserve(self, token_ids)

    def write_transfer(self, slots: list[int], buffer: torch.Tensor, heads: kv_transfer.Heads = None) -> None:
        """Store a transfer buffer (for heads `heads`) at `slots` (-1: already cached, skipped)."""
        kv_transfer.write(self, slots, buffer, heads)

    def commit_import(self, reserved: kv_transfer.Reserved) -> KVSequence:
        """Publish a reserved import in the prefix cache and keep its sequence (every rank wrote)."""
        seq = kv_transfer.commit(self, reserved)
        self._held[seq.seq_id] = seq
        return seq

    def cancel_import(self, reserved: kv_transfer.Reserved) -> None:
        self.manager.free(reserved.seq)

    def evict_kept(self) -> bool:
        """Free every kept sequence (their owners recompute on use); returns whether any was held."""
        held, self._held = list(self._held.values()), {}
        for seq in held:
            self.manager.free(seq)
        if held:
            logger.info("hf_paged: evicted %d kept sequences (returned caches) to make room", len(held))
        return bool(held)

    # ------------------------------------------------------------------ K/V transfer facts
    def check_transferable(self) -> None:
        """Raise ValueError unless this pool's K/V can be exported and imported token by token (one
        KV group, no quantisation scales, every layer's tensors allocated): what disaggregated
        serving moves between engines."""
        kv_transfer.check_transferable(self)

    def transfer_info(self) -> dict:
        """What a disaggregated peer must agree on before K/V move between two engines, and the pool's
        `free_blocks`: those a new request could take (`num_free_blocks`, cached ones among them, once)."""
        return {"num_blocks": self.num_blocks, "free_blocks": self.num_free_blocks,
                "block_size": self.block_size, "kv_numel_per_token": self.kv_numel_per_token(),
                "kv_dtype": self.stored_dtype,
                "kv_heads": self.slot_owners()[0].keys.shape[2] if self.slot_owners() else None}
