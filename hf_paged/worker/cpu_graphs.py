"""Compiled decode steps on CPU: the model's forward compiled by Inductor once per batch bucket.

At batch 1 an eager decode step of a small model spends most of its time in Python and in the
dispatch of a few hundred small ops (norms, rotary, activations, residual adds), not in the
weight-streaming GEMVs that set the physical floor. On CUDA, graphs remove that overhead
(`cuda_graphs.py`); on CPU the equivalent is `torch.compile`: Inductor's C++ backend fuses the
element-wise work into a few loops and calls the GEMMs directly, with no Python between them.

What is compiled: the model's call for a decode step (embeddings, norms, rotary, projections, MLPs,
the head: one graph, `fullgraph=True`). What is not: per layer, the K/V write and the paged
attention, one opaque op (`attention.interface.step_attention`) that runs the eager path's code at
every call, with the step's real lengths and block tables (`interface.compiled_step`). The compiled
forward sees a `PassThroughCache` (its `update` hands the new K/V back to the op) and a 4-D
placeholder mask (transformers then builds none; the paged path needs none).

It plugs into `DecodeGraphs` as its capture (`CompiledCapture`): the same buckets, static input
buffers, fallback and recapture rules as CUDA graphs. Differences:

* A capture compiles (its first warm-up runs Dynamo and Inductor), so buckets are captured lazily,
  one batch bucket when a step first needs it, not every batch bucket of a `max_seqlen_k` bucket at
  once. Batch 1 compiles with static shapes; every larger bucket shares one graph dynamic in the
  token count. A `max_seqlen_k` bucket changes nothing compiled (the attention op reads the real
  lengths), so a new one only re-runs the warm-up on the compiled code (Dynamo's cache hits).
* The compiled callable belongs to the model, not the runner (`compiled_forward(model)`): an
  engine rebuilt for the same model (drop-in `generate` rebuilds one when its cache settings
  change) reuses the compiled code.
* Weights are graph inputs, never frozen into constants: a weight changed in place is read as it is
  at the next step, as eagerly, and one replaced recaptures (as CUDA graphs do). Inductor's own
  fast linears on CPU (oneDNN with prepacked weights, its C++ GEMM template) need frozen weights, so
  the graph's fp32 linears call `F.linear` (MKL) or `hf.linear`'s kernel (oneDNN, as an opaque op),
  whichever reads this model's weights faster here, measured when the graph compiles.
* Batch buckets stop at `MAX_BATCH_SIZE` by default (`batch_buckets`): past a few rows a step's
  linears dominate, and compiling saves nothing measurable (SmolLM2-135M at 64 rows on one core:
  951 against 955 ms a step, at 8 rows 174 against 189), while the graph of batches above 1 costs
  one more compilation. `max_seqlen_k` buckets grow: a step past the largest (an engine that
  widened since it was built) doubles it until it fits, rather than running eagerly.
* Replays skip Dynamo's guard checks (see `CompiledCapture`).

A compilation that fails (no C++ compiler, an op Inductor cannot lower, a graph break in the model's
forward) raises `GraphCaptureError` from the warm-up; the runner warns and runs every step eagerly
from then on. Models the compiled step cannot serve are refused up front (`compile_refusal`): the
CUDA graphs' refusals (length-dependent RoPE, recurrent state, indexers) and what the opaque op
does not carry (latent attention, attention temperature tuning), and models that take images.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
import weakref
from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache

from ..config import CPU_GRAPHS_COMPILE_AFTER_STEPS
from ..attention import dispatch
from ..attention.interface import COMPILED_STEP, UnsupportedModelError, note_paged_step, paged_attention_forward
from ..attention.slots import is_flat
from ..hf import linear
from ..hf.layer import PagedLayer
from ..hf.multimodal import ImageSupport
from ..hf.rope import has_length_rope
from ..hf.support import has_latent_kv, layer_specs_of
from .cuda_graphs import CapturedGraph, batch_size_buckets

logger = logging.getLogger(__name__)

ENVIRONMENT_VARIABLE = "HF_PAGED_CPU_GRAPHS"
MAX_BATCH_SIZE = 8  # the largest default batch bucket (see the module docstring)
DYNAMIC_ROWS = 8  # the rows the graph of batches above 1 measures its linear kernels at


# ---------------------------------------------------------------------- what can be compiled
def compile_refusal(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why decode steps of `model` on `device` cannot run compiled, or None when they can."""
    if device.type != "cpu":
        return f"compiled CPU decode steps need a CPU model; this one is on {device}"
    if _compiler() is None:
        return "compiled CPU decode steps need a C++ compiler for Inductor (g++ or clang++), and none is on PATH"
    config = model.config
    if has_length_rope(config):
        return ("compiled decode steps cannot serve length-dependent RoPE (dynamic NTK, longrope: each "
                "sequence's frequencies are chosen on the host per step)")
    specs = _specs(config)
    if any(s.state is not None for s in specs):
        return ("compiled decode steps cannot serve recurrent layers (Mamba, linear attention): their mixers run "
                "per sequence over state rows chosen on the host per step")
    if any(getattr(s, "index_topk", 0) for s in specs):
        return "compiled decode steps cannot serve indexed sparse attention (DeepSeek V3.2)"
    if has_latent_kv(config):
        return "compiled decode steps cannot serve latent attention (MLA): its paged call reads the module"
    if any(getattr(m, "attn_temperature_tuning", False) for m in model.modules()):
        return "compiled decode steps cannot serve attention temperature tuning (Llama 4): it reads the module"
    if ImageSupport(model).is_supported:
        return "compiled decode steps serve text-only models; this one takes images"
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        return f"compiled decode steps cannot serve {type(quantizer).__name__}'s weights (not compileable)"
    return None


