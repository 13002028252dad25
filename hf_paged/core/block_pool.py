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
from collections.abc import Iterable, Sequence as SequenceABC
from dataclasses import dataclass, field

from .sequence import KVSequence


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

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            self.block_hash[block_id] = None
            if self.hash_to_block.get(block_hash) == block_id:
                del self.hash_to_block[block_hash]

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
        slots: one physical slot (`block_id * block_size + offset`) per appended token, or -1 where the
            block came from the prefix cache and already holds that token's K/V (nothing to write).
        copies: `(src_block, dst_block)` pairs to copy, in order, before any write (copy-on-write).
        num_cached_tokens: how many of the appended tokens were prefix-cache hits.
        new_full_blocks: `(block_id, block_hash)` of the blocks this call filled. With
            `register=False` they are not in the prefix cache yet: `commit_full_blocks` publishes
            them once the forward has written their K/V.
    """

    slots: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_cached_tokens: int = 0
    new_full_blocks: list[tuple[int, int]] = field(default_factory=list)


class BlockManager:
    """Maps sequences onto pool blocks: append, fork, truncate and free, with prefix caching.

    Args:
        pool: the shared `BlockPool`.
        block_size: tokens per block.
    """

    def __init__(self, pool: BlockPool, block_size: int):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.pool = pool
        self.block_size = block_size

    def num_blocks_needed(self, seq: KVSequence, num_new_tokens: int) -> int:
        """Worst-case blocks `append_tokens(seq, <num_new_tokens tokens>)` takes (no prefix hits)."""
        bs = self.block_size
        needed = -(-(seq.num_tokens + num_new_tokens) // bs) - len(seq.block_table)
        if seq.num_tokens % bs and num_new_tokens and self.pool.ref_count(seq.block_table[-1]) > 1:
            needed += 1  # copy-on-write of the shared partial last block
        return max(needed, 0)

    def can_append(self, seq: KVSequence, num_new_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_blocks_needed(seq, num_new_tokens))

    def num_cached_prefix_tokens(self, seq: KVSequence, token_ids: SequenceABC[int]) -> int:
        """How many leading `token_ids` an empty `seq` would take from the prefix cache (whole
        blocks, hash chain unbroken). A question only: nothing is acquired."""
        pool, bs = self.pool, self.block_size
        if seq.num_tokens or not (pool.enable_prefix_caching and seq.is_cacheable):
            return 0
        parent, n = None, 0
        while n + bs <= len(token_ids):
            parent = hash_block_tokens(parent, token_ids[n : n + bs], seq.extra_key)
            if pool.lookup(parent) is None:
                break
            n += bs
        return n

    def append_tokens(self, seq: KVSequence, token_ids: SequenceABC[int], register: bool = True) -> AppendResult:
        """Give `token_ids` slots at the end of `seq`, reusing cached full blocks where the hash
        chain matches. Raises `NoFreeBlocksError` before changing anything if the pool is short.

        Args:
            register: publish the blocks this call fills in the prefix cache at once. A caller whose
                forward may still fail passes False and calls `commit_full_blocks` after it (a block
                is never findable before its K/V exist).
        """
        needed = self.num_blocks_needed(seq, len(token_ids))
        if not self.pool.can_allocate(needed):
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {needed} more KV blocks but only "
                f"{self.pool.num_free_blocks} of {self.pool.num_blocks} are free"
            )
        bs, pool, result = self.block_size, self.pool, AppendResult()
        if seq.prefix_epoch is None:
            seq.prefix_epoch = pool.epoch
        elif seq.prefix_epoch != pool.epoch and seq.is_cacheable:
            seq.is_cacheable = False  # alive across a prefix-cache reset: see reset_prefix_cache
            seq.block_hashes.clear()
        caching = pool.enable_prefix_caching and seq.is_cacheable
        if seq.num_tokens % bs and token_ids:
            last = seq.block_table[-1]
            if pool.ref_count(last) > 1:
                (new,) = pool.allocate(1, after=seq.block_table[-2] if len(seq.block_table) > 1 else None)
                result.copies.append((last, new))
                pool.free([last])
                seq.block_table[-1] = new
            elif pool.block_hash[last] is not None:
                pool.unregister(last)  # sole owner about to overwrite the tail of a once-full block
        i, n = 0, len(token_ids)
        while i < n:
            offset = seq.num_tokens % bs
            if offset == 0:
                chunk = token_ids[i : i + bs]
                if caching and len(chunk) == bs:
                    block_hash = hash_block_tokens(seq.last_block_hash, chunk, seq.extra_key)
                    hit = pool.acquire_cached(block_hash)
                    if hit is not None:
                        seq.block_table.append(hit)
                        seq.block_hashes.append(block_hash)
                        seq.token_ids.extend(chunk)
                        result.slots.extend([-1] * bs)
                        result.num_cached_tokens += bs
                        i += bs
                        continue
                seq.block_table.append(pool.allocate(1, after=seq.block_table[-1] if seq.block_table else None)[0])
            block_id = seq.block_table[-1]
            take = min(bs - offset, n - i)
            base = block_id * bs + offset
            result.slots.extend(range(base, base + take))
            seq.token_ids.extend(token_ids[i : i + take])
            i += take
            if caching and seq.num_tokens % bs == 0:
                block_hash = hash_block_tokens(seq.last_block_hash, seq.token_ids[-bs:], seq.extra_key)
                seq.block_hashes.append(block_hash)
                result.new_full_blocks.append((block_id, block_hash))
                if register:
                    pool.register_full_block(block_id, block_hash)
                else:
                    pool.stage_full_block(block_id, block_hash)
        return result

    def commit_full_blocks(self, full_blocks: Iterable[tuple[int, int]]) -> None:
        """Publish blocks filled by `append_tokens(..., register=False)` now that their K/V are written.
        A block released in between (its sequence finished or was truncated) is skipped."""
        self.pool.publish_staged(full_blocks)

    def fork(self, seq: KVSequence, seq_id: int) -> KVSequence:
        """A new sequence sharing every block of `seq` (copy-on-write on the next write)."""
        self.pool.incref(seq.block_table)
        return KVSequence(
            seq_id=seq_id,
            token_ids=list(seq.token_ids),
            block_table=list(seq.block_table),
            block_hashes=list(seq.block_hashes),
            extra_key=seq.extra_key,
            is_cacheable=seq.is_cacheable,
            prefix_epoch=seq.prefix_epoch,
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
        """Drop the last tokens of `seq`, releasing blocks that no longer hold any of its tokens."""
        if not 0 <= num_tokens_to_remove <= seq.num_tokens:
            raise ValueError(
                f"cannot remove {num_tokens_to_remove} tokens from sequence {seq.seq_id} of {seq.num_tokens}"
            )
        new_len = seq.num_tokens - num_tokens_to_remove
        keep = -(-new_len // self.block_size)
        self.pool.free(reversed(seq.block_table[keep:]))
        del seq.block_table[keep:]
        del seq.token_ids[new_len:]
        del seq.block_hashes[new_len // self.block_size :]

    def free(self, seq: KVSequence) -> None:
        """Release all of `seq`'s blocks. Tail blocks go first so that, once cached, the LRU evicts
        them before the shared prompt blocks that other requests are likelier to reuse."""
        self.pool.free(reversed(seq.block_table))
        seq.block_table.clear()
        seq.token_ids.clear()
        seq.block_hashes.clear()
