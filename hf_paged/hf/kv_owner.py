"""`KVOwner`: the one owner of a `PagedCache`'s blocks for steps planned outside the cache (the
engine's, and a draft model's), and of the sequences kept between requests.

Every change to the blocks of a planned step goes through one transaction:

    kv.begin(step)              copy-on-write copies, the step's metadata handed to attention
    ... the forward writes K/V ...
    kv.commit(new_full_blocks)  the blocks the step filled are published in the prefix cache
    kv.abort()                  or: nothing the step staged is ever found; its requests recompute

so a step either commits or leaves no trace. The runner calls `begin`/`commit`/`abort` around the
forward; the engine calls `abort` when it undoes a step after scheduling; nothing else touches the
pool, the block manager or the cache's step state.

Kept sequences (`keep` ... `evict_kept`) are what a finished `retain_kv` request leaves to its
caller: `ReturnedCache`, disaggregated prefill (`export`/`import_tokens`) and `kv_prefix` hand-overs
use them. A kept sequence is held here until it is taken by a new request (`take`), freed (`free`,
or `release_later` from any thread), or evicted when the pool runs dry.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence

import torch

from ..attention.metadata import StepMetadata
from ..core import KVSequence
from .cache import PagedCache

logger = logging.getLogger(__name__)


class KVOwner:
    """The block-level API of one `PagedCache`: the step transaction, sequences, kept sequences,
    K/V transfer and pool facts. `cache` is the transformers adapter the model's layers write into."""

    def __init__(self, cache: PagedCache):
        self.cache = cache
        # Kept sequences by seq_id, and those `release_later` queued (from any thread, no lock).
        self._held: dict[int, KVSequence] = {}
        self._to_release: deque[KVSequence] = deque()

    # ------------------------------------------------------------------ pool facts
    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def num_blocks(self) -> int:
        return self.cache.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.cache.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.cache.pool.num_used_blocks

    def bytes_per_block(self, dtype: torch.dtype | None = None) -> int:
        return self.cache.bytes_per_block(dtype)

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """The dtype the blocks are stored in, once a forward allocated them (None before)."""
        owner = self.cache.slot_owner(0)
        return None if owner is None else owner.keys.dtype

    # ------------------------------------------------------------------ the step transaction
    def begin(self, step: StepMetadata) -> None:
        """Run the next forward with `step` (its copy-on-write copies are applied first)."""
        self.cache.begin_step(step)

    def commit(self, new_full_blocks: Sequence[tuple[int, int]]) -> None:
        """Every layer wrote the step's K/V: publish the blocks it filled in the prefix cache."""
        self.cache.manager.commit_full_blocks(new_full_blocks)

    def abort(self) -> None:
        """The step failed before its K/V were complete: forget it; nothing it staged is published
        (the engine's steps hash their blocks only at `commit`). Idempotent."""
        self.cache.abandon_step(reset_prefix_cache=False)
        self.cache.pool.discard_staged()

    # ------------------------------------------------------------------ sequences
    def new_sequence(self) -> KVSequence:
        return self.cache.new_sequence()

    def fork_sequence(self, seq: KVSequence) -> KVSequence:
        return self.cache.fork_sequence(seq)

    def free_sequence(self, seq: KVSequence) -> None:
        self.cache.manager.free(seq)

    def sequence_salt(self) -> tuple:
        return self.cache.sequence_salt()

    def note_weights(self, fingerprint) -> None:
        self.cache.note_weights(fingerprint)

    def reset_prefix_cache(self) -> None:
        self.cache.pool.reset_prefix_cache()

    def grow_to(self, num_blocks: int) -> None:
        """Grow the pool to `num_blocks` blocks (never shrinks); only between steps."""
        self.cache.grow_to(num_blocks)

    # ------------------------------------------------------------------ kept sequences
    def keep(self, seq: KVSequence, num_tokens: int) -> bool:
        """Hold `seq` for a caller, shortened to its first `num_tokens` tokens; returns whether it is
        held (a sliding group that released what that needs frees it instead)."""
        extra = seq.num_tokens - num_tokens
        if extra > 0:
            try:
                self.cache.manager.truncate(seq, extra)
            except ValueError:
                self.cache.manager.free(seq)
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
                self.cache.manager.free(seq)

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
                self.cache.manager.truncate(seq, seq.num_tokens - num_tokens)
            except ValueError:
                del self._held[seq.seq_id]
                self.cache.manager.free(seq)
                return False
        return True

    def fork(self, seq: KVSequence) -> KVSequence | None:
        """A second kept sequence sharing `seq`'s blocks (copy-on-write), or None if `seq` is not held."""
        if not self.holds(seq):
            return None
        fork = self.cache.fork_sequence(seq)
        self._held[fork.seq_id] = fork
        return fork

    def export(self, seq: KVSequence) -> torch.Tensor:  # [seq.num_tokens * kv_numel_per_token()]
        """The K/V of every token of a kept sequence as one contiguous buffer (a copy)."""
        if not self.holds(seq):
            raise ValueError("export_kv takes a sequence this engine keeps (kept_kv)")
        return self.cache.export_tokens(seq, seq.num_tokens)

    def import_tokens(self, token_ids: list[int], kv: torch.Tensor) -> KVSequence:
        """Store another cache's `export` buffer for `token_ids` and keep the new sequence."""
        seq = self.cache.import_tokens(token_ids, kv)
        self._held[seq.seq_id] = seq
        return seq

    def evict_kept(self) -> bool:
        """Free every kept sequence (their owners recompute on use); returns whether any was held."""
        held, self._held = list(self._held.values()), {}
        for seq in held:
            self.cache.manager.free(seq)
        if held:
            logger.info("hf_paged: evicted %d kept sequences (returned caches) to make room", len(held))
        return bool(held)

    # ------------------------------------------------------------------ K/V transfer facts
    def check_transferable(self) -> None:
        self.cache.check_transferable()

    def transfer_info(self) -> dict:
        """What a disaggregated peer must agree on before K/V move between two engines."""
        return {"num_blocks": self.num_blocks, "block_size": self.block_size,
                "kv_numel_per_token": self.cache.kv_numel_per_token(), "kv_dtype": self.kv_dtype}