def check_cpu_graphs(enabled: bool | None, model: torch.nn.Module, device: torch.device) -> int | None:
    """Resolve the Engine's `cpu_graphs` argument to how many decode steps run eagerly before compiled
    steps start (`ModelRunner.enable_cpu_graphs`'s `after_steps`), or None: no compiled steps. True: 0 (compile when a
    step first needs it). None: `HF_PAGED_CPU_GRAPHS` (1: as True; auto: after
    `config.CPU_GRAPHS_COMPILE_AFTER_STEPS` eager decode steps where compiled steps can run; 0 or unset: off).
    Off by default: a compile takes 7-60 s of the machine's cores, which a step, or a server's requests, would
    otherwise wait for at a moment nobody chose.

    Raises:
        ValueError: `enabled` is True where compiled steps cannot run, naming why.
    """
    deferred = False
    if enabled is None:
        choice = os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower()
        if choice not in ("", "0", "1", "auto"):
            raise ValueError(f"{ENVIRONMENT_VARIABLE} must be 0, 1 or auto, got {choice!r}")
        enabled = {"": False, "0": False, "1": True, "auto": None}[choice]
        deferred = enabled is None
    if enabled is False:
        return None
    reason = compile_refusal(model, device)
    if reason is not None and enabled:
        raise ValueError(f"cpu_graphs=True: {reason}")
    if reason is not None:
        return None
    return CPU_GRAPHS_COMPILE_AFTER_STEPS if deferred else 0


def batch_buckets(max_num_seqs: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The batch buckets of compiled CPU steps: `sizes` (`cuda_graphs.batch_size_buckets` checks them), or
    1, 2, 4, ... up to `MAX_BATCH_SIZE` and `max_num_seqs`, whichever is smaller."""
    if sizes is not None:
        return batch_size_buckets(max_num_seqs, sizes)
    return batch_size_buckets(min(max_num_seqs, MAX_BATCH_SIZE))


def _specs(config) -> list:
    try:
        return list(layer_specs_of(config))
    except ValueError:
        return []


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")


# ---------------------------------------------------------------------- the compiled forward
class PassThroughCache(Cache):
    """The cache a compiled forward hands the model: `update` returns the new K/V unchanged, and the
    layer's attention op (`interface.step_attention`) writes them through the step's real cache. Every
    question that needs the step's host values raises (the model's forward asked something the
    compiled step cannot answer: the compilation fails and steps run eagerly)."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[_PassThroughLayer() for _ in range(num_layers)])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise UnsupportedModelError("hf_paged: the model reads its cache's length inside a compiled decode step")

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        raise UnsupportedModelError("hf_paged: the model builds a mask inside a compiled decode step")

    @property
    def is_compileable(self) -> bool:
        return True


