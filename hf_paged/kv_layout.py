"""KV groups and the storage layout: which layers share a block table, where each layer's K/V lives
inside a block, and how many blocks a group holds for one sequence. Torch-free arithmetic, so that the
block manager, the cache and the planner count with the same rule (`config` re-exports every name).

Layers whose specs (`kv_spec`) have equal `group_key` (the same kind, window or chunk, and K/V shape)
form one kind; each group keeps its own block table per sequence. A full group keeps every token. A
sliding or chunked group keeps only what a query that can still come may read: every leading block
before `spec.first_readable(num_tokens, lookback)` is freed, so during a step that writes `c` new
tokens it holds the blocks of `spec.max_tokens_held(c, lookback)` tokens at most (`blocks_held`, the
one equation the cache and the planner share). A `SharedKV` layer (Gemma 3n/4 "reuse") joins no
group: it reads its source's blocks, so its `layer_group` / `layer_slot` / offsets are its source's.

Block tables and storage (`kv_layout`): the pool is one pool of block ids shared by every group
(vLLM's hybrid allocator), so one byte budget serves whatever mix of long and short requests comes.
For that, a block id must mean the same bytes in every group: the layers of each kind are split into
groups of equal bytes per token (the page), and the i-th layer of a group stores its K/V in slot i of
the block. One block is then one page per token, whichever group holds it:

    gemma3-style, 24 layers, full at 5 11 17 23, one K/V shape -> groups of S = 4 layers:
        group 0 (sliding) layers  0  1  2  3      slot 0  slot 1  slot 2  slot 3
        group 1 (sliding) layers  4  6  7  8        |       |       |       |
        group 2 (full)    layers  5 11 17 23     one [num_blocks, block_size, heads, dim] tensor per slot
        groups 3-5 (sliding)  9 10 12 13 / 14 15 16 18 / 19 20 21 22
    block 7 in group 2's table: slot tensors [7] hold layers 5, 11, 17, 23;
    block 7 in group 0's table instead: the same bytes hold layers 0, 1, 2, 3.

The page size (elements of K and V per token) is the bytes of the rarest kind: `P = max(min over
kinds of layers * elements_per_token, max elements_per_token)`, and a group of a kind whose layers
cost `e` elements per token holds `P // e` layers. With one K/V shape for every layer this is S =
the layer count of the rarest kind, as above (`uniform_shape`: one contiguous tensor per slot). With
per-layer shapes the slots differ in size, so a block is a row of one page buffer per K and V and each
layer a strided view at its element offset (`layer_offset_k`), balanced by bytes, not layer count:

    gemma4-31b-style, 60 layers: 10 full of 4 heads x 512, 50 sliding of 16 heads x 256 ->
        P = min(10 * 4096, 50 * 8192) = 40,960 elements per token, K and V (page_k = page_v = 20,480)
        group of the 10 full layers: K at offsets 0, 2048, ..., 18432 of the page (2,048 each)
        10 groups of 5 sliding layers: K at offsets 0, 4096, ..., 16384 (4,096 each)
        page_buffer_k [num_blocks, block_size * page_k]; a layer's K:
            page_buffer_k[:, bs * off : bs * (off + h * d)].view(num_blocks, bs, h, d)

A kind whose layer count does not fill its last group leaves that group's tail unused
(`num_padding_slots`); a kind whose elements per token do not divide the page leaves `P - (P // e)
* e` elements of each of its groups' pages unused; both are counted in `num_padding_elements`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .kv_spec import (FULL, SLIDING, FullAttention, LayerSpec, LinearState, NoCache, SharedKV, SlidingWindow,
                      check_counts, keeps_kv_elsewhere)

# What the layout functions take per layer: a spec, or (the older form) a sliding window / None (full).
SpecLike = LayerSpec | int | None


def as_spec(value: SpecLike, layer: int | None = None) -> LayerSpec:
    """A layer's spec from a spec, or from a sliding window (a positive int) or None (full attention).

    Raises:
        ValueError: a window that is not a positive integer.
    """
    if isinstance(value, LayerSpec):
        return value
    if value is None:
        return FullAttention()
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        where = "" if layer is None else f"layer {layer}: "
        raise ValueError(f"{where}sliding window must be a positive integer or None, got {value!r}")
    return SlidingWindow(window=value)


def as_specs(layers: Sequence[SpecLike]) -> tuple[LayerSpec, ...]:
    """`as_spec` of every layer."""
    return tuple(as_spec(value, i) for i, value in enumerate(layers))


def window_of(spec: LayerSpec) -> int | None:
    """The sliding window of a full (None) or sliding spec, for callers that know no other kind.

    Raises:
        ValueError: a chunked (or any other) kind, whose reach is not a window: read its spec.
    """
    if spec.kind == FULL:
        return None
    if spec.kind == SLIDING:
        return spec.window
    raise ValueError(f"a {spec.kind} group has no sliding window ({spec.mask}); read its spec "
                     "(KVLayout.group_specs / BlockManager.group_specs) instead of `windows`")


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table.

    Attributes:
        layers: the layer indices, ascending.
        spec: what every layer of the group keeps (`kv_spec`); a sliding window (int) or None (full
            attention) is taken as its spec.
    """

    layers: tuple[int, ...]
    spec: LayerSpec = field(default_factory=FullAttention)

    def __post_init__(self):
        object.__setattr__(self, "spec", as_spec(self.spec))

    @property
    def sliding_window(self) -> int | None:
        """The group's sliding window, None for full attention (ValueError for a chunked group)."""
        return window_of(self.spec)


