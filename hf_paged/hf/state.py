"""Per-sequence recurrent state in the paged pool: the cache layers transformers' mixers write through,
the tensors behind them, and the per-sequence runs of a packed step.

Layout (one pair of tensors per recurrent layer and state index; rows are `core.state_slots` rows):

    conv:       [num_rows, channels, kernel]      the last `kernel` inputs of the layer's convolution
    recurrent:  [num_rows, *recurrent_shape]      the SSM / delta-rule state

A drop-in batch holds a contiguous run of rows, so a stock mixer reads and writes `[batch, ...]` views
of them, exactly as it does transformers' `LinearAttentionLayer` (`StateLayer` keeps that contract:
`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`,
`has_previous_state`). In an engine step, each mixer runs once per sequence (`mixers.py`), bound to
that sequence's rows; `StateStep` says which rows, and which copies the step makes (checkpoints,
speculative snapshots, restores).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..attention.interface import UnsupportedModelError
from ..state_spec import StateShape
from .layer import PagedLayer


@dataclass
class StateStep:
    """What the recurrent layers do in one packed step (host values; the same on every rank).

    Attributes:
        rows: per sequence, its state row.
        has_previous: per sequence, whether its row holds a state (tokens before this chunk).
        q_lens: per sequence, the tokens it feeds.
        saves: per sequence, (tokens into its chunk, row) pairs after which its state is copied to row.
        restores: (src, dst) row copies applied before the forward (a prefix-cache checkpoint taken,
            a forked sample's parent state).
    """

    rows: list[int]
    has_previous: list[bool]
    q_lens: list[int]
    saves: list[list[tuple[int, int]]] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    # The mixer calls this step makes (`mixers._batches`), planned once and read by every recurrent layer.
    batches: dict = field(default_factory=dict, repr=False, compare=False)

    def max_row(self) -> int:
        return max([*self.rows, *(r for s in self.saves for _, r in s), *(r for pair in self.restores for r in pair)])


class StateStore:
    """The state tensors of every recurrent layer, `[num_rows, *shape]` per layer and state index,
    allocated at a layer's first write with the dtype and device the mixer gives (checked against its
    `StateShape`: a mixer whose state differs from the formula is refused, never stored wrongly).

    Args:
        resumes: whether the mixers continue a state over several tokens in one call. transformers'
            Mamba 1 mixers (Jamba, Falcon-Mamba, Zamba) scan a multi-token call from zeros whatever the
            cache holds ("WRONG if the cache is not empty", their source says): the engine feeds them a
            continuation one token at a time, the path their decode takes.
    """

    def __init__(self, shapes: dict[int, StateShape], num_rows: int, resumes: bool = True):
        self.shapes = dict(shapes)
        self.num_rows = num_rows
        self.resumes = resumes
        self.conv: dict[int, list[torch.Tensor | None]] = {i: [None] * s.num_states for i, s in shapes.items()}
        self.recurrent: dict[int, list[torch.Tensor | None]] = {i: [None] * s.num_states for i, s in shapes.items()}

    def tensors(self):
        for per_layer in (self.conv, self.recurrent):
            for tensors in per_layer.values():
                yield from (t for t in tensors if t is not None)

    def ensure(self, kind: str, layer: int, index: int, like: torch.Tensor) -> torch.Tensor:
        """The layer's `kind` ("conv" / "recurrent") tensor for state `index`, allocated like `like`
        ([batch, *shape]; a conv input's last dimension is its length, not the kernel)."""
        store = self.conv if kind == "conv" else self.recurrent
        tensor = store[layer][index]
        if tensor is not None:
            return tensor
        shape = self.shapes[layer]
        want = shape.conv[index] if kind == "conv" else shape.recurrent[index]
        got = tuple(like.shape[1:-1]) if kind == "conv" else tuple(like.shape[1:])
        if (want[:-1] if kind == "conv" else want) != got:
            raise UnsupportedModelError(
                f"hf_paged: layer {layer}'s mixer keeps a {kind} state of shape {got} per sequence, but its config "
                f"says {want} (state_spec): load the model with attn_implementation='sdpa' or 'eager'")
        tensor = torch.zeros((self.num_rows, *want), dtype=like.dtype, device=like.device)
        store[layer][index] = tensor
        return tensor

    def copy_rows(self, src: list[int], dst: list[int], layer: int | None = None) -> None:
        """Copy rows `src[i]` to `dst[i]` in every layer's tensors (or `layer`'s only)."""
        if not src:
            return
        for per_layer in (self.conv, self.recurrent):
            for i, tensors in per_layer.items():
                if layer is not None and i != layer:
                    continue
                for t in tensors:
                    if t is None:
                        continue
                    with torch.inference_mode(t.is_inference()):  # made inside a forward, copied outside too
                        if len(src) == 1:
                            t[dst[0]].copy_(t[src[0]])
                        else:
                            t.index_copy_(0, torch.tensor(dst, device=t.device),
                                          t.index_select(0, torch.tensor(src, device=t.device)))

    def resize(self, num_rows: int) -> None:
        """Grow every tensor to `num_rows` rows (between steps; rows keep their content)."""
        if num_rows <= self.num_rows:
            return
        for per_layer in (self.conv, self.recurrent):
            for tensors in per_layer.values():
                for k, t in enumerate(tensors):
                    if t is not None:
                        with torch.inference_mode(t.is_inference()):
                            grown = t.new_zeros((num_rows, *t.shape[1:]))
                            grown[: self.num_rows] = t
                        tensors[k] = grown
        self.num_rows = num_rows

    def bytes_per_row(self) -> int:
        """Bytes of one sequence's state in the allocated tensors."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors())


def state_bytes_per_row(shapes: dict[int, StateShape], dtype: torch.dtype) -> int:
    """Bytes of one sequence's state in every recurrent layer, for a model in `dtype` (the recurrent
    part in the dtype its spec fixes, `StateShape.recurrent_dtype`)."""
    total = 0
    for shape in shapes.values():
        recurrent = getattr(torch, shape.recurrent_dtype) if shape.recurrent_dtype else dtype
        total += shape.bytes(dtype.itemsize, recurrent.itemsize)
    return total


class StateLayer(LinearAttentionCacheLayerMixin):
    """One recurrent layer of the pool, as transformers' `LinearAttentionLayer` is for a stock cache,
    over rows of `store`: `bind` points it at a run of rows (a drop-in batch, or one sequence of an
    engine step) and whether they hold a state yet."""

    is_croppable = False  # a recurrent state cannot drop tokens; the engine keeps snapshots instead

    def __init__(self, store: StateStore, layer_idx: int):
        self._init_state(store, layer_idx)

    def _init_state(self, store: StateStore, layer_idx: int) -> None:
        # Not the mixin's __init__: it sets `device` / `dtype`, which a hybrid layer's K/V side owns.
        shape = store.shapes[layer_idx]
        n = shape.num_states
        self._store, self._layer = store, layer_idx
        self.number_of_states = n
        self.conv_states = dict.fromkeys(range(n))
        self.recurrent_states = dict.fromkeys(range(n))
        self.is_conv_states_initialized = dict.fromkeys(range(n), False)
        self.is_recurrent_states_initialized = dict.fromkeys(range(n), False)
        self.has_previous_state = dict.fromkeys(range(n), False)
        self.conv_kernel_size = {i: shape.conv[i][-1] if shape.conv[i] else None for i in range(n)}
        self.cumulative_length_linear = torch.tensor(0, dtype=torch.long)
        self.record_past = False
        self._rows: slice | None = None
        self._gathered: list[int] | None = None  # rows `bind_rows` copied out, until `write_back`

    def bind(self, start: int, count: int, has_previous: bool) -> None:
        """Read and write rows `start .. start + count - 1` from now on; without a previous state they
        start from zeros, as a stock cache's new layer does (a row keeps its last owner's state, and
        Mamba mixers read the recurrent state after the conv update has marked it as present)."""
        self._rows = slice(start, start + count)
        for i in range(self.number_of_states):
            self.has_previous_state[i] = has_previous
            self._view(i)
            if not has_previous:
                for held in (self.conv_states[i], self.recurrent_states[i]):
                    if held is not None:
                        with torch.inference_mode(held.is_inference()):
                            held.zero_()

    def bind_rows(self, rows: list[int], has_previous: bool = True) -> None:
        """Read and write copies of rows `rows` as one batch (zeros without a previous state);
        `write_back` stores them in their rows."""
        self._gathered = rows
        self._rows = slice(0, len(rows))
        for i in range(self.number_of_states):
            self.has_previous_state[i] = has_previous
            self._gather_view(i)

    def _gather_view(self, i: int, kinds: tuple[str, ...] = ("conv", "recurrent")) -> None:
        pairs = {"conv": (self._store.conv, self.conv_states),
                 "recurrent": (self._store.recurrent, self.recurrent_states)}
        for store, held in (pairs[kind] for kind in kinds):
            tensor = store[self._layer][i]
            if tensor is None:
                held[i] = None
            elif self.has_previous_state[i]:
                held[i] = tensor.index_select(0, torch.tensor(self._gathered, device=tensor.device))
            else:
                held[i] = tensor.new_zeros((len(self._gathered), *tensor.shape[1:]))
        self.is_conv_states_initialized[i] = self.conv_states[i] is not None
        self.is_recurrent_states_initialized[i] = self.recurrent_states[i] is not None

    def write_back(self) -> None:
        """Store the copies `bind_rows` handed out back in their rows (nothing to do after `bind`'s views),
        and hold no rows until the next bind."""
        rows, self._gathered, self._rows = self._gathered, None, None
        if rows is None:
            return
        for i in range(self.number_of_states):
            for store, held in ((self._store.conv, self.conv_states), (self._store.recurrent, self.recurrent_states)):
                tensor = store[self._layer][i]
                if tensor is not None and held[i] is not None:
                    tensor.index_copy_(0, torch.tensor(rows, device=tensor.device), held[i])

    def _view(self, i: int) -> None:
        conv, rec = self._store.conv[self._layer][i], self._store.recurrent[self._layer][i]
        self.conv_states[i] = None if conv is None else conv[self._rows]
        self.recurrent_states[i] = None if rec is None else rec[self._rows]
        self.is_conv_states_initialized[i] = conv is not None
        self.is_recurrent_states_initialized[i] = rec is not None

    def _check_bound(self, batch: int) -> None:
        if self._rows is None:
            raise UnsupportedModelError(
                f"hf_paged: recurrent layer {self._layer} was called outside a planned forward (the cache binds "
                "its state rows per step; run the model through generate() or hf_paged.attach)")
        if self._rows.stop - self._rows.start != batch:
            raise UnsupportedModelError(f"hf_paged: recurrent layer {self._layer} got a batch of {batch} rows, but "
                                        f"the step holds {self._rows.stop - self._rows.start}")

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        kinds = []
        if conv_states is not None:
            self._store.ensure("conv", self._layer, state_idx, conv_states)
            kinds.append("conv")
        if recurrent_states is not None:
            like = recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1]
            self._store.ensure("recurrent", self._layer, state_idx, like)
            kinds.append("recurrent")
        if self._gathered is not None:  # a gathered batch: zero copies of the new tensor (no row held a state)
            has_previous, self.has_previous_state[state_idx] = self.has_previous_state[state_idx], False
            self._gather_view(state_idx, tuple(kinds))
            self.has_previous_state[state_idx] = has_previous
        else:
            self._view(state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """Store the last `kernel` columns of (the kept window, then) `conv_states` ([batch, channels,
        len]) and return what the convolution reads: the window and the new columns."""
        self._check_bound(conv_states.shape[0])
        kernel = self.conv_kernel_size[state_idx]
        if conv_kernel_size is not None and conv_kernel_size != kernel:
            raise UnsupportedModelError(f"hf_paged: layer {self._layer}'s convolution has kernel {conv_kernel_size}, "
                                        f"but its config says {kernel}")
        if not self.is_conv_states_initialized[state_idx]:
            StateLayer.lazy_initialization(self, conv_states=conv_states, state_idx=state_idx)
        if state_idx == 0:
            self.cumulative_length_linear.add_(conv_states.shape[-1])
        window = self.conv_states[state_idx]
        if self.has_previous_state[state_idx]:
            full = torch.cat([window, conv_states], dim=-1)
        else:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0))
            self.has_previous_state[state_idx] = True
        window.copy_(full[..., -kernel:])
        return full

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Store the last of `recurrent_states` (a tensor, or a list of per-token states) and return
        the stored state."""
        last = recurrent_states if isinstance(recurrent_states, torch.Tensor) else recurrent_states[-1]
        self._check_bound(last.shape[0])
        if not self.is_recurrent_states_initialized[state_idx]:
            StateLayer.lazy_initialization(self, recurrent_states=last, state_idx=state_idx)
        state = self.recurrent_states[state_idx]
        state.copy_(last)
        self.has_previous_state[state_idx] = True
        return state

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None):
        raise ValueError(
            "hf_paged: a paged cache cannot roll back a recurrent layer's state token by token (assisted "
            "generation and deferred stopping record it); speculative decoding with this model runs in the "
            "Engine (speculative_method='ngram'), or load it with attn_implementation='sdpa' for assisted generation")

    def crop(self, tokens_to_remove: int):
        if tokens_to_remove:
            self.activate_past_recording()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for i in range(self.number_of_states):
            self.has_previous_state[i] = False
        self._rows = None

    def reorder_cache(self, beam_idx: torch.LongTensor):  # the cache moves rows (`PagedCache._reindex`)
        return None


class PagedStateLayer(StateLayer, PagedLayer):
    """A layer with attention and a recurrent mixer side by side (Falcon-H1's "hybrid"): its K/V in
    blocks (`PagedLayer`), its state in rows (`StateLayer`)."""

    is_croppable = False
    lazy_initialization = PagedLayer.lazy_initialization  # the K/V side's: the state side calls its own
    get_max_length = PagedLayer.get_max_length
    get_seq_length = PagedLayer.get_seq_length

    def __init__(self, kv, store: StateStore, layer_idx: int, *args):
        PagedLayer.__init__(self, kv, *args)
        self._init_state(store, layer_idx)

    def reset(self) -> None:
        PagedLayer.reset(self)
        StateLayer.reset(self)
