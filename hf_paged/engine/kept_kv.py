"""`KeptKVAPI`: the engine's calls on K/V kept between requests (`retain_kv`): collect, free, trim,
fork, and move between engines (disaggregated prefill exports, the decode engine imports). A base of
`Engine`; the blocks themselves are the KV owner's (`hf.KVOwner`), and every call here runs between
steps, under the engine's lock.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

import torch

from ..core import KVSequence


class KeptKVAPI:
    """The kept-KV part of `Engine`'s public API."""

    def kept_kv(self, request_id: str) -> list[KVSequence | None]:
        """The sequences a finished `retain_kv` request left (one per sample, None where nothing was
        kept), now owned by the caller: hand one to a new request (`kv_prefix`), or `free_kv` it."""
        with self._lock:
            return self.core.collect_kept(request_id)

    def drop_unclaimed_kv(self) -> None:
        """Free what was kept for requests whose caller never collected it (`kept_kv`), and what
        `release_kv_later` queued. Only between calls: a caller still running may collect later."""
        with self._lock:
            self._apply_inbox()
            self.kv.free(self.core.drop_finished_groups())

    def holds(self, seq: KVSequence) -> bool:
        """Whether `seq` is a kept sequence of this engine (not evicted, freed or handed on)."""
        return self.kv.holds(seq)

    def free_kv(self, seqs) -> None:
        """Free kept sequences (those no longer held are skipped)."""
        with self._lock:
            self.kv.free(seqs)

    def release_kv_later(self, seqs) -> None:
        """`free_kv` from anywhere (a finaliser, another thread, inside a step): done before the next
        step or command. Takes no lock."""
        self.kv.release_later(seqs)

    def trim_kv(self, seq: KVSequence, num_tokens: int) -> bool:
        """Shorten a kept sequence to its first `num_tokens` tokens; returns whether it is still held
        (a sliding or chunked group that released what is needed frees it instead)."""
        with self._lock:
            return self.kv.trim(seq, num_tokens)

    def fork_kv(self, seq: KVSequence) -> KVSequence | None:
        """A second kept sequence sharing `seq`'s blocks (copy-on-write), or None if `seq` is not held."""
        with self._lock:
            return self.kv.fork(seq)

    def export_kv(self, seq: KVSequence) -> torch.Tensor:  # [seq.num_tokens * kv_numel_per_token]
        """The K/V of every token of a kept sequence, as one contiguous buffer (a copy: free `seq` when
        done). Disaggregated serving sends it to the engine that decodes (`import_kv`)."""
        with self._lock:
            return self.kv.export(seq)

    def import_kv(self, token_ids: SequenceABC[int], kv: torch.Tensor) -> KVSequence:
        """Store the K/V another engine serving the same model computed for `token_ids` (its `export_kv`
        buffer) in this engine's blocks, registering their prefix hashes, and keep the sequence: hand it
        to a request as `kv_prefix` (with `resume_tokens` for what that engine already generated), or
        `free_kv` it. Between steps only (the caller's thread steps this engine).

        Raises:
            ValueError: a buffer of the wrong size, or a cache that cannot move K/V; NoFreeBlocksError: a
                fixed pool without room. Nothing is stored then.
        """
        with self._lock:
            self._check_open()
            self.core.note_weights()  # salted with the current weights epoch, as a request admitted now would be
            return self.kv.import_tokens(list(token_ids), kv)

    # The same in parts, for a tensor-parallel engine: rank 0 keeps the books (`kv_token_slots`,
    # `reserve_kv_import`, `commit_kv_import`), every rank moves its own KV heads (`gather_kv`, `write_kv`).
    def kv_token_slots(self, seq: KVSequence) -> list[int]:
        """The pool slot of every token of a kept sequence."""
        with self._lock:
            return self.kv.token_slots(seq)

    def gather_kv(self, slots: list[int], heads: tuple[int, int] | None = None) -> torch.Tensor:
        """A transfer buffer of this rank's K/V at `slots`, for its local KV heads `heads` ([first, end))."""
        return self.kv.gather(slots, heads)

    def reserve_kv_import(self, token_ids: SequenceABC[int]):
        """Blocks for an import, written by every rank (`write_kv`) before `commit_kv_import`.

        Raises:
            NoFreeBlocksError: a fixed pool without room; ValueError: a cache that cannot move K/V.
        """
        with self._lock:
            self._check_open()
            self.core.note_weights()
            return self.kv.reserve_import(list(token_ids))

    def write_kv(self, slots: list[int], kv: torch.Tensor, heads: tuple[int, int] | None = None,
                 num_blocks: int | None = None) -> None:
        """Store a transfer buffer of this rank's KV heads `heads` at `slots` (-1: already cached); a
        rank other than 0 first grows its pool to rank 0's `num_blocks` (the reservation may have grown it)."""
        if num_blocks is not None and self.kv.num_blocks < num_blocks:
            self.kv.grow_to(num_blocks)
        self.kv.write_transfer(slots, kv, heads)

    def commit_kv_import(self, reserved) -> KVSequence:
        """Publish a reserved import's blocks and keep its sequence (as `import_kv` returns it)."""
        with self._lock:
            return self.kv.commit_import(reserved)

    def cancel_kv_import(self, reserved) -> None:
        with self._lock:
            self.kv.cancel_import(reserved)

    def check_kv_transferable(self) -> None:
        """Raise ValueError unless this engine's K/V can move to another engine token by token
        (`export_kv` / `import_kv`: one KV group, unquantised, every layer's tensors allocated)."""
        self.kv.check_transferable()

    def kv_transfer_info(self) -> dict:
        """What a disaggregated worker reports of its KV pool: `num_blocks`, `free_blocks` (free or
        only cached, so reusable), `block_size`, `kv_numel_per_token` (`export_kv`'s buffer per token)
        and `kv_dtype` (the torch dtype K/V are stored and moved in). Needs one forward first."""
        return self.kv.transfer_info()
