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

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (reusable, or evicted when needed)."""
        return self.cache.pool.num_cached_blocks

    def kv_numel_per_token(self) -> int:
        """Elements of one token's K and V over every storage slot (a transfer buffer's per-token size)."""
        return self.cache.kv_numel_per_token()

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

    def export(self, seq: KVSequence) -> torch.Tensor:  # [seq.num_tokens * cache.kv_numel_per_token()]
        """The K/V of every token of a kept sequence as one contiguous flat buffer in the pool's dtype:
        per storage slot in slot order, its K ([num_tokens, num_kv_heads, head_dim]) then its V. A
        copy: the blocks may be freed as soon as this returns."""
        if not self.holds(seq):
            raise ValueError("export_kv takes a sequence this engine keeps (kept_kv)")
        self.check_transferable()
        index = self._token_slots(seq.block_tables[0], seq.num_tokens)
        parts = []
        for layer in self.cache.slot_owners():
            for tensor in (layer.keys, layer.values):
                parts.append(tensor.view(-1, *tensor.shape[2:]).index_select(0, index.to(tensor.device)).reshape(-1))
        return torch.cat(parts)

    def import_tokens(self, token_ids: list[int], kv: torch.Tensor) -> KVSequence:
        """Keep a new sequence holding `token_ids` whose K/V are `kv` (an `export` buffer of another
        engine serving the same model). Blocks already held for a prefix of the tokens (prefix cache)
        are shared instead of written; the full blocks written are published in the prefix cache only
        after their K/V are in place.

        Raises:
            ValueError: `kv` does not hold exactly `len(token_ids)` tokens of this cache's layout, or
                the cache cannot move K/V (`check_transferable`).
            NoFreeBlocksError: a fixed pool has no room (nothing is changed).
        """
        self.check_transferable()
        cache = self.cache
        per_token = cache.kv_numel_per_token()
        if kv.dim() != 1 or kv.numel() != len(token_ids) * per_token:
            raise ValueError(f"a K/V buffer of {tuple(kv.shape)} does not hold {len(token_ids)} tokens of "
                             f"{per_token} elements")
        seq = cache.new_sequence(for_paged_steps=False)
        owners = cache.slot_owners()
        cache.ensure_free_blocks([seq], [token_ids], owners[0].keys.dtype)
        result = cache.manager.append_tokens(seq, token_ids, register=False)
        slots = torch.tensor(result.group_slots[0], dtype=torch.long)
        written = slots >= 0  # -1: a block taken from the prefix cache, already holding these K/V
        try:
            offset, n = 0, len(token_ids)
            for layer in owners:
                for tensor in (layer.keys, layer.values):
                    row = tensor[0, 0].numel()
                    part = kv[offset: offset + n * row].view(n, *tensor.shape[2:])
                    offset += n * row
                    flat = tensor.view(-1, *tensor.shape[2:])
                    with torch.inference_mode(tensor.is_inference()):
                        flat[slots[written].to(tensor.device)] = part[written.to(part.device)].to(tensor.device,
                                                                                               tensor.dtype)
        except BaseException:
            cache.manager.free(seq)
            raise
        cache.manager.commit_full_blocks(result.new_full_blocks)
        self._held[seq.seq_id] = seq
        return seq

    def _token_slots(self, table: list[int], num_tokens: int) -> torch.Tensor:  # [num_tokens] long
        bs = self.block_size
        blocks = torch.tensor(table, dtype=torch.long)
        positions = torch.arange(num_tokens)
        return blocks[positions // bs] * bs + positions % bs

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
        """Raise ValueError unless this cache's K/V can be exported and imported token by token (one
        KV group, no quantisation scales, every layer's tensors allocated): what disaggregated
        serving moves between engines."""
        cache = self.cache
        if len(cache.layout.groups) != 1:
            raise ValueError("moving K/V between engines needs one KV group: build the engines with "
                             "enable_hybrid_kv=False for this sliding-window model")
        if cache.cache_config.kv_dtype.is_quantized:
            raise ValueError(f"moving K/V between engines does not carry quantisation scales "
                             f"(kv_cache_dtype={cache.cache_config.kv_cache_dtype!r}); use an unquantised cache")
        if len(cache.slot_owners()) != cache.layout.num_slots:
            raise ValueError("moving K/V needs every layer's tensors: run one forward (a warm-up) first")

    def transfer_info(self) -> dict:
        """What a disaggregated peer must agree on before K/V move between two engines."""
        return {"num_blocks": self.num_blocks, "free_blocks": self.num_free_blocks + self.num_cached_blocks,
                "block_size": self.block_size, "kv_numel_per_token": self.kv_numel_per_token(),
                "kv_dtype": self.kv_dtype}
