"""CUDA graphs for decode steps: capture the packed forward once per shape, replay it every step.

A decode step (every scheduled sequence feeds one token and needs its one logits row; no prefill
chunk, no speculative verify, no copy-on-write copy pending) is the same few hundred kernel launches
step after step; at small batches the host's launch time, not the GPU, sets its pace. Such a step is
copied into static input buffers and replayed from a graph captured for its shape.

Keys. A graph is captured for a `GraphKey`: a batch bucket (1, 2, 4, 8, ... up to `max_num_seqs`)
and a `max_seqlen_k` bucket (256, 512, ... up to the longest sequence). A step runs the graph of the
smallest batch bucket >= its sequences and the smallest `max_seqlen_k` bucket >= its longest
sequence, or eagerly when none is that large. Everything the launchers turn into grid sizes or
constexprs on the host is frozen at capture: `max_seqlen_q` is 1, `has_skipped_slots` is True and
`max_seqlen_k` is the bucket's bound, so the decode kernel's split count covers every sequence the
graph will ever see. A graph is never replayed for a longer bucket (the bug of transformers#45323:
a graph captured at a short `max_seqlen_k` silently reads too few keys when replayed later).

Padding. A step of n sequences replays the graph of batch B >= n; rows n..B-1 are padding:

    input_ids     [1, B]  int64   tokens, then 0
    positions     [1, B]  int64   positions, then 0
    logits_index  [B]     int64   0 .. B-1 (each row's one token is its logits row)
    slot_mapping  [B]     int64   per KV group: slots, then -1 (store_kv writes nothing there)
    seq_lens      [B]     int32   lengths, then 1
    cu_seqlens_q  [B + 1] int32   0 .. B (every row queries one token)
    block_tables  [B, W]  int32   per KV group: tables, then rows of 0 (W = ceil(bound / block_size))

A padded row is a one-token sequence at position 0 reading slot 0 of block 0 (whatever it holds,
never NaN-producing for real rows: attention, norms and MLPs are row-local) and writing nothing;
its logits row is dropped. All graphs share one int64 and one int32 device buffer (each graph
views a prefix of them in its own layout), filled by one asynchronous copy each per step.

Memory. Graphs share one memory pool (`torch.cuda.graph_pool_handle()`); the graphs of a
`max_seqlen_k` bucket are captured together the first time a step needs it, largest batch first,
so the smaller ones fit in the memory the largest one left in the pool; each capture follows one
eager warm-up on all-padding inputs (Triton compiles and autotunes there, never during a capture).
The step begins inside the captured forward, so the warm-up and the capture each plan its
attention (`attention.plan`): the warm-up sizes the cache's workspace for the bucket's split-K
scratch, the capture only takes views of it, and the graph's metadata keeps the captured plan (and
so that memory) for as long as the graph lives.
Graphs are dropped and recaptured when the memory they read moved: the KV pool grew, or the
weights were replaced (seen when the cache's weights epoch moves).

Capture is pluggable (`CudaGraphCapture` on CUDA; `EagerGraphCapture`, a stand-in that replays the
captured callable eagerly on the same static buffers, so the whole flow runs on CPU in the tests;
`cpu_graphs.CompiledCapture`, compiled CPU steps). A capture that says `captures_lazily` is asked for
one bucket at a time, as a step needs it, and may have its `max_seqlen_k` buckets extended past the
largest (`_extend`): its graphs hold no memory of their own.
This module owns the buckets, the static buffers and the graphs; the forward itself is
`ModelRunner`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..attention import backend as backends
from ..attention import dispatch
from ..attention.metadata import PAGED, StepMetadata, block_table_array
from ..hf import KVOwner
from ..hf.rope import has_length_rope
from ..hf.support import layer_specs_of
from ..kv_spec import LatentAttention
from ..hf.weights import VERSION_ATTR

logger = logging.getLogger(__name__)

# The smallest max_seqlen_k bucket: below it the decode kernel runs one split whatever the bound
# (`triton.decode._MIN_KEYS_PER_SPLIT`), so finer buckets would capture identical graphs.
MIN_SEQLEN_BUCKET = 256
# Buffer segments start at multiples of this many elements (64 / 128 bytes): Triton specialises
# pointer arguments on 16-byte alignment, and every graph's views then get the aligned variant.
_ALIGN = 16


# ---------------------------------------------------------------------- buckets and keys
def batch_size_buckets(max_num_seqs: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: `sizes`, or 1, 2, 4, ... below `max_num_seqs` and
    `max_num_seqs` itself (so that every decode step fits one).

    Raises:
        ValueError: a size is not an integer in [1, max_num_seqs].
    """
    if sizes is None:
        sizes, b = [], 1
        while b < max_num_seqs:
            sizes.append(b)
            b *= 2
        sizes.append(max_num_seqs)
    sizes = list(sizes)
    if not sizes or any(not _is_int(b) or not 1 <= b <= max_num_seqs for b in sizes):
        raise ValueError(f"cuda_graph_batch_sizes must be integers in [1, max_num_seqs={max_num_seqs}], got {sizes}")
    return tuple(sorted(set(sizes)))


