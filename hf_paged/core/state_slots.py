"""Rows of the per-sequence state pool (torch-free bookkeeping): which row holds which sequence's
state, and which rows hold prefix-cache checkpoints.

A model with recurrent layers (`kv_spec.LinearState`, or an attention spec with `state=`) keeps, beside
its K/V blocks, one row per live sequence in every such layer's state tensors (`hf.state.StateStore`,
`[num_rows, *shape]`): allocated when the sequence is admitted, freed when it finishes or is preempted
(a preempted sequence recomputes its state). A drop-in batch takes a contiguous run of rows, so the
stock mixers see one `[batch, ...]` view.

Prefix caching needs the state at a block boundary, not only the blocks before it: the engine copies a
sequence's row into a checkpoint row every `interval` tokens of prefill, keyed by the hash of the block
that ends there (which chains every token before it). A later prompt whose blocks hit the cache up to
such a boundary restores the row and computes from there. Checkpoints are bounded (`max_checkpoints`),
evicted least recently used first, and dropped when the pool evicts the block they are keyed by.

vLLM pads the attention block to the state's page size instead (a hit needs a whole 528+ token block);
SGLang keeps a state per radix-tree node. Ours keeps any boundary the interval names.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable


class NoFreeStateRowsError(RuntimeError):
    """Every state row is taken: more sequences are live than the pool was sized for."""


class StateSlots:
    """Allocation of state rows: sequence rows (contiguous runs) and checkpoint rows (LRU by hash).

    Args:
        num_rows: rows in the pool (sequence rows plus checkpoint rows).
        max_checkpoints: the most rows held by checkpoints at once (0: prefix caching keeps no state).
        interval: tokens between checkpoints (a multiple of the block size).
    """

    def __init__(self, num_rows: int, max_checkpoints: int = 0, interval: int = 16):
        for name, value, low in (("num_rows", num_rows, 1), ("max_checkpoints", max_checkpoints, 0),
                                 ("interval", interval, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if max_checkpoints >= num_rows:
            raise ValueError(f"max_checkpoints={max_checkpoints} leaves no row of {num_rows} for a sequence")
        self.num_rows = num_rows
        self.max_checkpoints = max_checkpoints
        self.interval = interval
        self._free = [True] * num_rows
        self._num_free = num_rows
        self._checkpoints: OrderedDict[Hashable, int] = OrderedDict()  # block hash -> row, oldest first
        self.num_restores = 0  # checkpoints restored (prefix-cache hits that restored a state)
        # Called with the new row count when the rows grow (the tensors follow); None: a fixed pool.
        self.on_grow: Callable[[int], None] | None = None
        # Copies the next step makes before its forward, {dst row: src row}: a checkpoint restored at
        # admission, a forked sequence taking its parent's state at the fork (not at its own first step,
        # by when the parent may have moved on). A row freed before then drops its copy.
        self.pending_copies: dict[int, int] = {}
        self._num_reserved = 0  # checkpoint rows reserved and not yet published or cancelled

    # ------------------------------------------------------------------ sequence rows
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    def allocate(self, count: int = 1, from_top: bool = False) -> int:
        """The first row of `count` contiguous free rows, now taken; a checkpoint is evicted (oldest
        first) when no run is free. Sequences take the lowest free rows, checkpoints and snapshots
        (`from_top`) the highest: the rows of sequences admitted one after another stay consecutive, which
        lets a step read them as one view instead of gathering them.

        Raises:
            NoFreeStateRowsError: no run of `count` rows is free even with every checkpoint evicted.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        while True:
            start = self._find_run(count, from_top)
            if start is not None:
                for row in range(start, start + count):
                    self._free[row] = False
                self._num_free -= count
                return start
            if self._checkpoints:
                self._evict_oldest()
            elif self.on_grow is not None:
                self.grow(self.num_rows + max(count, self.num_rows // 2, 1))
            else:
                raise NoFreeStateRowsError(
                    f"no {count} free state rows of {self.num_rows}: more sequences are live than the state pool "
                    "holds")

    def grow(self, num_rows: int) -> None:
        """Grow to `num_rows` rows (never shrinks); `on_grow` resizes the tensors."""
        if num_rows <= self.num_rows:
            return
        self._free.extend([True] * (num_rows - self.num_rows))
        self._num_free += num_rows - self.num_rows
        self.num_rows = num_rows
        if self.on_grow is not None:
            self.on_grow(num_rows)

    def release(self, start: int, count: int = 1) -> None:
        """Free rows `start .. start + count - 1` (a sequence finished, was preempted or reset)."""
        if not 0 <= start <= start + count <= self.num_rows:
            raise ValueError(f"rows {start}..{start + count - 1} are outside the pool of {self.num_rows}")
        for row in range(start, start + count):
            if self._free[row]:
                raise ValueError(f"state row {row} is already free")
            self._free[row] = True
            self.pending_copies.pop(row, None)
        self._num_free += count

    def copy_later(self, src: int, dst: int) -> None:
        """Make the next step copy row `src` into row `dst` before its forward (`pending_copies`); `src`
        itself waiting for a copy is read from that copy's source."""
        self.pending_copies[dst] = self.pending_copies.get(src, src)

    def take_copies(self) -> list[tuple[int, int]]:
        """The pending copies as (src, dst) pairs, handed to the step being built (and forgotten here)."""
        copies, self.pending_copies = [(src, dst) for dst, src in self.pending_copies.items()], {}
        return copies

    def _find_run(self, count: int, from_top: bool = False) -> int | None:
        run = 0
        rows = range(self.num_rows - 1, -1, -1) if from_top else range(self.num_rows)
        for row in rows:
            run = run + 1 if self._free[row] else 0
            if run == count:
                return row if from_top else row - count + 1
        return None

    # ------------------------------------------------------------------ checkpoints
    def reserve_checkpoint(self) -> int | None:
        """A row to copy a checkpoint into (not yet findable: `publish` it once the step commits, or
        `cancel` it); None when checkpoints are off, or when `max_checkpoints` are kept or reserved and
        none can be evicted. Never grows the rows: checkpoints stay within their bound."""
        if self._num_reserved >= self.max_checkpoints:
            return None
        if len(self._checkpoints) + self._num_reserved >= self.max_checkpoints:
            self._evict_oldest()
        start = self._find_run(1, from_top=True)
        if start is None and self._checkpoints:
            self._evict_oldest()
            start = self._find_run(1, from_top=True)
        if start is None:
            return None
        self._free[start] = False
        self._num_free -= 1
        self._num_reserved += 1
        return start

    def cancel(self, row: int) -> None:
        """Free a reserved checkpoint row that will not be published (its step failed, or its block did
        not make it into the prefix cache)."""
        self._num_reserved -= 1
        self.release(row)

    def publish(self, key: Hashable, row: int) -> None:
        """Make reserved checkpoint `row` findable under `key` (a block hash); a key already published
        keeps its row and `row` is freed."""
        self._num_reserved -= 1
        if key in self._checkpoints:
            self._checkpoints.move_to_end(key)
            self.release(row)
            return
        self._checkpoints[key] = row

    def lookup(self, key: Hashable) -> int | None:
        """The checkpoint row under `key` (marked most recently used), or None."""
        row = self._checkpoints.get(key)
        if row is not None:
            self._checkpoints.move_to_end(key)
        return row

    def has(self, key: Hashable) -> bool:
        return key in self._checkpoints

    def drop(self, key: Hashable) -> None:
        """Forget the checkpoint under `key` (its block left the prefix cache); no-op when absent."""
        row = self._checkpoints.pop(key, None)
        if row is not None:
            self.release(row)

    def drop_all(self) -> None:
        """Forget every checkpoint (the prefix cache was reset)."""
        for key in list(self._checkpoints):
            self.drop(key)

    def _evict_oldest(self) -> None:
        _, row = self._checkpoints.popitem(last=False)
        self.release(row)


# ---------------------------------------------------------------------------------- per sequence
def assign_row(slots: StateSlots, seq) -> None:
    """Give `seq` (a `KVSequence`) a state row if it has none (admission)."""
    if seq.state_row is None:
        seq.state_row = slots.allocate(1)


def release_rows(slots: StateSlots, seq) -> None:
    """Free every row `seq` holds: its state, its snapshots and checkpoints not yet written (it
    finished, was preempted or reset)."""
    if seq.state_row is not None:
        slots.release(seq.state_row)
    for row in seq.state_snapshots.values():
        slots.release(row)
    for _, row in seq.state_checkpoints:
        slots.cancel(row)
    seq.state_row = None
    seq.state_saves, seq.state_snapshots, seq.state_checkpoints = [], {}, []


def plan_chunk(slots: StateSlots, seq, start: int, num_new: int, num_drafts: int, block_size: int) -> None:
    """Decide what a step computing tokens `start .. start + num_new - 1` of `seq` copies out of its state
    row (`seq.state_saves`): after each token but the last of a chunk that verifies drafts, a
    snapshot (a rejected draft rolls the state back to one, `settle`); else, at every checkpoint
    boundary the chunk crosses whose block is hashed and not yet checkpointed, a checkpoint row
    (`seq.state_checkpoints`, published when the step commits). Snapshots left from an earlier step are
    freed first."""
    for row in seq.state_snapshots.values():
        slots.release(row)
    seq.state_saves, seq.state_snapshots = [], {}
    if num_drafts:
        for k in range(1, num_new):
            row = slots.allocate(1, from_top=True)
            seq.state_saves.append((k, row))
            seq.state_snapshots[start + k] = row
        return
    if not slots.max_checkpoints:
        return
    interval = slots.interval
    # Nearest the chunk's end first: with more boundaries than checkpoints may be kept, the later ones
    # (a long shared prefix's end) are the likelier hits.
    for boundary in reversed(range((start // interval + 1) * interval, start + num_new + 1, interval)):
        index = boundary // block_size - 1
        if index >= len(seq.block_hashes):
            continue  # not hashed (prefix caching off for it, or an unknown token)
        key = seq.block_hashes[index]
        if slots.has(key):
            continue
        row = slots.reserve_checkpoint()
        if row is None:
            break
        seq.state_saves.append((boundary - start, row))
        seq.state_checkpoints.append((key, row))
    seq.state_saves.reverse()
    seq.state_checkpoints.reverse()


def settle(slots: StateSlots, seq, computed: int, kept: int) -> bool:
    """A step computed `seq` up to `computed` tokens and it keeps `kept` of them (rejected drafts
    dropped). Returns whether its state row now holds the state after `kept` tokens: True when it
    keeps everything or a snapshot was taken there (that row becomes its state row); False otherwise
    (the caller recomputes the sequence). Every other snapshot is freed."""
    ok = kept == computed
    if not ok and kept in seq.state_snapshots:
        row = seq.state_snapshots.pop(kept)
        slots.release(seq.state_row)
        seq.state_row, ok = row, True
    for row in seq.state_snapshots.values():
        slots.release(row)
    seq.state_snapshots = {}
    return ok


def restore_point(slots: StateSlots, block_hashes, num_blocks: int, block_size: int) -> int:
    """The most of the first `num_blocks` hashed blocks a prefix-cache hit may take when the state must
    be restored at its end: the last boundary at or before them whose checkpoint is kept (0: none)."""
    for k in range(num_blocks, 0, -1):
        if (k * block_size) % slots.interval == 0 and slots.has(block_hashes[k - 1]):
            return k
    return 0
