"""Physical KV blocks: free list, reference counts, the prefix-cache hash chain and copy-on-write.

Torch-free on purpose: everything here is plain Python bookkeeping over integer block ids, so it can
be tested exhaustively (see tests/test_block_pool.py). The tensor owner (`PagedCache`) asks these
classes *where* to write and *which* blocks to copy; it never decides that itself.

Every mutation comes with a side-effect-free question first (`can_allocate` / `allocate`,
`num_blocks_needed` / `append_tokens`), so callers such as a scheduler can check before acting.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence as SequenceABC
from dataclasses import dataclass, field

from ..kv_layout import SpecLike, as_spec, blocks_held, max_blocks_held, window_of
from ..kv_spec import LayerSpec
from .sequence import NULL_BLOCK, KVSequence
from .state_slots import StateSlots, release_rows, restore_point


class NoFreeBlocksError(RuntimeError):
    """The pool has no free or evictable block left. An engine catches this to preempt a sequence."""


def hash_block_tokens(parent_hash: int | None, token_ids: SequenceABC[int], extra_key: object = None) -> int:
    """Content hash of one full block, chained to its parent so equal hashes mean equal prefixes.

    Args:
        parent_hash: hash of the previous block of the sequence, `None` for the first block.
        token_ids: the block's `block_size` token ids.
        extra_key: salt mixed into every block (an adapter name, a weights version, a user salt),
            so caches that must not share K/V never collide.

    Returns:
        A 128-bit integer. A cryptographic digest (not Python's `hash`) keeps accidental
        collisions, which would silently reuse wrong K/V, out of reach.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(b"root" if parent_hash is None else parent_hash.to_bytes(16, "little"))
    h.update(repr(extra_key).encode())
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


class BlockPool:
    """A pool of `num_blocks` fixed-size KV blocks identified by integer ids.

    A block is in exactly one of three states:

    * **free**: ref count 0, no content worth keeping; on the free list.
    * **in use**: ref count > 0, held by one or more sequences (shared when > 1).
    * **cached**: ref count 0 but holding a full block whose content hash is known; kept in an LRU
      so a later request with the same prefix can take it back instead of recomputing it, and
      evicted (oldest first) only when no free block is left.

    Args:
        num_blocks: initial number of blocks (0 for a pool that only grows). `grow()` adds more.
        enable_prefix_caching: when False, full blocks are never registered and freed blocks go
            straight back to the free list.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative integer, got {num_blocks!r}")
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Blocks filled by the step being planned, findable only by that same step (its forward writes
        # them before any attention reads them): published by `publish_staged`, else dropped.
        self._staged: dict[int, int] = {}  # block hash -> block id
        # Free blocks in the order they are handed out (FIFO); a dict so that `allocate(after=...)` can
        # take a particular one in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently used first
        self.num_prefix_hits = 0  # blocks taken back from the cache instead of recomputed
        self.epoch = 0  # bumped by reset_prefix_cache; sequences alive across a reset stop hashing
        # Called with a hash the cache forgets (its block evicted or rewritten), and with None when it
        # forgets them all: what is keyed by a block's hash elsewhere (state checkpoints) goes with it.
        self.on_forget: Callable[[int | None], None] | None = None

    # ---------------------------------------------------------------- questions
    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def ref_count(self, block_id: int) -> int:
        return self.ref_counts[block_id]

    def lookup(self, block_hash: int) -> int | None:
        """The block holding `block_hash`, if cached, in use or staged by this step; no side effect."""
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None:
            block_id = self._staged.get(block_hash)
            if block_id is not None and self.ref_counts[block_id] == 0:
                return None  # its owner let it go before the step ran: it holds nothing
        return block_id

    # ---------------------------------------------------------------- mutations
    def grow(self, num_new_blocks: int) -> None:
        """Append `num_new_blocks` free blocks (the tensor owner grows its storage to match)."""
        start = self.num_blocks
        self.ref_counts.extend([0] * num_new_blocks)
        self.block_hash.extend([None] * num_new_blocks)
        self._free.update(dict.fromkeys(range(start, start + num_new_blocks)))

    def allocate(self, num_blocks: int = 1, after: int | None = None) -> list[int]:
        """Take `num_blocks` blocks with ref count 1, evicting least-recently-used cached blocks
        only when the free list is empty. All or nothing: raises `NoFreeBlocksError` untouched.

        Args:
            after: the block the new ones follow in a sequence. Block `after + 1` is taken if it is
                free (then `after + 2`...), so a sequence's blocks stay consecutive where they can and
                attention reads them as one view (`attention.torch_paged`). Cached blocks are never
                evicted for this.
        """
        if not self.can_allocate(num_blocks):
            raise NoFreeBlocksError(
                f"need {num_blocks} KV blocks but only {self.num_free_blocks} of {self.num_blocks} are free"
            )
        out = []
        for _ in range(num_blocks):
            if after is not None and after + 1 in self._free:
                block_id = after + 1
                del self._free[block_id]
            elif self._free:
                block_id, _ = self._free.popitem(last=False)
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._drop_hash(block_id)
            self.ref_counts[block_id] = 1
            out.append(block_id)
            after = block_id
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Share blocks that are already in use (fork, beam reorder)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise ValueError(f"cannot share block {block_id}: it is not in use")
            self.ref_counts[block_id] += 1

    def acquire_cached(self, block_hash: int) -> int | None:
        """Take a reference on the block holding `block_hash` (a prefix-cache hit), or return None."""
        block_id = self.lookup(block_hash)
        if block_id is None:
            return None
        if self.ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self.ref_counts[block_id] += 1
        self.num_prefix_hits += 1
        return block_id

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block. At zero a hashed block becomes evictable, any other
        block goes back to the free list. Freeing a block that is not in use is an error."""
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise ValueError(f"double free of KV block {block_id}")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hash[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free[block_id] = None

    def register_full_block(self, block_id: int, block_hash: int) -> None:
        """Record the content hash of a block that just became full, so later prefixes can hit it.
        If another block already holds that content, the first one stays the canonical copy."""
        if not self.enable_prefix_caching or block_hash in self.hash_to_block:
            return
        if self.block_hash[block_id] is not None:
            self._drop_hash(block_id)
        self.block_hash[block_id] = block_hash
        self.hash_to_block[block_hash] = block_id

    def stage_full_block(self, block_id: int, block_hash: int) -> None:
        """Make a block filled by the step being planned findable by that step alone."""
        if self.enable_prefix_caching and block_hash not in self.hash_to_block:
            self._staged.setdefault(block_hash, block_id)

    def publish_staged(self, full_blocks: Iterable[tuple[int, int]]) -> None:
        """The step's forward wrote its blocks: register them (those still in use) in the prefix cache,
        and forget what was staged."""
        for block_id, block_hash in full_blocks:
            if self.ref_counts[block_id] > 0 and self.block_hash[block_id] is None:
                self.register_full_block(block_id, block_hash)
        self._staged.clear()

    def is_staged(self, block_id: int) -> bool:
        """Whether the step being planned filled this block (findable by that step, not yet cached)."""
        return self.ref_counts[block_id] > 0 and block_id in self._staged.values()

    def discard_staged(self) -> None:
        """The step failed (or is being planned afresh): nothing it staged may ever be found."""
        self._staged.clear()

    def unregister(self, block_id: int) -> None:
        """Forget a block's hash because its content is about to change (an in-place write after
        `truncate`). Only called on blocks in use."""
        self._drop_hash(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every content hash (e.g. the weights changed). Cached free blocks become free.

        Sequences still alive keep their blocks, but `BlockManager` stops hashing them: a block they
        fill later attends to K/V from before the reset, so it must never be shared."""
        self.epoch += 1
        for block_id in list(self._evictable):
            self._free[block_id] = None
        self._evictable.clear()
        for block_id in list(self.hash_to_block.values()):
            self.block_hash[block_id] = None
        self.hash_to_block.clear()
        if self.on_forget is not None:
            self.on_forget(None)

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            self.block_hash[block_id] = None
            if self.hash_to_block.get(block_hash) == block_id:
                del self.hash_to_block[block_hash]
                if self.on_forget is not None:
                    self.on_forget(block_hash)

    # ---------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. Used by the property tests."""
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        free_set, evictable = set(free), set(self._evictable)
        assert not free_set & evictable, "a block is both free and cached-evictable"
        for block_id, ref in enumerate(self.ref_counts):
            assert ref >= 0, f"block {block_id} has a negative ref count"
            idle = block_id in free_set or block_id in evictable
            assert (ref == 0) == idle, f"block {block_id}: ref count {ref} but idle={idle}"
            if block_id in free_set:
                assert self.block_hash[block_id] is None, f"free block {block_id} still has a hash"
            if block_id in evictable:
                assert self.block_hash[block_id] is not None, f"evictable block {block_id} has no hash"
        for block_hash, block_id in self.hash_to_block.items():
            assert self.block_hash[block_id] == block_hash, f"hash table and block {block_id} disagree"


@dataclass
class AppendResult:
    """What the tensor owner must do for one `append_tokens` call.

    Attributes:
        group_slots: per KV group, one physical slot (`block_id * block_size + offset`) per appended
            token, or -1 where the block came from the prefix cache and already holds that token's
            K/V (nothing to write). `slots` is group 0's.
        copies: `(src_block, dst_block)` pairs to copy, in order, before any write (copy-on-write).
        num_cached_tokens: how many of the appended tokens were prefix-cache hits.
        new_full_blocks: `(block_id, block_key)` of the blocks this call filled. With
            `register=False` they are not in the prefix cache yet: `commit_full_blocks` publishes
            them once the forward has written their K/V.
    """

    group_slots: list[list[int]] = field(default_factory=lambda: [[]])
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_cached_tokens: int = 0
    new_full_blocks: list[tuple[int, object]] = field(default_factory=list)

    @property
    def slots(self) -> list[int]:
        return self.group_slots[0]


class BlockManager:
    """Maps sequences onto pool blocks: append, fork, truncate and free, with prefix caching, one
    block table per KV group (`config.kv_layout`) over one shared pool.

    Each group's spec (`kv_spec`) says which blocks it gives back: every append first releases the
    leading blocks before `spec.first_readable(num_tokens, lookback)` (the queries of this and every
    later step sit at `num_tokens - lookback` or later): a sliding group the blocks that left its
    window, a chunked group those of past chunks, a full group none. A group so holds
    `config.blocks_held` blocks at most. A prefix-cache hit of k tokens needs, per group, the cached
    blocks from `first_readable(k)` on only. The pool keys a full block of group 0 by its chain hash
    and a block of group g > 0 by `(g, chain hash)`: one content, one cached block per group.

    Args:
        pool: the shared `BlockPool`.
        block_size: tokens per block.
        specs: per KV group, its spec (`KVLayout.group_specs`); a sliding window (int) or None (full
            attention) is taken as its spec. Default: one full group.
        lookback: tokens a caller may roll back below a sequence's length before its next append
            (`truncate` of more is refused once the blocks are gone). 0 suits callers that roll back
            only tokens of the step they just appended; a draft model that drafts k tokens ahead
            before its rollback is known needs k.
        windows: the older name of `specs` (per group, a window or None); give one or the other.

    Attributes:
        group_specs: per group, its spec. `windows` gives them as windows (None: full attention) for
            callers that know no other kind, and raises ValueError for a chunked group.
    """

    def __init__(self, pool: BlockPool, block_size: int, specs: SequenceABC[SpecLike] | None = None,
                 lookback: int = 0, *, windows: SequenceABC[int | None] | None = None):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if specs is not None and windows is not None:
            raise TypeError("BlockManager takes its groups as `specs` or as `windows`, not both")
        specs = (None,) if specs is None and windows is None else specs if specs is not None else windows
        group_specs = tuple(as_spec(s, g) for g, s in enumerate(specs))
        if not group_specs:
            raise ValueError("a BlockManager needs at least one KV group")
        for g, spec in enumerate(group_specs):
            if not spec.owns_kv:
                raise ValueError(f"KV group {g}: {type(spec).__name__} stores no K/V and has no group of its own")
        if isinstance(lookback, bool) or not isinstance(lookback, int) or lookback < 0:
            raise ValueError(f"lookback must be an integer >= 0, got {lookback!r}")
        self.pool = pool
        self.block_size = block_size
        self.group_specs: tuple[LayerSpec, ...] = group_specs
        self.lookback = lookback
        self._freeing = [g for g, spec in enumerate(group_specs) if spec.reach is not None]
        # The state rows of a model with recurrent layers (`state_slots`), set by the cache; None otherwise.
        self.state_slots: StateSlots | None = None

    def use_state_slots(self, slots: StateSlots) -> None:
        """Keep per-sequence state rows in `slots`: `free` releases a sequence's rows, prefix-cache hits
        end where a state checkpoint is kept, and a block the pool forgets takes its checkpoint along."""
        self.state_slots = slots
        self.pool.on_forget = lambda key: slots.drop_all() if key is None else slots.drop(key)

    @property
    def num_groups(self) -> int:
        return len(self.group_specs)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per group, its sliding window or None (full). Raises ValueError for a chunked group: a
        chunk is not a window (read `group_specs`)."""
        return tuple(window_of(spec) for spec in self.group_specs)

    # ------------------------------------------------------------------ questions
    def first_kept_block(self, group: int, num_tokens: int) -> int:
        """The first table index of `group` a query at `num_tokens - lookback` or later can read."""
        return self.group_specs[group].first_readable(num_tokens, self.lookback) // self.block_size

    def max_blocks_for(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """The most blocks one sequence growing to `num_tokens` tokens ever holds at once, when no
        step appends more than `max_chunk` tokens (None: a single step may append everything): per
        group, `spec.max_tokens_held(max_chunk, lookback)` tokens plus one block at most."""
        return sum(max_blocks_held(spec, num_tokens, self.block_size, max_chunk, self.lookback)
                   for spec in self.group_specs)

    def num_blocks_held(self, seq: KVSequence, num_new_tokens: int = 0) -> int:
        """Blocks `seq` holds while a step appends `num_new_tokens` to it (after its release)."""
        return sum(blocks_held(seq.num_tokens, spec, self.block_size, self.lookback, num_new_tokens)
                   for spec in self.group_specs)

    def num_blocks_needed(self, seq: KVSequence, num_new_tokens: int, num_cached_tokens: int = 0) -> int:
        """Worst-case blocks `append_tokens` takes from the pool for `num_new_tokens` tokens (no
        prefix hits), after `num_cached_tokens` prefix-cache tokens the forward skips
        (`append_cached`). Blocks the append releases first are not subtracted (`can_append` is)."""
        bs, n0 = self.block_size, seq.num_tokens
        end = n0 + num_cached_tokens + num_new_tokens
        needed = 0
        for g, table in enumerate(self._tables(seq)):
            first = self.first_kept_block(g, n0 + num_cached_tokens)
            needed += max(-(-end // bs) - max(len(table), first), 0)
            if n0 % bs and end > n0 and self.pool.ref_count(table[-1]) > 1:
                needed += 1  # copy-on-write of the shared partial last block
        return needed

    def num_releasable(self, seq: KVSequence, num_cached_tokens: int = 0) -> int:
        """Blocks the next append gives back to the free count (groups that free, sole owner)."""
        freed = 0
        for g in self._freeing:
            table, released = self._table(seq, g), seq.num_released[g]
            first = min(self.first_kept_block(g, seq.num_tokens + num_cached_tokens), len(table))
            freed += sum(1 for b in table[released:first] if self.pool.ref_count(b) == 1)
        return freed

    def can_append(self, seq: KVSequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.pool.num_free_blocks + self.num_releasable(seq)

    def num_cached_prefix_tokens(self, seq: KVSequence, token_ids: SequenceABC[int]) -> int:
        """How many leading `token_ids` an empty `seq` would take from the prefix cache when the
        forward skips them (`append_cached`): whole blocks, hash chain unbroken, and in every group
        the blocks the continuation reads (all of them for full attention, from
        `spec.first_readable(k)` on for a sliding or chunked group: the last window's, the current
        chunk's). A question only: nothing is acquired."""
        pool, bs = self.pool, self.block_size
        if seq.num_tokens or not (pool.enable_prefix_caching and seq.is_cacheable):
            return 0
        full = [g for g in range(self.num_groups) if g not in self._freeing]
        hashes, parent = [], None
        while (len(hashes) + 1) * bs <= len(token_ids):
            i = len(hashes)
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], seq.block_key(i, bs))
            if any(pool.lookup(self._key(g, parent)) is None for g in full):
                break
            hashes.append(parent)
        if self.state_slots is not None:  # the state must be restored where the hit ends
            hashes = hashes[: restore_point(self.state_slots, hashes, len(hashes), bs)]
        if not self._freeing:
            return len(hashes) * bs
        # misses[g][k]: blocks among the first k that group g lacks
        misses = {}
        for g in self._freeing:
            counts = [0]
            for h in hashes:
                counts.append(counts[-1] + (pool.lookup(self._key(g, h)) is None))
            misses[g] = counts
        for k in range(len(hashes), 0, -1):
            if self.state_slots is not None and restore_point(self.state_slots, hashes, k, bs) != k:
                continue
            if all(misses[g][k] == misses[g][self.first_kept_block(g, k * bs)] for g in self._freeing):
                return k * bs
        return 0

    # ------------------------------------------------------------------ mutations
    def append_tokens(self, seq: KVSequence, token_ids: SequenceABC[int], register: bool = True) -> AppendResult:
        """Give `token_ids` slots at the end of `seq`, reusing cached full blocks where the hash
        chain matches in every group. Groups that free (sliding, chunked) first release the blocks no
        query of this or a later step reads. Raises `NoFreeBlocksError` before changing anything if the pool is short.

        Args:
            register: publish the blocks this call fills in the prefix cache at once. A caller whose
                forward may still fail passes False and calls `commit_full_blocks` after it (a block
                is never findable before its K/V exist).
        """
        self._check_room(seq, len(token_ids), 0)
        self.release(seq, seq.num_tokens)
        bs, pool, result = self.block_size, self.pool, self._result()
        caching = self._start_hashing(seq)
        self._copy_on_write(seq, token_ids, result)
        i, n = 0, len(token_ids)
        while i < n:
            offset = seq.num_tokens % bs
            if offset == 0:
                chunk = token_ids[i : i + bs]
                if caching and len(chunk) == bs:
                    block_hash = hash_block_tokens(seq.last_block_hash, chunk, seq.block_key(seq.num_tokens // bs, bs))
                    if self._acquire_all(seq, block_hash, range(self.num_groups)):
                        seq.block_hashes.append(block_hash)
                        seq.token_ids.extend(chunk)
                        for slots in result.group_slots:
                            slots.extend([-1] * bs)
                        result.num_cached_tokens += bs
                        i += bs
                        continue
                for table in seq.block_tables:
                    table.append(pool.allocate(1, after=table[-1] if table and table[-1] >= 0 else None)[0])
            take = min(bs - offset, n - i)
            for table, slots in zip(seq.block_tables, result.group_slots):
                base = table[-1] * bs + offset
                slots.extend(range(base, base + take))
            seq.token_ids.extend(token_ids[i : i + take])
            i += take
            if caching and seq.num_tokens % bs == 0:
                block_hash = hash_block_tokens(seq.last_block_hash, seq.token_ids[-bs:],
                                               seq.block_key(seq.num_tokens // bs - 1, bs))
                seq.block_hashes.append(block_hash)
                for g, table in enumerate(seq.block_tables):
                    key = self._key(g, block_hash)
                    result.new_full_blocks.append((table[-1], key))
                    if register:
                        pool.register_full_block(table[-1], key)
                    else:
                        pool.stage_full_block(table[-1], key)
        return result

    def append_cached(self, seq: KVSequence, token_ids: SequenceABC[int]) -> AppendResult:
        """Take `token_ids` (whole blocks, `num_cached_prefix_tokens` of them) from the prefix cache
        for tokens the forward skips: a sliding or chunked group takes only the blocks the continuation reads
        and leaves NULL_BLOCK before them. Raises `NoFreeBlocksError` untouched if the pool is short,
        ValueError if the tokens are not cached blocks."""
        bs, n = self.block_size, len(token_ids)
        if n % bs or seq.num_tokens % bs:
            raise ValueError(f"append_cached takes whole blocks of {bs} tokens at a block boundary, got {n} "
                             f"tokens after {seq.num_tokens}")
        self._check_room(seq, 0, n)
        caching = self._start_hashing(seq)
        if n and not caching:
            raise ValueError("append_cached on a sequence whose blocks are not hashed (prefix caching off)")
        start = seq.num_tokens
        end = start + n
        self.release(seq, end)
        result = self._result()
        for i in range(0, n, bs):
            block_hash = hash_block_tokens(seq.last_block_hash, token_ids[i : i + bs],
                                           seq.block_key((start + i) // bs, bs))
            index = (start + i) // bs
            keep = [g for g in range(self.num_groups) if index >= self.first_kept_block(g, end)]
            if not self._acquire_all(seq, block_hash, keep):
                raise ValueError(f"block {index} of sequence {seq.seq_id} is not in the prefix cache")
            for g in range(self.num_groups):
                if g not in keep:
                    seq.block_tables[g].append(NULL_BLOCK)
                    seq.num_released[g] += 1
            seq.block_hashes.append(block_hash)
            seq.token_ids.extend(token_ids[i : i + bs])
        for slots in result.group_slots:
            slots.extend([-1] * n)
        result.num_cached_tokens = n
        return result

    def commit_full_blocks(self, full_blocks: Iterable[tuple[int, object]]) -> None:
        """Publish blocks filled by `append_tokens(..., register=False)` now that their K/V are written.
        A block released in between (its sequence finished or was truncated) is skipped."""
        self.pool.publish_staged(full_blocks)

    def fork(self, seq: KVSequence, seq_id: int) -> KVSequence:
        """A new sequence sharing every block of `seq` (copy-on-write on the next write)."""
        self.pool.incref(seq.live_blocks())
        return KVSequence(
            seq_id=seq_id,
            token_ids=list(seq.token_ids),
            block_tables=[list(t) for t in seq.block_tables],
            num_released=list(seq.num_released),
            block_hashes=list(seq.block_hashes),
            extra_key=seq.extra_key,
            mm_spans=seq.mm_spans,
            is_cacheable=seq.is_cacheable,
            prefix_epoch=seq.prefix_epoch,
            rope=seq.rope,
        )

    def reindex(self, seqs: list[KVSequence], rows: list[int], new_seq_id) -> list[KVSequence]:
        """Beam-search style reordering: row `i` of the result continues `seqs[rows[i]]`.

        A row taken again is forked (shares its blocks, copy-on-write); a row never taken is freed.
        `new_seq_id()` names each fork.

        Raises:
            ValueError: a row index outside `seqs` (nothing is changed).
        """
        bad = [r for r in rows if not 0 <= r < len(seqs)]
        if bad:
            raise ValueError(f"row indices {bad} are out of range for a cache of {len(seqs)} sequences")
        taken: set[int] = set()
        out = []
        for r in rows:
            if r in taken:
                out.append(self.fork(seqs[r], new_seq_id()))
            else:
                taken.add(r)
                out.append(seqs[r])
        for r, seq in enumerate(seqs):
            if r not in taken:
                self.free(seq)
        return out

    def truncate(self, seq: KVSequence, num_tokens_to_remove: int) -> None:
        """Drop the last tokens of `seq`, releasing blocks that no longer hold any of its tokens.

        Raises:
            ValueError: more tokens than `seq` holds, or a rollback below what a sliding or chunked
                group kept (its earlier blocks are gone; nothing is changed).
        """
        self.check_truncate(seq, num_tokens_to_remove)
        new_len = seq.num_tokens - num_tokens_to_remove
        keep = -(-new_len // self.block_size)
        for table in seq.block_tables:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]
        del seq.token_ids[new_len:]
        del seq.block_hashes[new_len // self.block_size :]

    def check_truncate(self, seq: KVSequence, num_tokens_to_remove: int) -> None:
        """Raise the ValueError `truncate` would raise, changing nothing (a batch checks every row
        before it truncates any)."""
        if not 0 <= num_tokens_to_remove <= seq.num_tokens:
            raise ValueError(
                f"cannot remove {num_tokens_to_remove} tokens from sequence {seq.seq_id} of {seq.num_tokens}"
            )
        new_len = seq.num_tokens - num_tokens_to_remove
        self._tables(seq)
        for g in self._freeing:
            spec = self.group_specs[g]
            if seq.num_released[g] > spec.first_readable(new_len) // self.block_size:
                what = (f"sliding-window layers (window {spec.mask.window})" if spec.mask.window
                        else f"chunked-attention layers (chunk {spec.mask.chunk})")
                raise ValueError(
                    f"cannot roll sequence {seq.seq_id} back to {new_len} tokens: its {what} already "
                    "released the blocks before token "
                    f"{seq.num_released[g] * self.block_size}; roll back at most {self.lookback} tokens below "
                    "the length of the last append (BlockManager lookback)"
                )

    def free(self, seq: KVSequence) -> None:
        """Release all of `seq`'s blocks. Tail blocks go first so that, once cached, the LRU evicts
        them before the shared prompt blocks that other requests are likelier to reuse."""
        for table, released in zip(seq.block_tables, seq.num_released):
            self.pool.free(reversed(table[released:]))
        if self.state_slots is not None:
            release_rows(self.state_slots, seq)
        seq.block_tables = [[] for _ in range(self.num_groups)]
        seq.num_released = [0] * self.num_groups
        seq.token_ids.clear()
        seq.block_hashes.clear()

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _key(group: int, block_hash: int):
        return block_hash if group == 0 else (group, block_hash)

    def _result(self) -> AppendResult:
        return AppendResult(group_slots=[[] for _ in range(self.num_groups)])

    def _tables(self, seq: KVSequence) -> list[list[int]]:
        """`seq`'s tables, one per group (a fresh sequence gets its groups' empty tables)."""
        if len(seq.block_tables) != self.num_groups:
            if seq.num_tokens or any(seq.block_tables):
                raise ValueError(f"sequence {seq.seq_id} has {len(seq.block_tables)} block tables, but this "
                                 f"BlockManager has {self.num_groups} KV groups")
            seq.block_tables = [[] for _ in range(self.num_groups)]
            seq.num_released = [0] * self.num_groups
        return seq.block_tables

    def _table(self, seq: KVSequence, group: int) -> list[int]:
        return self._tables(seq)[group]

    def _check_room(self, seq: KVSequence, num_new: int, num_cached: int) -> None:
        needed = self.num_blocks_needed(seq, num_new, num_cached)
        if needed > self.pool.num_free_blocks + self.num_releasable(seq, num_cached):
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {needed} more KV blocks but only "
                f"{self.pool.num_free_blocks} of {self.pool.num_blocks} are free"
            )

    def release(self, seq: KVSequence, num_tokens: int | None = None) -> None:
        """Give back the blocks no query at `num_tokens - lookback` or later reads (groups that free)
        (default: `seq.num_tokens`). Invisible to every query that can still come, so callers may
        release ahead of an append (a batch releases every row before it sizes its allocation)."""
        self._tables(seq)
        if num_tokens is None:
            num_tokens = seq.num_tokens
        for g in self._freeing:
            table = seq.block_tables[g]
            first = min(self.first_kept_block(g, num_tokens), len(table))
            released = seq.num_released[g]
            if first > released:
                self.pool.free(table[released:first])
                table[released:first] = [NULL_BLOCK] * (first - released)
                seq.num_released[g] = first

    def _start_hashing(self, seq: KVSequence) -> bool:
        """Whether `seq`'s new full blocks are hashed (and may hit the prefix cache)."""
        pool = self.pool
        if seq.prefix_epoch is None:
            seq.prefix_epoch = pool.epoch
        elif seq.prefix_epoch != pool.epoch and seq.is_cacheable:
            seq.is_cacheable = False  # alive across a prefix-cache reset: see reset_prefix_cache
            seq.block_hashes.clear()
        return pool.enable_prefix_caching and seq.is_cacheable

    def _copy_on_write(self, seq: KVSequence, token_ids: SequenceABC[int], result: AppendResult) -> None:
        if not (seq.num_tokens % self.block_size and token_ids):
            return
        pool = self.pool
        for table in seq.block_tables:
            last = table[-1]
            if pool.ref_count(last) > 1:
                prev = table[-2] if len(table) > 1 and table[-2] >= 0 else None
                (new,) = pool.allocate(1, after=prev)
                result.copies.append((last, new))
                pool.free([last])
                table[-1] = new
            elif pool.block_hash[last] is not None:
                pool.unregister(last)  # sole owner about to overwrite the tail of a once-full block

    def _acquire_all(self, seq: KVSequence, block_hash: int, groups) -> bool:
        """Take the cached block of `block_hash` for each of `groups` and append it to their tables,
        all or none; False (nothing taken) if one is missing."""
        groups = list(groups)
        if any(self.pool.lookup(self._key(g, block_hash)) is None for g in groups):
            return False
        for g in groups:
            seq.block_tables[g].append(self.pool.acquire_cached(self._key(g, block_hash)))
        return True
