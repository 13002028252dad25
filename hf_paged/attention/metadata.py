"""One `StepMetadata` per forward step: everything the attention layers need, built once.

transformers hands attention a padded batch `[batch, heads, q_len, head_dim]`; the kernels work on
packed, variable-length tokens. The metadata carries both views: the packed varlen description
(`cu_seqlens_q`, `seq_lens`, `block_tables`, `slot_mapping`) and `token_index`, which says where each
real (non-padding) token sits in the padded batch. Built on the host from plain lists (the block
manager's answers) and copied to the device asynchronously (`host_to_device`), so building a step
never waits for the device; it decides nothing about which block holds what.

    padded batch (q_len=4)         packed real tokens           token_index
    row 0: [pad pad  a0  a1]  -->  [a0 a1 | b0 b1 b2 b3 | c0]   [2 3 | 4 5 6 7 | 11]
    row 1: [ b0  b1  b2  b3]       cu_seqlens_q = [0, 2, 6, 7]
    row 2: [pad pad pad  c0]

The engine's steps are already packed: transformers sees one row `[1, num_tokens]` holding every
scheduled sequence back to back (`build_packed_metadata`), so `batch_size` is 1 while
`cu_seqlens_q`, `seq_lens` and `block_tables` describe the sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..kv_spec import MaskRule

PAGED = "paged"  # attention reads K/V straight from the blocks (the "hf_paged" attention)
DENSE = "dense"  # update() returns gathered [batch, kv_heads, kv_len, head_dim] K/V (sdpa/eager)


@dataclass
class StepMetadata:
    """The per-step plan shared by every layer of one forward.

    Attributes:
        mode: PAGED or DENSE (see module constants).
        batch_size: rows of the padded batch (1 for a packed engine step).
        q_len: columns of the padded batch in this step.
        Per-sequence fields have one row per sequence: a padded batch row, or a packed sequence.
        num_columns: columns (padding included) the cache covers after this step; what transformers
            sees as the cache length.
        cu_seqlens_q: [batch_size + 1] int32, prefix sums of real new tokens per row.
        seq_lens: [batch_size] int32, tokens stored per row after this step.
        block_tables: [batch_size, max_blocks] int32, padded with 0 past each row's blocks.
        slot_mapping: [num_tokens] int64, slot per packed real token; -1 where the block came from
            the prefix cache and already holds it.
        token_index: [num_tokens] int64 index into the flattened padded batch (`row * q_len + col`),
            or None when the step has no padding (packed == padded).
        num_padding: [batch_size] int64, leading padding columns per row after this step (DENSE only).
        copies: (src_block, dst_block) copy-on-write pairs the cache applies before writing.
        max_seqlen_q, max_seqlen_k: maxima of the per-row query and KV lengths.
        has_skipped_slots: whether `slot_mapping` holds any -1 (known on the host when it is built,
            so that writing the K/V needs no check per layer).
        group_block_tables, group_slot_mapping: the same per KV group (`config.kv_layout`):
            sliding-window layers have their own tables, whose leading released entries read as the
            row's first held block: finite K/V of the same sequence, masked out by the window (the
            Triton kernels start at the window rounded down to their tile, so they may load a
            released entry's block; the torch path gathers it; both give it weight exactly 0). `block_tables` / `slot_mapping` are group 0's.
        layer_group: per layer, its group (None: one group). A layer that reads another layer's K/V
            (`kv_spec.SharedKV`, Gemma 3n/4) is in its source's group.
        group_masks: per group, the `kv_spec.MaskRule` its blocks are kept for (window: the last
            `window` tokens; chunk: the current chunk; neither: every token). None: full attention.
        layer_masks: per layer, the `MaskRule` its attention applies (its own kind, even when the
            blocks are kept for more, as with `enable_hybrid_kv=False`); None: each layer's group's.
            Llama 4 passes its attention no chunk: this is where the chunk comes from.
        layer_source: per layer, the layer whose K/V it reads (itself unless `SharedKV`); None: itself.
        key_limits: [num_tokens] int64, the last key position each packed token may see: its own
            position (causal), or further for tokens that attend both ways (the placeholders of one
            Gemma 3 image, all in this step). None: every token is causal. Only the torch backend
            reads it (`dispatch.plan` picks torch for such a step).
    """

    mode: str
    batch_size: int
    q_len: int
    num_columns: int
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    token_index: torch.Tensor | None
    num_padding: torch.Tensor | None
    copies: list[tuple[int, int]]
    max_seqlen_q: int
    max_seqlen_k: int
    has_skipped_slots: bool = True
    group_block_tables: tuple[torch.Tensor, ...] = ()
    group_slot_mapping: tuple[torch.Tensor, ...] = ()
    layer_group: tuple[int, ...] | None = None
    group_masks: tuple[MaskRule, ...] | None = None
    layer_masks: tuple[MaskRule, ...] | None = None
    layer_source: tuple[int, ...] | None = None
    key_limits: torch.Tensor | None = None
    active_layer: int | None = None  # the layer whose K/V the cache stored last (its attention runs next)
    # A packed step's recurrent-layer plan (`hf.state.StateStep`: rows, saves, restores); None otherwise.
    state: object = None
    layers_done: set[int] = field(default_factory=set)
    # Quantised layers' scales (`kv_quant.KVScales`) by layer index: layers of different KV groups share
    # one storage slot's payload tensor, so the tensor cannot name the layer.
    kv_scales: dict = field(default_factory=dict)
    dense_index: dict = field(default_factory=dict)  # DENSE, per group: (slots, valid), [batch, num_columns]
    # The step's attention plan (`plan.StepPlan`: backend, launch plans, scratch), made by the cache
    # when the step begins (`dispatch.plan`); None until then.
    plan: object = field(default=None, repr=False)
    # `last_columns` views of this step, by column count; and, on such a view, the step it was made from.
    _last: dict = field(default_factory=dict, repr=False)
    _parent: object = field(default=None, repr=False)

    @property
    def parent(self) -> "StepMetadata":
        """The step the model's forward runs (itself, unless this is a `last_columns` view of it)."""
        return self if self._parent is None else self._parent

    def last_columns(self, num: int) -> "StepMetadata":
        """The step as layers see it that run on the last `num` columns of the padded batch only (Gemma 4
        drops every query but those it returns logits for, `logits_to_keep`, in its KV-sharing layers,
        which read K/V and write none). Rows are left-padded, so a row keeps its last min(its new
        tokens, num) queries; K/V, tables and scales are the step's. Made once per step (one host read
        of the query lengths)."""
        if not 0 < num <= self.q_len:
            raise ValueError(f"hf_paged: the attention got {num} queries per row, but the step has {self.q_len} "
                             "(only a model that keeps the last queries, as Gemma 4's KV-sharing layers do, may differ)")
        view = self._last.get(num)
        if view is None:
            cu = self.cu_seqlens_q.tolist()
            kept = [min(b - a, num) for a, b in zip(cu, cu[1:])]
            new_cu = [0]
            for n in kept:
                new_cu.append(new_cu[-1] + n)
            device = self.cu_seqlens_q.device
            token_index = None
            if sum(kept) != self.batch_size * num:
                token_index = host_to_device([row * num + col for row, n in enumerate(kept)
                                              for col in range(num - n, num)], torch.long, device)
            view = self._last[num] = replace(
                self, q_len=num, cu_seqlens_q=host_to_device(new_cu, torch.int32, device), token_index=token_index,
                max_seqlen_q=max(kept, default=0), _last={}, _parent=self, kv_scales=self.kv_scales,
                plan=None if self.plan is None else self.plan.for_other_queries())
        return view

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def reset_forward_state(self) -> None:
        """Forget what one forward recorded on this object (layers done, quantised layers' scales, the
        gather indices), so that a step whose tensors are rewritten in place (a CUDA graph's static
        inputs) can run forward again. The attention `plan` is the one its latest `KVOwner.begin` made."""
        self.active_layer = None
        self.layers_done.clear()
        self.kv_scales.clear()
        self.dense_index.clear()
        self._last.clear()

    @property
    def group_windows(self) -> tuple[int | None, ...] | None:
        """Per group, the sliding window its blocks are kept for (None: no window)."""
        return None if self.group_masks is None else tuple(m.window for m in self.group_masks)

    def mask_of(self, layer_idx: int | None) -> MaskRule:
        """The mask rule layer `layer_idx`'s attention applies (see `layer_masks`)."""
        if self.layer_masks is not None and layer_idx is not None:
            return self.layer_masks[layer_idx]
        return self.group_masks[self.group_of(layer_idx)] if self.group_masks else MaskRule()

    def source_of(self, layer_idx: int | None) -> int | None:
        """The layer whose K/V layer `layer_idx` reads (itself unless it shares another's)."""
        if self.layer_source is None or layer_idx is None:
            return layer_idx
        return self.layer_source[layer_idx]

    def group_of(self, layer_idx: int | None) -> int:
        """The KV group of layer `layer_idx` (0 for a one-group step or an unknown layer)."""
        if self.layer_group is None or layer_idx is None:
            return 0
        return self.layer_group[layer_idx]

    def block_tables_of(self, group: int) -> torch.Tensor:  # [batch_size, max_blocks] int32
        return self.group_block_tables[group] if self.group_block_tables else self.block_tables

    def slot_mapping_of(self, group: int) -> torch.Tensor:  # [num_tokens] int64
        return self.group_slot_mapping[group] if self.group_slot_mapping else self.slot_mapping

    def pack(self, states: torch.Tensor) -> torch.Tensor:
        """[batch, heads, q_len, dim] (transformers' layout) -> [num_tokens, heads, dim] real tokens."""
        flat = states.transpose(1, 2).reshape(self.batch_size * self.q_len, states.shape[1], states.shape[3])
        return flat if self.token_index is None else flat[self.token_index]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[num_tokens, heads, dim] -> [batch, q_len, heads, dim]; padding rows are zero."""
        if self.token_index is None:
            # A view when it can be; contiguous as every attention function's output is (a model may `view` it).
            return packed.reshape(self.batch_size, self.q_len, *packed.shape[1:]).contiguous()
        out = packed.new_zeros(self.batch_size * self.q_len, *packed.shape[1:])
        out[self.token_index] = packed
        return out.view(self.batch_size, self.q_len, *packed.shape[1:])


def host_to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`data` (a list, nested lists or a numpy array) as a `dtype` tensor on `device`, without a host sync.

    On CUDA the values are staged in pinned (page-locked) memory and copied asynchronously: the copy is
    ordered on the current stream before every kernel that reads the result, and torch's caching host
    allocator keeps the staging memory until the copy has run. A plain `torch.tensor(data, device=...)`
    copies from pageable memory and blocks the host until the device has drained its queue, once per
    tensor. Elsewhere the host tensor is returned as is (shared with a numpy `data`) or moved.
    """
    device = torch.device(device)
    host = torch.as_tensor(data, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def block_table_array(block_tables: list[list[int]], width: int | None = None) -> np.ndarray:
    """[num_seqs, width] int32 (width: the longest table, at least 1, when None), 0 past each row's
    blocks. A released (NULL_BLOCK < 0) entry reads as the row's first held block: K/V of its own
    sequence, which the window masks out, never another request's (whose NaN, times a zero weight,
    would still be NaN). Entries past `width` are dropped: a caller that narrows the table promises
    that no position there is read (`seq_lens` fit in `width` blocks)."""
    if width is None:
        width = max(max((len(t) for t in block_tables), default=0), 1)
    out = np.zeros((len(block_tables), width), dtype=np.int32)
    for row, t in enumerate(block_tables):
        if t and t[0] < 0:
            held = next((b for b in t if b >= 0), 0)
            t = [held if b < 0 else b for b in t]
        t = t[:width]
        out[row, :len(t)] = t
    return out


def _varlen_fields(q_lens: list[int], slots, block_tables, seq_lens: list[int], device: torch.device,
                   group_slots=None, group_block_tables=None, layer_group=None, group_masks=None,
                   layer_masks=None, layer_source=None, group_windows=None) -> dict:
    """The per-sequence tensors every step has, each one asynchronous host-to-device copy
    (`host_to_device`): building a step never waits for the device.

    `slots` / `block_tables` describe one KV group; `group_slots` / `group_block_tables` (per group,
    per sequence) and `layer_group` replace them for a model with several."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    if group_slots is None:
        group_slots, group_block_tables = [slots], [block_tables]
    tables = tuple(host_to_device(block_table_array(t), torch.int32, device) for t in group_block_tables)
    flat = [[s for row in g for s in row] for g in group_slots]
    mappings = tuple(host_to_device(f, torch.long, device) for f in flat)
    many = len(tables) > 1
    if group_masks is None and group_windows is not None:
        group_masks = [MaskRule(window=w) for w in group_windows]
    return dict(
        has_skipped_slots=min((min(f, default=0) for f in flat), default=0) < 0,
        cu_seqlens_q=host_to_device(cu, torch.int32, device),
        seq_lens=host_to_device(seq_lens, torch.int32, device),
        block_tables=tables[0],
        slot_mapping=mappings[0],
        group_block_tables=tables if many else (),
        group_slot_mapping=mappings if many else (),
        layer_group=tuple(layer_group) if many else None,
        group_masks=tuple(group_masks) if group_masks is not None else None,
        layer_masks=tuple(layer_masks) if layer_masks is not None else None,
        layer_source=tuple(layer_source) if layer_source is not None else None,
        max_seqlen_q=max(q_lens, default=0),
        max_seqlen_k=max(seq_lens, default=0),
    )


def build_step_metadata(
    *,
    mode: str,
    q_len: int,
    num_columns: int,
    real_cols: list[range],
    slots: list[list[int]] | None = None,
    block_tables: list[list[int]] | None = None,
    seq_lens: list[int],
    copies: list[tuple[int, int]],
    device: torch.device,
    group_slots: list[list[list[int]]] | None = None,
    group_block_tables: list[list[list[int]]] | None = None,
    layer_group: tuple[int, ...] | None = None,
    group_masks: tuple[MaskRule, ...] | None = None,
    layer_masks: tuple[MaskRule, ...] | None = None,
    layer_source: tuple[int, ...] | None = None,
    group_windows: tuple[int | None, ...] | None = None,
) -> StepMetadata:
    """Turn the block manager's per-row answers into device tensors (one host-to-device copy each).

    Args:
        real_cols: per row, the columns of this step holding real tokens (a suffix: left padding).
        slots: per row, the slot of each real token in `real_cols` order.
        block_tables, seq_lens: per row, after this step.
        group_slots, group_block_tables, layer_group: the same per KV group, for a model with several
            (instead of `slots` / `block_tables`); `layer_group[i]` is layer i's group.
        group_masks, layer_masks, layer_source: see `StepMetadata` (`KVOwner.group_layout`);
            `group_windows` (per group, a window or None) is the older spelling of `group_masks`.
    """
    batch_size = len(seq_lens)
    counts = [len(c) for c in real_cols]
    token_index = None
    if sum(counts) != batch_size * q_len:  # padding: say where the real tokens sit
        token_index = host_to_device([row * q_len + col for row, cols in enumerate(real_cols) for col in cols],
                                     torch.long, device)
    num_padding = None
    if mode == DENSE:
        num_padding = host_to_device([num_columns - n for n in seq_lens], torch.long, device)
    return StepMetadata(
        mode=mode,
        batch_size=batch_size,
        q_len=q_len,
        num_columns=num_columns,
        token_index=token_index,
        num_padding=num_padding,
        copies=copies,
        **_varlen_fields(counts, slots, block_tables, seq_lens, device, group_slots, group_block_tables, layer_group,
                         group_masks, layer_masks, layer_source, group_windows),
    )


def build_packed_metadata(
    *,
    q_lens: list[int],
    slots: list[list[int]] | None = None,
    block_tables: list[list[int]] | None = None,
    seq_lens: list[int],
    copies: list[tuple[int, int]],
    device: torch.device,
    group_slots: list[list[list[int]]] | None = None,
    group_block_tables: list[list[list[int]]] | None = None,
    layer_group: tuple[int, ...] | None = None,
    group_masks: tuple[MaskRule, ...] | None = None,
    layer_masks: tuple[MaskRule, ...] | None = None,
    layer_source: tuple[int, ...] | None = None,
    group_windows: tuple[int | None, ...] | None = None,
    key_limits: list[int] | None = None,
) -> StepMetadata:
    """Metadata for one engine step: sequences packed back to back in a single `[1, num_tokens]` row.

    Args:
        q_lens: per sequence, the tokens it feeds this step (its chunk).
        key_limits: per packed token, the last key position it may see (see `StepMetadata`); None: causal.
        slots: per sequence, the slot of each of those tokens (-1: prefix-cache hit, nothing to write).
        block_tables, seq_lens: per sequence, after this step.
        group_slots, group_block_tables, layer_group, group_masks, layer_masks, layer_source,
            group_windows: per KV group and layer (see `build_step_metadata`).
    """
    return StepMetadata(
        mode=PAGED,
        batch_size=1,
        q_len=sum(q_lens),
        num_columns=0,
        token_index=None,
        num_padding=None,
        copies=copies,
        key_limits=None if key_limits is None else host_to_device(key_limits, torch.long, device),
        **_varlen_fields(q_lens, slots, block_tables, seq_lens, device, group_slots, group_block_tables,
                         layer_group, group_masks, layer_masks, layer_source, group_windows),
    )