class _PassThroughLayer:
    is_sliding = False
    is_compileable = True
    is_initialized = True
    supports_early_init = False


class StepAttention:
    """What the attention ops of a compiled step call (`interface.compiled_step`), per layer: the K/V
    write and the paged attention of an eager step.

    A plain layer (its own unquantised blocks, laid end to end, no window, chunk, softcap or sinks)
    takes the short way: its rows written with one `index_copy_` per tensor into the slots found once
    per step, and its attention by the native CPU kernel on runs planned once per step
    (`dispatch.DecodeRuns`; where that kernel does not run, `dispatch.paged_attention` with the step's plan). Every other layer takes the eager
    step's own code: `PagedCache.update`, then `paged_attention_forward` (its checks, masks and
    features). Both write and read the same blocks with the same kernels; the short way skips per-layer
    checks that hold for the whole step (about 0.1 ms a layer on a 2-core CPU).
    """

    def __init__(self, cache, step):
        self.cache = cache
        self.step = step
        self.kv = cache.kv
        self._rows = None  # (row index or None, slots) per KV group: where the step's real rows go
        self._runs: dict[tuple, dispatch.DecodeRuns | None] = {}  # per (KV group, block size): the kernel's runs

    def __call__(self, query, key, value, layer_idx: int, scaling: float, sliding_window: int | None,
                 softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:  # [1, B, Hq, Dv]
        layer = self.kv.layers[layer_idx]
        if sliding_window is None and softcap is None and sinks is None and self._is_plain(layer, layer_idx, key):
            return self._attend_plain(query, key, value, layer, layer_idx, scaling)
        keys, values = self.cache.update(key, value, layer_idx)
        out, _ = paged_attention_forward(_LayerRef(layer_idx), query, keys, values, None, scaling=scaling,
                                         sliding_window=sliding_window, softcap=softcap, s_aux=sinks,
                                         paged_metadata=self.step)
        return out.contiguous()

    def _is_plain(self, layer, layer_idx: int, key: torch.Tensor) -> bool:
        step = self.step
        mask = step.mask_of(layer_idx)
        return (type(layer) is PagedLayer and layer.is_initialized and layer.scales is None
                and layer.belongs_to(self.kv) and layer.keys.dtype == key.dtype
                and mask.window is None and mask.chunk is None and step.source_of(layer_idx) == layer_idx
                and step.token_index is None and step.batch_size == 1
                and is_flat(layer.keys) and is_flat(layer.values))

    def _attend_plain(self, query, key, value, layer, layer_idx: int, scaling: float) -> torch.Tensor:
        step = self.step
        group = step.group_of(layer_idx)
        rows, slots = self._slots(group)
        for states, cache in ((key, layer.keys), (value, layer.values)):
            packed = states[0].transpose(0, 1)  # [B, Hkv, D]: the step's tokens (batch 1 of B columns)
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, packed if rows is None else packed[rows])
        step.layers_done.add(layer_idx)  # the transaction's record, as `KVOwner.write` keeps it
        step.active_layer = layer_idx
        if len(step.layers_done) == len(self.kv.storage_layers):
            note_paged_step(None)  # masks built after this forward are for someone else
        query = query[0].transpose(0, 1)  # [B, Hq, D]
        key = (group, layer.keys.shape[1])
        if key not in self._runs:
            self._runs[key] = dispatch.DecodeRuns.plan_step(step.plan, step.block_tables_of(group), step.seq_lens,
                                                            layer.keys.shape[1])
        runs = self._runs[key]
        out = runs(query, layer.keys, layer.values, scaling) if runs is not None else None
        if out is None:
            out = dispatch.paged_attention(query, layer.keys, layer.values, step.block_tables_of(group), step.seq_lens,
                                           step.cu_seqlens_q, step.max_seqlen_q, step.max_seqlen_k, scaling,
                                           plan=step.plan)  # [B, Hq, Dv]
        return out[None].contiguous()  # the op's declared layout (a fallback backend may return a view)

    def _slots(self, group: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The rows of this step that hold a token to write (None: all) and their slots, in group `group`
        (read on the host once per step and group: padding rows hold slot -1)."""
        if self._rows is None:
            self._rows = {}
        if group not in self._rows:
            slots = self.step.slot_mapping_of(group)
            host = slots.tolist()
            kept = [i for i, slot in enumerate(host) if slot >= 0]
            if len(kept) == len(host):
                self._rows[group] = (None, slots)
            else:
                rows = torch.tensor(kept, dtype=torch.long, device=slots.device)
                self._rows[group] = (rows, slots.index_select(0, rows))
        return self._rows[group]


class _LayerRef:
    """What the paged path reads of an attention module: its layer index (modules whose paged call
    reads more, latent or temperature-tuned attention, are refused: `compile_refusal`)."""

    __slots__ = ("layer_idx",)

    def __init__(self, layer_idx: int):
        self.layer_idx = layer_idx


class CompiledForward:
    """`(input_ids [1, B], position_ids [1, B]) -> [B, vocab]` logits of a decode step's forward,
    compiled; run inside `interface.compiled_step`. One per model (`compiled_forward`)."""

    def __init__(self, model: torch.nn.Module, cache_kwarg: str):
        cache = PassThroughCache(model.config.get_text_config(decoder=True).num_hidden_layers)
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # 4-D: transformers takes it as built, and builds none
        kwargs = {cache_kwarg: cache}
        ref = weakref.ref(model)  # `_FORWARDS` must not keep the model alive

        def forward(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:  # [B, vocab]
            out = ref()(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                        paged_metadata=COMPILED_STEP, logits_to_keep=0, **kwargs)
            return out.logits[0]

        self.forward = forward
        self.model = ref
        self._compiled: dict[tuple, Callable] = {}
        self.linear_kernels: dict[tuple, str] = {}  # per graph key, the linear kernel it calls (`_backend`)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        key = self.key_for(input_ids.shape[-1])
        fn = self._compiled.get(key)
        if fn is None:
            backend = functools.partial(_backend, rows=1 if key[0] else DYNAMIC_ROWS, forward=self, key=key)
            fn = self._compiled[key] = torch.compile(self.forward, fullgraph=True, dynamic=not key[0],
                                                     backend=backend)
        return fn(input_ids, position_ids)

    @staticmethod
    def key_for(num_rows: int) -> tuple[bool, int]:
        """Which compiled graph a forward of `num_rows` rows runs: batch 1 compiles with static shapes,
        every larger batch shares one graph dynamic in its rows; which linear kernel runs depends on
        the thread count (see `_backend`), so each count has its own."""
        return num_rows == 1, torch.get_num_threads()


_FORWARDS: "weakref.WeakKeyDictionary[torch.nn.Module, CompiledForward]" = weakref.WeakKeyDictionary()


def compiled_forward(model: torch.nn.Module, cache_kwarg: str) -> CompiledForward:
    """The model's compiled decode forward (made once per model; compiled on first call per shape)."""
    forward = _FORWARDS.get(model)
    if forward is None:
        forward = _FORWARDS[model] = CompiledForward(model, cache_kwarg)
    return forward


# ---------------------------------------------------------------------- the linears
@torch.library.custom_op("hf_paged::linear", mutates_args=())
def fast_linear_op(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` on the kernel hf_paged's eager forwards use (`hf.linear`: oneDNN's inner product,
    which reads the weights on every thread where MKL's sgemm streams them on one at a few rows). Opaque
    to Inductor, whose own lowering of that kernel needs frozen weights."""
    return _linear_kernel()(input, weight, bias)


@fast_linear_op.register_fake
def _(input, weight, bias):
    return input.new_empty(*input.shape[:-1], weight.shape[0])


def _linear_kernel():
    kernel = linear.linear_kernel()
    if kernel is None:  # switched off since the graph was compiled: the stock kernel, same results
        return torch.nn.functional.linear
    return kernel


def _backend(gm: torch.fx.GraphModule, example_inputs, rows: int, forward: CompiledForward, key: tuple):
    """Inductor, after routing the graph's fp32 linears to `fast_linear_op` where that kernel reads the
    model's weights faster than the stock one (`faster_linear_kernel`, measured now, at this graph's
    rows and the thread count)."""
    model = forward.model()
    kernel = faster_linear_kernel(model, rows) if model is not None else "stock"
    forward.linear_kernels[key] = kernel
    if kernel == "hf_paged":
        for node in list(gm.graph.nodes):  # Dynamo's graph: torch-level calls, example values in `meta`
            if node.op == "call_function" and node.target is torch.nn.functional.linear and _is_fp32(node):
                node.target = torch.ops.hf_paged.linear.default
                node.args = (*node.args, *(None,) * (3 - len(node.args)))
                node.kwargs = {}
        gm.recompile()
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def faster_linear_kernel(model: torch.nn.Module, rows: int, repeats: int = 3) -> str:
    """"hf_paged" when `hf.linear`'s kernel (oneDNN's inner product) reads the model's fp32 linear weights
    faster than `F.linear`'s (MKL's sgemm) at `rows` rows on this machine's threads, else "stock": one
    sweep over every linear (cold in cache, as in decoding) per kernel and repeat, alternated, the best
    of `repeats` compared. Which one wins depends on the CPU: MKL's reads on one thread at a few rows
    on the AMD EPYC `hf.linear` was measured on, on both of a 2-core Ice Lake Xeon, where it takes 0.6x
    oneDNN's time at one row (`benchmarks/latency.py --kernels`)."""
    kernel = linear.linear_kernel()
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)
               and type(m.weight) in (torch.Tensor, torch.nn.Parameter) and m.weight.dtype == torch.float32
               and m.weight.device.type == "cpu"]
    if kernel is None or not weights:
        return "stock"
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    best = {"stock": float("inf"), "hf_paged": float("inf")}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, fn in (("stock", torch.nn.functional.linear), ("hf_paged", kernel)):
                began = time.perf_counter()
                for w in weights:
                    fn(inputs[w.shape[1]], w)
                best[name] = min(best[name], time.perf_counter() - began)
    return "hf_paged" if best["hf_paged"] < best["stock"] else "stock"


def _is_fp32(node: torch.fx.Node) -> bool:
    values = [a.meta.get("example_value") for a in node.all_input_nodes]
    return all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.device.type == "cpu"
               and type(v).__name__ in ("FakeTensor", "Tensor", "Parameter") for v in values)


# ---------------------------------------------------------------------- the capture
class CompiledCapture:
    """`DecodeGraphs`' capture for compiled CPU steps: the forward it is handed already runs the
    compiled code (the warm-up before it compiled it, or found it compiled); a replay runs it again on
    the static inputs and copies the logits into the output the capture returned.

    Attributes:
        num_captures: buckets captured.
    """

    captures_lazily = True  # one bucket per capture: each may compile (see the module docstring)

    def __init__(self):
        self.num_captures = 0

    def __call__(self, forward: Callable[[], torch.Tensor]) -> CapturedGraph:
        output = forward().clone()
        self.num_captures += 1

        def replay() -> None:
            # Dynamo's guards (every input's and parameter's metadata, the modules' state) were checked
            # by the warm-up and this capture, and are not evaluated again: about 2.5 ms, 5% of a batch-1
            # step of a 135M model. A replay is then exactly as stale as a CUDA graph's: `DecodeGraphs`
            # recaptures (checking them again) when the weights' memory, dtypes or shapes or the pool
            # change, or on `hf_paged.invalidate`; a change that moves none of these while requests run
            # (a forward hook added) is seen at the next recapture.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                output.copy_(forward())

        return CapturedGraph(replay, output, None)

    def reset(self) -> None:
        pass