def max_seqlen_buckets(limit: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The `max_seqlen_k` bounds graphs are captured for: `sizes`, or MIN_SEQLEN_BUCKET, twice that,
    ... below `limit` (the longest sequence the engine can hold) and `limit` itself.

    Raises:
        ValueError: a size is not a positive integer.
    """
    if sizes is None:
        sizes, s = [], MIN_SEQLEN_BUCKET
        while s < limit:
            sizes.append(s)
            s *= 2
        sizes.append(limit)
    sizes = list(sizes)
    if not sizes or any(not _is_int(s) or s < 1 for s in sizes):
        raise ValueError(f"cuda_graph_max_seqlens must be positive integers, got {sizes}")
    return tuple(sorted(set(sizes)))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def smallest_bucket(buckets: Sequence[int], value: int) -> int | None:
    """The smallest of the (sorted) `buckets` >= `value`, or None when `value` exceeds them all."""
    for b in buckets:
        if b >= value:
            return b
    return None


@dataclass(frozen=True)
class GraphKey:
    """What a decode graph is captured for.

    Attributes:
        batch_size: rows of the captured step (real sequences, then padding).
        max_seqlen_k: the bucket's bound: every sequence of a step replayed on it holds at most this
            many tokens, and the kernels were launched for this many.
    """

    batch_size: int
    max_seqlen_k: int


# ---------------------------------------------------------------------- host side of one step
@dataclass
class DecodeBatch:
    """One decode step on the host, one entry per sequence (plain lists: the block manager's answers).

    Attributes:
        token_ids: the token each sequence feeds.
        positions: its position (the tokens the sequence held before this step).
        seq_lens: tokens each sequence holds after this step.
        group_slots: per KV group, each token's slot (-1: already in the cache, nothing to write).
        group_block_tables: per KV group, each sequence's block table.
    """

    token_ids: list[int]
    positions: list[int]
    seq_lens: list[int]
    group_slots: list[list[int]]
    group_block_tables: list[list[list[int]]]

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seq_lens, default=0)

    @classmethod
    def empty(cls, num_groups: int) -> "DecodeBatch":
        """No sequence: every row of a graph's inputs is padding (what warm-ups and captures run on)."""
        return cls([], [], [], [[] for _ in range(num_groups)], [[] for _ in range(num_groups)])


class InputLayout:
    """Where one graph's inputs sit in the shared buffers: offsets in elements of the int64 and the
    int32 buffer, each segment aligned to _ALIGN elements.

        int64: input_ids [B] | positions [B] | logits_index [B] | slot_mapping [B] per group
        int32: seq_lens [B] | cu_seqlens_q [B + 1] | block_tables [B, W] per group
    """

    def __init__(self, batch_size: int, width: int, num_groups: int):
        self.batch_size, self.width, self.num_groups = batch_size, width, num_groups
        b = batch_size
        self.long_spans, self.num_long = _spans([("input_ids", (1, b)), ("positions", (1, b)), ("logits_index", (b,))]
                                                + [(f"slot_mapping{g}", (b,)) for g in range(num_groups)])
        self.int_spans, self.num_int = _spans([("seq_lens", (b,)), ("cu_seqlens_q", (b + 1,))]
                                              + [(f"block_tables{g}", (b, width)) for g in range(num_groups)])

    def pack(self, batch: DecodeBatch) -> tuple[np.ndarray, np.ndarray]:
        """The host images of the two buffers' prefixes ([num_long] int64, [num_int] int32): the step's
        sequences, then padding rows (see the module docstring)."""
        n, b = batch.num_seqs, self.batch_size
        if n > b:
            raise ValueError(f"a step of {n} sequences does not fit a graph of {b} rows")
        long = np.zeros(self.num_long, dtype=np.int64)
        ints = np.zeros(self.num_int, dtype=np.int32)
        _view(long, self.long_spans, "input_ids")[0, :n] = batch.token_ids
        _view(long, self.long_spans, "positions")[0, :n] = batch.positions
        _view(long, self.long_spans, "logits_index")[:] = np.arange(b)
        seq_lens = _view(ints, self.int_spans, "seq_lens")
        seq_lens[:] = 1
        seq_lens[:n] = batch.seq_lens
        _view(ints, self.int_spans, "cu_seqlens_q")[:] = np.arange(b + 1)
        for g in range(self.num_groups):
            slots = _view(long, self.long_spans, f"slot_mapping{g}")
            slots[:] = -1
            slots[:n] = batch.group_slots[g]
            if n:  # tables past `width` blocks hold no position a sequence of the bucket reads
                _view(ints, self.int_spans, f"block_tables{g}")[:n] = block_table_array(batch.group_block_tables[g],
                                                                                        self.width)
        return long, ints


def _view(buf, spans: dict, name: str):
    """Segment `name` of a flat numpy array or tensor, in its shape (a view either way)."""
    offset, shape = spans[name]
    return buf[offset: offset + int(np.prod(shape))].reshape(shape)


def _spans(entries: list[tuple[str, tuple[int, ...]]]) -> tuple[dict[str, tuple[int, tuple[int, ...]]], int]:
    spans, offset = {}, 0
    for name, shape in entries:
        spans[name] = (offset, shape)
        offset += -(-int(np.prod(shape)) // _ALIGN) * _ALIGN
    return spans, offset


@dataclass
class GraphInputs:
    """One graph's views of the static buffers (shapes as in the module docstring)."""

    input_ids: torch.Tensor  # [1, B] int64
    positions: torch.Tensor  # [1, B] int64
    logits_index: torch.Tensor  # [B] int64
    slot_mapping: tuple[torch.Tensor, ...]  # per KV group, [B] int64
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    block_tables: tuple[torch.Tensor, ...]  # per KV group, [B, W] int32


class StaticInputs:
    """The device buffers every decode graph reads: one int64 and one int32 buffer, sized for the
    largest layout, which each graph views in its own `InputLayout`. Only one graph runs at a time,
    and a step's `fill` rewrites the prefix its graph reads."""

    def __init__(self, max_batch_size: int, max_width: int, num_groups: int, device: torch.device):
        largest = InputLayout(max_batch_size, max_width, num_groups)
        self.long = torch.zeros(largest.num_long, dtype=torch.int64, device=device)  # [num_long]
        self.ints = torch.zeros(largest.num_int, dtype=torch.int32, device=device)  # [num_int]

    def views(self, layout: InputLayout) -> GraphInputs:
        long, ints = layout.long_spans, layout.int_spans
        groups = range(layout.num_groups)
        return GraphInputs(
            input_ids=_view(self.long, long, "input_ids"),
            positions=_view(self.long, long, "positions"),
            logits_index=_view(self.long, long, "logits_index"),
            slot_mapping=tuple(_view(self.long, long, f"slot_mapping{g}") for g in groups),
            seq_lens=_view(self.ints, ints, "seq_lens"),
            cu_seqlens_q=_view(self.ints, ints, "cu_seqlens_q"),
            block_tables=tuple(_view(self.ints, ints, f"block_tables{g}") for g in groups),
        )

    def fill(self, layout: InputLayout, batch: DecodeBatch) -> None:
        """Copy `batch`, padded to the layout, into the buffers: two asynchronous copies on CUDA
        (through pinned memory), ordered before the replay that reads them."""
        long, ints = layout.pack(batch)
        _copy_from_host(self.long[: layout.num_long], long)
        _copy_from_host(self.ints[: layout.num_int], ints)


def _copy_from_host(dst: torch.Tensor, host: np.ndarray) -> None:
    src = torch.from_numpy(host)
    if dst.device.type == "cuda":
        dst.copy_(src.pin_memory(), non_blocking=True)  # the caching host allocator keeps it until copied
    else:
        dst.copy_(src)


# ---------------------------------------------------------------------- capture strategies
class CudaGraphCapture:
    """Captures with `torch.cuda.CUDAGraph`, every graph in one shared memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None

    def __call__(self, forward: Callable[[], torch.Tensor]) -> "CapturedGraph":
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a server's, the disaggregated workers' transfer
        # watchers) neither join nor invalidate this capture.
        with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = forward()
        return CapturedGraph(graph.replay, output, graph)

    def reset(self) -> None:
        """Start a new pool (the old one is freed with the last graph that holds it)."""
        self.pool = None


class EagerGraphCapture:
    """A stand-in for `CudaGraphCapture` on any device: it records the callable and replays it
    eagerly on the same static buffers, copying its result into the output it returned at capture.
    The host values the launchers see are those of the capture (the callable closes over one
    metadata object with the bucket's bound and the buffer views), so the tests run the whole flow
    on CPU. Unlike a real graph it re-runs the Python: code that reads tensor values on the host
    inside the forward would follow each step here but stay frozen in a real graph (the tests check
    that the forward reads none)."""

    def __init__(self):
        self.num_captures = 0

    def __call__(self, forward: Callable[[], torch.Tensor]) -> "CapturedGraph":
        output = forward()  # a real capture runs nothing; this run writes no K/V (all rows are padding)
        self.num_captures += 1

        def replay() -> None:
            with torch.inference_mode():  # the output is an inference tensor, as the forward made it
                output.copy_(forward())

        return CapturedGraph(replay, output, None)

    def reset(self) -> None:
        pass


@dataclass
class CapturedGraph:
    """A captured forward: `replay()` recomputes `output` ([B, vocab] logits) from the static inputs."""

    replay: Callable[[], object]
    output: torch.Tensor  # [B, vocab], the graph's own memory: read it before the next replay
    graph: object = None  # the torch.cuda.CUDAGraph, kept alive with its output


class GraphCaptureError(RuntimeError):
    """Capturing a decode graph failed; the runner falls back to eager steps."""


def check_cuda_graphs(enabled: bool | None, model: torch.nn.Module, device: torch.device,
                      attention_backend: str | None = None) -> bool:
    """Resolve the Engine's `cuda_graphs` argument: None means on where graphs can run (a CUDA device
    with the Triton backend, a model without dynamic RoPE or recurrent layers), off elsewhere. `attention_backend`: the
    engine's explicit choice (None: `HF_PAGED_BACKEND`, else auto).

    Raises:
        ValueError: `enabled` is True where graphs cannot run, naming why.
    """
    reason = None
    if device.type != "cuda":
        reason = f"CUDA graphs need a CUDA device; the model is on {device}"
    elif dispatch.backend(device, attention_backend) != "triton":
        reason = ("CUDA graphs need the Triton attention backend (the torch backend reads step metadata on the "
                  "host); leave attention_backend / HF_PAGED_BACKEND at auto or triton")
    elif (widest := _widest_head(model)) > (limit := backends.backends()["triton"].capabilities.max_head_dim or widest):
        reason = (f"CUDA graphs need every layer on the Triton kernels, which take heads up to {limit} wide; this "
                  f"model has {widest}-wide K/V heads (those layers run on the torch path, which reads step "
                  "metadata on the host)")
    elif has_length_rope(model.config):
        reason = ("CUDA graphs cannot capture length-dependent RoPE (dynamic NTK, longrope: each sequence's "
                  "frequencies are chosen on the host per step)")
    elif _has_state(model):
        reason = ("CUDA graphs cannot capture recurrent layers (Mamba, linear attention): their mixers run per "
                  "sequence over state rows chosen on the host per step")
    elif _has_indexer(model):
        reason = ("CUDA graphs cannot capture indexed sparse attention (DeepSeek V3.2): its indexer runs per "
                  "sequence over key counts read on the host per step")
    if reason is not None and enabled:
        raise ValueError(f"cuda_graphs=True: {reason}")
    return reason is None if enabled is None else bool(enabled)


def _has_state(model: torch.nn.Module) -> bool:
    try:
        return any(s.state is not None for s in layer_specs_of(model.config))
    except ValueError:
        return False


def _has_indexer(model: torch.nn.Module) -> bool:
    try:
        return any(getattr(s, "index_topk", 0) for s in layer_specs_of(model.config))
    except ValueError:
        return False


def _widest_head(model: torch.nn.Module) -> int:
    """The widest K or V head of any layer the config describes (0 when it says none) that the Triton
    kernels do not take (a latent layer's rows go to the latent kernel, within its own limits)."""
    try:
        specs = layer_specs_of(model.config)
    except ValueError:
        return 0
    from ..attention.triton.latent import MAX_LATENT_DIM, MAX_ROPE_DIM

    def reads(s) -> bool:  # whether the Triton kernels have a limit for this layer that it passes
        if isinstance(s, LatentAttention):
            return s.shape.head_dim > MAX_LATENT_DIM or s.shape.head_dim_v > MAX_ROPE_DIM
        return True

    return max((max(s.shape.head_dim, s.shape.head_dim_v) for s in specs if s.shape is not None and reads(s)),
               default=0)


# ---------------------------------------------------------------------- the graphs
@dataclass
class _Graph:
    captured: CapturedGraph
    layout: InputLayout
    metadata: StepMetadata  # what every replay runs with (its host values frozen at capture)


class DecodeGraphs:
    """The decode graphs of one runner: choose, capture and replay.

    Args:
        run_model: `(input_ids, positions, logits_index, metadata) -> [B, vocab] logits`: one forward
            with `metadata` as the cache's step (what is captured; it begins the cache's step itself).
        model: the model (its parameters' memory is what a graph reads).
        kv: the `KVOwner` whose pool the graphs read and write.
        device: where the model runs.
        batch_sizes: the batch buckets (`batch_size_buckets`).
        max_seqlens: the `max_seqlen_k` buckets (`max_seqlen_buckets`).
        capture: `CudaGraphCapture` (default), `cpu_graphs.CompiledCapture`, or a stand-in with the same call.
    """

    def __init__(self, run_model: Callable, model: torch.nn.Module, kv: KVOwner, device: torch.device,
                 batch_sizes: Sequence[int], max_seqlens: Sequence[int], capture=None):
        self.run_model = run_model
        self.model = model
        self.kv = kv
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_seqlens = tuple(sorted(max_seqlens))
        self.num_groups = kv.manager.num_groups
        self.inputs = StaticInputs(self.batch_sizes[-1], self.width_for(self.max_seqlens[-1]), self.num_groups, device)
        self.capture = capture if capture is not None else CudaGraphCapture(device)
        self.graphs: dict[GraphKey, _Graph] = {}
        self.num_replays = 0
        self.capture_seconds = 0.0  # wall time of every capture so far (warm-ups and compilations included)
        self.replayed_keys: list[GraphKey] = []  # the key of every replay, in order (a test's view of the choices)
        self._memory = None  # (pool size, weights epoch) the signature below was taken at
        self._signature = None

    def width_for(self, max_seqlen_k: int) -> int:
        """Block-table columns of a graph for `max_seqlen_k`: enough blocks for its longest sequence."""
        return -(-max_seqlen_k // self.kv.block_size)

    def key_for(self, num_seqs: int, max_seqlen_k: int) -> GraphKey | None:
        """The graph a decode step of `num_seqs` sequences, the longest holding `max_seqlen_k` tokens,
        replays on, or None: the step runs eagerly (more sequences, or longer, than any bucket)."""
        batch_size = smallest_bucket(self.batch_sizes, num_seqs)
        bound = smallest_bucket(self.max_seqlens, max_seqlen_k)
        if bound is None and getattr(self.capture, "captures_lazily", False):
            bound = self._extend(max_seqlen_k)
        if batch_size is None or bound is None or num_seqs < 1:
            return None
        return GraphKey(batch_size, bound)

    def _extend(self, max_seqlen_k: int) -> int:
        """A `max_seqlen_k` bucket for a step past the largest (an engine that widened since it was built:
        drop-in `generate` sizes its engine by its first call), for a capture whose graphs hold no memory
        of their own (`captures_lazily`): the largest doubled until it fits. The static buffers are made
        anew, so every graph is recaptured."""
        bucket = self.max_seqlens[-1]
        while bucket < max_seqlen_k:
            bucket *= 2
        self.max_seqlens = (*self.max_seqlens, bucket)
        self.inputs = StaticInputs(self.batch_sizes[-1], self.width_for(bucket), self.num_groups,
                                   self.inputs.long.device)
        self.graphs.clear()
        self.capture.reset()
        return bucket

    def replay(self, key: GraphKey, batch: DecodeBatch) -> torch.Tensor:  # [batch.num_seqs, vocab]
        """Run `batch` on the graph of `key` (capturing its bucket first if needed); returns the real
        rows of the graph's logits, valid until the next replay.

        Raises:
            GraphCaptureError: the capture failed (the cache's step is left for the caller to abandon).
        """
        if batch.num_seqs > key.batch_size or batch.max_seqlen_k > key.max_seqlen_k:
            raise ValueError(f"a step of {batch.num_seqs} sequences up to {batch.max_seqlen_k} tokens cannot "
                             f"replay the graph of {key}")
        self._drop_if_moved()
        graph = self.graphs.get(key)
        if graph is None:
            began = time.perf_counter()
            self._capture_bucket(key)
            self.capture_seconds += time.perf_counter() - began
            graph = self.graphs[key]
        self.inputs.fill(graph.layout, batch)
        graph.captured.replay()
        self.num_replays += 1
        self.replayed_keys.append(key)
        return graph.captured.output[: batch.num_seqs]

    def _capture_bucket(self, key: GraphKey) -> None:
        """Capture every batch bucket's graph for `key.max_seqlen_k`, largest first (so that the smaller
        ones fit the memory the largest left in the pool); `key`'s alone for a capture that compiles
        (`captures_lazily`: each bucket costs a compilation, paid when a step first needs it)."""
        max_seqlen_k = key.max_seqlen_k
        sizes = (key.batch_size,) if getattr(self.capture, "captures_lazily", False) else reversed(self.batch_sizes)
        try:
            for batch_size in sizes:
                key = GraphKey(batch_size, max_seqlen_k)
                if key not in self.graphs:
                    self.graphs[key] = self._capture(key)
        except Exception as exc:
            raise GraphCaptureError(f"capturing the decode graphs for max_seqlen_k={max_seqlen_k} failed: "
                                    f"{exc!r}") from exc
        self._signature = self._memory_signature()  # the warm-ups may have allocated the KV tensors

    def _capture(self, key: GraphKey) -> _Graph:
        layout = InputLayout(key.batch_size, self.width_for(key.max_seqlen_k), self.num_groups)
        inputs = self.inputs.views(layout)
        meta = self._metadata(key, inputs)

        def forward() -> torch.Tensor:  # [B, vocab]
            return self.run_model(inputs.input_ids, inputs.positions, inputs.logits_index, meta)

        self.inputs.fill(layout, DecodeBatch.empty(self.num_groups))  # every row padding: nothing is written
        forward()  # warm-up, eagerly: Triton compiles (and autotunes) here, lazily built state is built
        if not all(layer.is_initialized for layer in self.kv.storage_layers):
            raise RuntimeError("the warm-up left KV layers unallocated; a capture would allocate them in its pool")
        return _Graph(self.capture(forward), layout, meta)

    def _metadata(self, key: GraphKey, inputs: GraphInputs) -> StepMetadata:
        """The step every replay of `key` runs: fixed host values, tensors that are the static views."""
        many = self.num_groups > 1
        layout = self.kv.group_layout()
        return StepMetadata(
            mode=PAGED, batch_size=1, q_len=key.batch_size, num_columns=0,
            cu_seqlens_q=inputs.cu_seqlens_q, seq_lens=inputs.seq_lens,
            block_tables=inputs.block_tables[0], slot_mapping=inputs.slot_mapping[0],
            token_index=None, num_padding=None, copies=[],
            max_seqlen_q=1,
            max_seqlen_k=key.max_seqlen_k,  # the bound, never a step's own maximum: see the module docstring
            has_skipped_slots=True,  # padding rows hold slot -1 in every replay
            group_block_tables=inputs.block_tables if many else (),
            group_slot_mapping=inputs.slot_mapping if many else (),
            layer_group=tuple(layout["layer_group"]) if many else None,
            group_masks=layout["group_masks"], layer_masks=layout["layer_masks"], layer_source=layout["layer_source"],
        )

    def _drop_if_moved(self) -> None:
        """Drop every graph when what it replays is stale: the KV pool grew (new tensors), or the weights
        changed in a way a graph cannot follow. Checked only when the pool size or the cache's weights
        epoch moved (the epoch moves when `weights_fingerprint` changes, seen at admission): an
        in-place update (an optimizer step, `load_state_dict`) keeps every address and the graphs."""
        memory = (self.kv.pool.num_blocks, self.kv.weights.epoch)
        if memory == self._memory:
            return
        self._memory = memory
        signature = self._memory_signature()
        if signature != self._signature and self.graphs:
            logger.info("hf_paged: the KV pool or the weights moved; recapturing the decode graphs")
            self.graphs.clear()
            self.capture.reset()
        self._signature = signature

    def _memory_signature(self) -> tuple:
        """What a captured graph depends on beyond its inputs: the addresses, dtypes and shapes of the
        parameters and buffers, the KV tensors' addresses, `hf_paged.invalidate` calls (a change the
        user declared), and, for a model with peft-style adapters, the weights epoch itself: toggling
        or merging an adapter changes the forward's Python path without moving any memory."""
        model = self.model
        tensors = tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in (*model.parameters(), *model.buffers()))
        kv = tuple(t.data_ptr() for layer in self.kv.storage_layers if layer.is_initialized
                   for t in (layer.keys, layer.values))
        modules = list(model.modules())
        invalidations = sum(m.__dict__.get(VERSION_ATTR, 0) for m in modules)
        adapters = any(isinstance(getattr(type(m), "active_adapter", None), property) for m in modules)
        return tensors, kv, invalidations, self.kv.weights.epoch if adapters else None
