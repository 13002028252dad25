"""`KVSequence`: which tokens of one sequence have K/V in the cache, and in which blocks.

Plain data, torch-free. The block manager (`block_pool.py`) is the only writer of its block table and
hashes; the scheduler and the cache adapter read them. It must not know about tensors or requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .rope import LengthRope

NULL_BLOCK = -1  # a table entry whose block no query reads any more (released; never a valid id)


@dataclass
class KVSequence:
    """The tokens of one sequence whose K/V live in the cache, and where they live.

    Attributes:
        seq_id: caller-chosen id, unique among live sequences.
        token_ids: tokens whose K/V are stored, in order. Padding is never stored.
        block_tables: one table of physical block ids per KV group (`config.kv_layout`); token `i`
            of a layer in group `g` lives in `block_tables[g][i // block_size]` at offset
            `i % block_size`. A sliding or chunked group's table starts with `num_released[g]` entries
            `NULL_BLOCK`: blocks no query can read any more, given back to the pool.
        num_released: per group, how many leading table entries are `NULL_BLOCK`.
        block_hashes: chained content hash of each full block, in order (prefix caching); one
            chain for every group, since every group stores the same tokens.
        extra_key: salt mixed into every block hash (adapter, weights version, user salt).
        mm_spans: `(start, end, digest)` of each non-text input whose content feeds positions
            `start .. end - 1` (an image's placeholders): a block overlapping a span is hashed with
            its digest too, so that blocks whose ids are equal but whose images differ never match
            (later blocks differ through the chain).
        is_cacheable: False once tokens of unknown identity were stored (a forward fed
            `inputs_embeds`): its blocks are then never hashed, so they can never be shared wrongly.
        prefix_epoch: the pool's prefix-cache epoch when the sequence first stored tokens.
        rope: for a model whose rotary frequencies follow the length (`rope.LengthRope`), what each
            token was computed for; a block whose keys are not at the original frequencies is hashed
            with that too. None for every other model.
        state_row: for a model with recurrent layers, the row of the state pool that holds this
            sequence's state after its `num_tokens` tokens (`state_slots.StateSlots`); None otherwise or
            before admission.
        state_saves: this step's copies of its state: (tokens into its chunk, row) pairs, ascending;
            checkpoints and speculative snapshots. Set by the scheduler per step.
        state_snapshots: rows holding its state after a given number of tokens (speculative
            verification keeps one per draft), {num_tokens: row}, until the step's tokens are settled.
        state_checkpoints: checkpoints this step writes, (block hash, row), published when it commits.
    """

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_released: list[int] = field(default_factory=lambda: [0])
    block_hashes: list[int] = field(default_factory=list)
    extra_key: object = None
    mm_spans: tuple = ()
    is_cacheable: bool = True
    prefix_epoch: int | None = None
    rope: LengthRope | None = None
    state_row: int | None = None
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    state_snapshots: dict[int, int] = field(default_factory=dict)
    state_checkpoints: list[tuple[int, int]] = field(default_factory=list)

    def block_key(self, index: int, block_size: int) -> object:
        """The salt of block `index`'s hash: `extra_key`, with the digests of the spans it overlaps and
        the frequencies its keys were rotated with where those follow the length."""
        if not self.mm_spans and self.rope is None:
            return self.extra_key
        lo, hi = index * block_size, (index + 1) * block_size
        key = self.extra_key
        digests = tuple(d for start, end, d in self.mm_spans if start < hi and end > lo)
        if digests:
            key = (key, digests)
        salt = self.rope.block_salt(lo, hi) if self.rope is not None else None
        return key if salt is None else (key, salt)

    @property
    def block_table(self) -> list[int]:
        """The first group's table (the only one of a model with one attention type)."""
        return self.block_tables[0]

    def live_blocks(self):
        """Every block the sequence holds, group by group (NULL_BLOCK entries skipped)."""
        for table, released in zip(self.block_tables, self.num_released):
            yield from table[released:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_block_hash(self) -> int | None:
        return self.block_hashes[-1] if self.block_hashes else None
