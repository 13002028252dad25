"""KV groups and the sliding-window rule: which layers share a block table, and which blocks a
sliding-window group may drop (the first, torch-free piece of hybrid KV memory, issue 15).

Layers with the same attention type (full attention, or a sliding window of `w` tokens) form one
group; each group will keep its own block table per sequence. A full group keeps every token. A
sliding group keeps only what a query that can still come may read:

    a query at position p reads keys p - w + 1 .. p
    the next query sits at position >= num_tokens - lookback
        (lookback: tokens a step may roll back, e.g. rejected speculative drafts)
    => keys before  first_readable = num_tokens - lookback - w + 1  are never read again

so every leading block whose tokens all lie before `first_readable` can be freed. During a step that
writes `c` new tokens, its first query reads back `w - 1` tokens before them: the group holds the
blocks of the last `w - 1 + c + lookback` tokens at most, which `blocks_held` counts (the one
equation the cache and the planner will share). Nothing here is wired into the cache yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table.

    Attributes:
        layers: the layer indices, ascending.
        sliding_window: tokens each query sees (transformers' `sliding_window`), or None for full
            attention.
    """

    layers: tuple[int, ...]
    sliding_window: int | None = None


def kv_groups(layer_windows: Sequence[int | None]) -> list[KVGroup]:
    """Group layers by window, in order of each window's first layer.

    Args:
        layer_windows: per layer, its sliding window (a positive int) or None (full attention).

    Raises:
        ValueError: a window that is not a positive integer.
    """
    order: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"layer {layer}: sliding window must be a positive integer or None, got {window!r}")
        order.setdefault(window, []).append(layer)
    return [KVGroup(tuple(layers), window) for window, layers in order.items()]


def first_readable_position(num_tokens: int, window: int | None, lookback: int = 0) -> int:
    """The earliest token position a query that can still come may read (0 for full attention)."""
    _check_counts(num_tokens=num_tokens, lookback=lookback)
    if window is None:
        return 0
    return max(0, num_tokens - lookback - window + 1)


def num_freeable_blocks(num_tokens: int, window: int | None, block_size: int, lookback: int = 0) -> int:
    """Leading blocks of a sequence's table whose tokens no query that can still come reads."""
    _check_counts(block_size=block_size)
    return first_readable_position(num_tokens, window, lookback) // block_size


def blocks_held(num_tokens: int, window: int | None, block_size: int, lookback: int = 0,
                new_tokens: int = 0) -> int:
    """Blocks a group holds for one sequence of `num_tokens` stored tokens while a step writes
    `new_tokens` more: everything for full attention, else the blocks covering positions
    `first_readable(num_tokens) .. num_tokens + new_tokens - 1`."""
    _check_counts(new_tokens=new_tokens, block_size=block_size)
    total = -(-(num_tokens + new_tokens) // block_size)
    return total - num_freeable_blocks(num_tokens, window, block_size, lookback)


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        minimum = 1 if name == "block_size" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
