"""`KVSequence`: which tokens of one sequence have K/V in the cache, and in which blocks.

Plain data, torch-free. The block manager (`block_pool.py`) is the only writer of its block table and
hashes; the scheduler and the cache adapter read them. It must not know about tensors or requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVSequence:
    """The tokens of one sequence whose K/V live in the cache, and where they live.

    Attributes:
        seq_id: caller-chosen id, unique among live sequences.
        token_ids: tokens whose K/V are stored, in order. Padding is never stored.
        block_table: physical block ids; token `i` lives in `block_table[i // block_size]`
            at offset `i % block_size`.
        block_hashes: chained content hash of each full block, in order (prefix caching).
        extra_key: salt mixed into every block hash (adapter, weights version, user salt).
        is_cacheable: False once tokens of unknown identity were stored (a forward fed
            `inputs_embeds`): its blocks are then never hashed, so they can never be shared wrongly.
        prefix_epoch: the pool's prefix-cache epoch when the sequence first stored tokens.
    """

    seq_id: int
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    extra_key: object = None
    is_cacheable: bool = True
    prefix_epoch: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def last_block_hash(self) -> int | None:
        return self.block_hashes[-1] if self.block_hashes else None