def kv_groups(layer_specs: Sequence[SpecLike]) -> list[KVGroup]:
    """Group the layers that store K/V by `spec.group_key`, in order of each key's first layer
    (`SharedKV` layers join no group).

    Args:
        layer_specs: per layer, its spec, or its sliding window (a positive int) or None (full).

    Raises:
        ValueError: a window that is not a positive integer.
    """
    order: dict[tuple, list[int]] = {}
    first: dict[tuple, LayerSpec] = {}
    for layer, spec in enumerate(as_specs(layer_specs)):
        if spec.owns_kv:
            order.setdefault(spec.group_key, []).append(layer)
            first.setdefault(spec.group_key, spec)
    return [KVGroup(tuple(layers), first[key]) for key, layers in order.items()]


@dataclass(frozen=True)
class KVLayout:
    """Which block table, storage slot and page offset each layer uses (see the module docstring).

    Attributes:
        groups: the block-table groups; `groups[g].layers` are in slot order.
        layer_group: per layer, its group index (a `SharedKV` layer: its source's).
        layer_slot: per layer, its storage slot in its group (a `SharedKV` layer: its source's).
        layer_specs: per layer, its spec (as given; `SlidingWindow` / `FullAttention` without a shape
            for a layout built from windows).
        layer_offset_k, layer_offset_v: per layer, the element offset per token of its K (V) inside
            its group's page (a `SharedKV` layer: its source's); empty when the shapes are unknown.
        page_k, page_v: elements per token of one block's K (V) page: the largest group's; None when
            the shapes are unknown (a layout built from windows).
    """

    groups: tuple[KVGroup, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    layer_specs: tuple[LayerSpec, ...] = ()
    layer_offset_k: tuple[int, ...] = ()
    layer_offset_v: tuple[int, ...] = ()
    page_k: int | None = None
    page_v: int | None = None

    @property
    def num_slots(self) -> int:
        """Layers of the largest group (with `uniform_shape`, the slot tensors to allocate)."""
        return max((len(g.layers) for g in self.groups), default=0)

    @property
    def group_specs(self) -> tuple[LayerSpec, ...]:
        """Per group, its spec: what it frees (`first_readable`) and how long its tables grow."""
        return tuple(g.spec for g in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per group, its sliding window or None (full attention), for callers that know only those.

        Raises:
            ValueError: a chunked group (a chunk is not a window: read `group_specs`).
        """
        return tuple(window_of(spec) for spec in self.group_specs)

    @property
    def uniform_shape(self) -> bool:
        """Whether every layer that stores K/V has one shape (or none is known): one contiguous
        [num_blocks, block_size, heads, dim] tensor per slot serves, as before per-layer shapes."""
        return len({g.spec.shape for g in self.groups}) <= 1

    @property
    def num_padding_slots(self) -> int:
        """Slots the groups leave unused (a kind's last group short of layers); uniform shapes only
        count in slots, see `num_padding_elements` for per-layer shapes."""
        return sum(self.num_slots - len(g.layers) for g in self.groups)

    @property
    def num_padding_elements(self) -> int:
        """Elements per token of K and V pages that no layer of the holding group uses, summed over
        the groups (what a block held by every group at once wastes; 0 without known shapes)."""
        if self.page_k is None:
            return 0
        page = self.page_k + self.page_v
        return sum(page - len(g.layers) * g.spec.kv_elements_per_token for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Whether some group frees blocks (sliding or chunked): False when every group keeps all."""
        return any(spec.reach is not None for spec in self.group_specs)

    def bytes_per_block(self, block_size: int, itemsize: int) -> int:
        """Bytes of one block's K and V storage as allocated, scales of a quantised cache aside
        (`config.kv_bytes_per_block` adds them): block_size * (page_k + page_v) * itemsize; with
        `uniform_shape`, num_slots * one slot's bytes.

        Raises:
            ValueError: the layout was built from windows alone (no shapes), or bad sizes.
        """
        check_counts(block_size=block_size, itemsize=itemsize)
        if self.page_k is None:
            raise ValueError("this KV layout was built from windows alone: its layers' K/V shapes are unknown; "
                             "build it from kv_spec.layer_specs")
        return block_size * (self.page_k + self.page_v) * itemsize


def kv_layout(layer_specs: Sequence[SpecLike], *, enable_hybrid_kv: bool = True) -> KVLayout:
    """Split the layers into block-table groups of equal bytes per token (see the module docstring).

    Args:
        layer_specs: per layer, its spec (`kv_spec.layer_specs`), or its sliding window / None.
        enable_hybrid_kv: False: every group keeps every token (grouped as full attention by shape;
            each layer's mask stays its own spec's, in `layer_specs`).

    Raises:
        ValueError: a window that is not a positive integer, a `SharedKV` layer whose source does not
            store K/V or keeps fewer tokens than it reads, or shapes known for some layers only.
    """
    specs = as_specs(layer_specs)
    grouping = specs if enable_hybrid_kv else tuple(FullAttention(s.shape) if s.owns_kv else s for s in specs)
    _check_sources(grouping)
    kinds = kv_groups(grouping)
    if not kinds:
        return KVLayout((), (), (), specs)
    known = {g.spec.shape is not None for g in kinds}
    if len(known) > 1:
        raise ValueError("some layers that store K/V have a K/V shape and others none: give every layer its "
                         "shape (kv_spec.layer_specs) or none (windows alone)")
    sizes = [g.spec.kv_elements_per_token or 1 for g in kinds]  # unknown shapes: all alike
    page = max(min(len(g.layers) * e for g, e in zip(kinds, sizes)), max(sizes))
    groups = [KVGroup(g.layers[i : i + page // e], g.spec) for g, e in zip(kinds, sizes)
              for i in range(0, len(g.layers), page // e)]
    groups.sort(key=lambda g: g.layers[0])  # group 0 holds layer 0: a one-kind model is one group
    n = len(specs)
    layer_group, layer_slot = [0] * n, [0] * n
    offset_k, offset_v = [0] * n, [0] * n
    page_k = page_v = 0
    for g, group in enumerate(groups):
        shape = group.spec.shape
        v = shape.num_kv_heads * shape.head_dim_v if shape else 0
        k = group.spec.kv_elements_per_token - v if shape else 0  # a latent row's K page: latent and indexer key
        for slot, layer in enumerate(group.layers):
            layer_group[layer], layer_slot[layer] = g, slot
            offset_k[layer], offset_v[layer] = slot * k, slot * v
        page_k, page_v = max(page_k, len(group.layers) * k), max(page_v, len(group.layers) * v)
    for layer, spec in enumerate(specs):
        if keeps_kv_elsewhere(spec):
            s = spec.source
            layer_group[layer], layer_slot[layer] = layer_group[s], layer_slot[s]
            offset_k[layer], offset_v[layer] = offset_k[s], offset_v[s]
    if True in known:
        return KVLayout(tuple(groups), tuple(layer_group), tuple(layer_slot), specs, tuple(offset_k),
                        tuple(offset_v), page_k, page_v)
    return KVLayout(tuple(groups), tuple(layer_group), tuple(layer_slot), specs)


def _check_sources(specs: Sequence[LayerSpec]) -> None:
    """Every `SharedKV` layer reads a layer that stores K/V of its shape and keeps what it reads."""
    for layer, spec in enumerate(specs):
        if spec.owns_kv or isinstance(spec, (LinearState, NoCache)):
            continue  # a state or cache-free layer (`kv_spec.LinearState`, `NoCache`) reads no K/V
        if not isinstance(spec, SharedKV):
            raise ValueError(f"layer {layer}: a layer that stores no K/V must say whose it reads (kv_spec.SharedKV)")
        if not 0 <= spec.source < len(specs) or not specs[spec.source].owns_kv:
            raise ValueError(f"layer {layer} reads the K/V of layer {spec.source}, which stores none")
        source = specs[spec.source]
        if spec.shape is not None and source.shape is not None and spec.shape != source.shape:
            raise ValueError(f"layer {layer} reads layer {spec.source}'s K/V as {spec.shape}, but it stores "
                             f"{source.shape}")
        if source.reach is not None and (spec.reads.kind, spec.reads.mask) != (source.kind, source.mask):
            raise ValueError(f"layer {layer} reads layer {spec.source}'s K/V with {spec.reads.kind} "
                             f"{spec.reads.mask}, but that layer's group keeps only what {source.kind} "
                             f"{source.mask} reads")


# ---------------------------------------------------------------------------------------- the equation
def first_readable_position(num_tokens: int, spec: SpecLike, lookback: int = 0) -> int:
    """The earliest token position a query that can still come may read (`spec.first_readable`; a
    window or None is taken as its spec)."""
    return as_spec(spec).first_readable(num_tokens, lookback)


def num_freeable_blocks(num_tokens: int, spec: SpecLike, block_size: int, lookback: int = 0) -> int:
    """Leading blocks of a sequence's table whose tokens no query that can still come reads."""
    check_counts(block_size=block_size)
    return first_readable_position(num_tokens, spec, lookback) // block_size


def blocks_held(num_tokens: int, spec: SpecLike, block_size: int, lookback: int = 0, new_tokens: int = 0) -> int:
    """Blocks a group holds for one sequence of `num_tokens` stored tokens while a step writes
    `new_tokens` more: everything for full attention, else the blocks covering positions
    `first_readable(num_tokens) .. num_tokens + new_tokens - 1`."""
    check_counts(new_tokens=new_tokens, block_size=block_size)
    total = -(-(num_tokens + new_tokens) // block_size)
    return total - num_freeable_blocks(num_tokens, spec, block_size, lookback)


def max_blocks_held(spec: SpecLike, num_tokens: int, block_size: int, new_tokens: int | None = None,
                    lookback: int = 0) -> int:
    """The most blocks a group of `spec` holds for one sequence that grows to `num_tokens` tokens,
    no step writing more than `new_tokens` (None: one step may write everything): full attention
    all of them, a sliding or chunked group `spec.max_tokens_held(new_tokens, lookback)` tokens plus
    one block (a window or chunk need not start on a block boundary), a `SharedKV` layer none."""
    check_counts(num_tokens=num_tokens, block_size=block_size, lookback=lookback)
    spec = as_spec(spec)
    blocks = -(-num_tokens // block_size)
    if not spec.owns_kv:
        return 0
    if new_tokens is not None:
        held = spec.max_tokens_held(new_tokens, lookback)
        if held is not None:
            blocks = min(blocks, -(-held // block_size) + 1)
    return blocks
