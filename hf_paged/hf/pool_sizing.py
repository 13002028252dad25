"""How large the KV pool of a `PagedCache` may grow, and by how much it grows.

Pure arithmetic over block counts and the `PagedCacheConfig` limits (`num_blocks`, a fixed pool;
`max_kv_bytes`, a growth budget; neither, unbounded). The cache asks `growth_target` when a step
needs more free blocks than it has, then resizes its tensors itself; nothing here allocates.
"""

from __future__ import annotations

from ..config import PagedCacheConfig
from ..core import NoFreeBlocksError

GROWTH_FACTOR = 1.25  # amortises pool reallocation; the pool is at most this much larger than needed


def max_num_blocks(cache_config: PagedCacheConfig, bytes_per_block: int) -> int | None:
    """The most blocks the pool may ever hold (None: no limit)."""
    if cache_config.num_blocks is not None:
        return cache_config.num_blocks
    if cache_config.max_kv_bytes is not None:
        return max(cache_config.max_kv_bytes // bytes_per_block, 0)
    return None


def limit_reason(cache_config: PagedCacheConfig) -> str:
    if cache_config.num_blocks is not None:
        return f"num_blocks={cache_config.num_blocks}"
    return f"max_kv_bytes={cache_config.max_kv_bytes}"


def growth_target(*, num_blocks: int, num_free_blocks: int, num_needed: int, seq_totals: list[int],
                  block_size: int, limit: int | None, reason: str, seq_blocks: list[int] | None = None) -> int:
    """The pool size (in blocks) that gives a step its `num_needed` free blocks.

    Args:
        seq_totals: per sequence of the step, the tokens it holds after the step.
        seq_blocks: per sequence, the blocks it holds during the step, every KV group counted
            (default: one group, `ceil(total / block_size)`).
        limit, reason: from `max_num_blocks` / `limit_reason`.

    Raises:
        ValueError: one sequence alone needs more blocks than the pool may ever hold.
        NoFreeBlocksError: the pool at its limit has too few free blocks right now.
    """
    if limit is not None:
        for total, blocks in zip(seq_totals, seq_blocks or [-(-t // block_size) for t in seq_totals]):
            if blocks > limit:
                raise ValueError(
                    f"a sequence of {total} tokens needs {blocks} blocks of {block_size} tokens, but the "
                    f"KV pool holds at most {limit} ({reason}); raise it or shorten the prompt"
                )
    target = max(num_blocks + num_needed - num_free_blocks, int(num_blocks * GROWTH_FACTOR))
    if limit is not None:
        target = min(target, limit)
    if target - num_blocks + num_free_blocks < num_needed:
        raise NoFreeBlocksError(
            f"KV pool is full: this step needs {num_needed} free blocks, {num_free_blocks} of "
            f"{num_blocks} are free and the pool cannot grow ({reason})"
        )
    return target
