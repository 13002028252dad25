"""The attention backend protocol: one call object per layer, one declaration per backend.

    LayerCall        what one layer asks of attention: its query and K/V caches, the step's block
                     tables and lengths, its `MaskRule`, softcap, sinks and a quantised cache's scales
    MaskRule         which keys a query sees: key j is visible to query p iff j <= p and j >= lo(p),
                     lo(p) = max(p - w + 1 with a window w, (p // C) * C with a chunk C, 0)
                     (positions count each sequence's real tokens from 0)
    Capabilities     a backend's declaration: devices, mask kinds, dtypes, quantised K/V, head sizes,
                     block sizes, sinks, softcap, strided (byte-page) caches, autograd, key limits
    AttentionBackend the protocol: `refusal(call)` (None: it takes the call, else why not), `run(call,
                     plan)` per layer with the step's `plan.StepPlan` (which memoises what the
                     backend planned for the step), `store_kv`, and `fallback`: the backend that runs
                     what this one does not declare

The built-in backends, in the order "auto" tries them on a device:

    triton  CUDA (or the CPU under TRITON_INTERPRET=1): the split-KV decode and the varlen prefill kernels
    cpu     CPU: the native kernel for decode and verify runs, the torch path for the prefill runs
    torch   anywhere: reads every call (any float or quantised K/V, strided caches, key limits, autograd)
    flex    FlexAttention compiled by Inductor; only when asked for

Each falls back to torch for a layer it does not declare (a strided cache on the CPU kernel, sinks on
flex's CPU template, a head size past Triton's): `dispatch` walks the chain and refuses, with a
ValueError naming what is unsupported and before any kernel runs, a layer nobody declares.

Adding a mask kind is one field of `MaskRule` (its lower bound in `lower_bound`) plus, in each backend
that takes it, its name in `mask_kinds` and its rule in the kernel; a backend that does not declare
it is never handed such a layer. Adding a backend is one class here (`register`).

Knows tensors and the step plan only; nothing here decides which block holds a token.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from ..config import MAX_DECODE_QUERY_LEN
from ..kv_spec import MaskRule
from . import cpu_kernel, flex_paged, torch_paged
from .kv_quant import KVScales
from .triton.checks import QUANTIZED_DTYPES, can_read_kv_dtype, has_fp8e4nv

if TYPE_CHECKING:
    from .plan import StepPlan

logger = logging.getLogger(__name__)


CAUSAL = MaskRule()


@functools.lru_cache(maxsize=256)
def mask_rule(window: int | None = None, chunk: int | None = None) -> MaskRule:
    """The `MaskRule` of (window, chunk), one object per pair: every layer of a kind shares it."""
    return MaskRule(window, chunk)


@dataclass
class LayerCall:
    """One layer's attention call: everything a backend reads, in one object (the arguments of
    `dispatch.paged_attention`, with the mask as a `MaskRule`)."""

    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim], packed by cu_seqlens_q
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], any block stride
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, tokens in the cache incl. this step's
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    scale: float
    mask: MaskRule = CAUSAL
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [num_q_heads]
    scales: KVScales | None = None  # a quantised cache's scales
    # Latent attention (MLA, absorbed): one K/V head whose V is the first `latent_dim` columns of the same
    # rows (`value_cache is key_cache[..., :latent_dim]`); the output is [num_tokens, num_q_heads, latent_dim].
    latent_dim: int | None = None

    @property
    def is_strided(self) -> bool:
        """Whether a cache is a non-contiguous view (a byte page's slice: block stride > its own size)."""
        return not (self.key_cache.is_contiguous() and self.value_cache.is_contiguous())

    @property
    def needs_grad(self) -> bool:
        """Whether autograd would differentiate this call."""
        return torch.is_grad_enabled() and (self.query.requires_grad or self.key_cache.requires_grad
                                            or self.value_cache.requires_grad)


def _any_float(query_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    return kv_dtype.is_floating_point or kv_dtype in QUANTIZED_DTYPES


def _same(query_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    return kv_dtype == query_dtype


@dataclass(frozen=True)
class Capabilities:
    """A backend's declaration: the layers it takes. `refusal` checks a call against it.

    Attributes:
        devices: device types it runs on (None: any).
        mask_kinds: `MaskRule.kinds` it applies ("window", "chunk"); plain causal always.
        query_dtypes: query dtypes it reads (None: any floating dtype).
        reads_kv: (query dtype, K/V dtype) -> whether it reads that cache under that query.
        mixed_kv_dtypes: whether the key and value caches may differ in dtype.
        quant_schemes: quantised-cache schemes it reads (empty: none).
        max_head_dim: widest K or V head (None: any); head_dim_multiple: what both must divide by.
        max_block_size: largest block (None: any).
        sinks_on: device types where it applies sinks.
        softcap: whether it applies a softcap.
        strided_caches: whether it reads caches whose block stride exceeds a block (byte pages).
        differentiable: whether it runs calls autograd differentiates (False: refused; None: not
            checked, the backend runs them and returns no gradient).
        key_limits: whether it runs steps whose queries see past their own position (a step fact,
            checked by `dispatch.plan`).
        latent_kv: whether it reads latent calls (`LayerCall.latent_dim`: V the prefix of K's rows)
            itself, whatever their head width and row stride.
    """

    devices: frozenset[str] | None
    mask_kinds: frozenset[str] = frozenset({"window", "chunk"})
    query_dtypes: frozenset[torch.dtype] | None = frozenset({torch.float16, torch.bfloat16, torch.float32})
    reads_kv: Callable[[torch.dtype, torch.dtype], bool] = _same
    mixed_kv_dtypes: bool = False
    quant_schemes: frozenset[str] = frozenset()
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    max_block_size: int | None = None
    sinks_on: frozenset[str] = frozenset({"cpu", "cuda"})
    softcap: bool = True
    strided_caches: bool = True
    differentiable: bool | None = True
    key_limits: bool = False
    latent_kv: bool = False

    def refusal(self, call: LayerCall) -> str | None:
        """None when the declaration covers `call`, else what it does not cover, in words."""
        query, key_cache = call.query, call.key_cache
        device = query.device.type
        if self.devices is not None and device not in self.devices:
            return f"{device} tensors"
        missing = call.mask.kinds - self.mask_kinds
        if missing:
            return " and ".join(_describe_mask(call.mask, kind) for kind in sorted(missing))
        if not (query.dtype.is_floating_point if self.query_dtypes is None else query.dtype in self.query_dtypes):
            return f"{query.dtype} queries"
        value_dtype = call.value_cache.dtype
        if key_cache.dtype != value_dtype and not self.mixed_kv_dtypes:
            return f"a {key_cache.dtype} key cache beside a {value_dtype} value cache"
        for kv_dtype in {key_cache.dtype, value_dtype}:
            if not self.reads_kv(query.dtype, kv_dtype):
                return f"a {kv_dtype} K/V cache under {query.dtype} queries"
        if call.scales is not None and call.scales.quant.scheme not in self.quant_schemes:
            return f"a quantised cache (kv_quant_scheme={call.scales.quant.scheme!r})"
        latent = call.latent_dim is not None and self.latent_kv  # its own kernel reads the rows
        head_dim, head_dim_v = key_cache.shape[3], call.value_cache.shape[3]
        if not latent and self.max_head_dim is not None and max(head_dim, head_dim_v) > self.max_head_dim:
            return f"head_dim {head_dim} / head_dim_v {head_dim_v} (at most {self.max_head_dim})"
        if not latent and (head_dim % self.head_dim_multiple or head_dim_v % self.head_dim_multiple):
            return f"head_dim {head_dim} / head_dim_v {head_dim_v} (multiples of {self.head_dim_multiple} only)"
        if self.max_block_size is not None and key_cache.shape[1] > self.max_block_size:
            return f"block_size {key_cache.shape[1]} (at most {self.max_block_size})"
        if call.sinks is not None and device not in self.sinks_on:
            return f"sinks on {device}"
        if call.softcap is not None and not self.softcap:
            return "softcap"
        if not self.strided_caches and call.is_strided and not latent:
            return "a strided (byte-page) K/V cache"
        if self.differentiable is False and call.needs_grad:
            return "a call autograd differentiates"
        return None


def _describe_mask(mask: MaskRule, kind: str) -> str:
    value = getattr(mask, kind, None)
    return {"window": f"a sliding window ({value})", "chunk": f"chunked attention (chunk_size={value})"}.get(
        kind, f"the {kind!r} mask")


class AttentionBackend(Protocol):
    """What `dispatch` needs of a backend (see the module docstring)."""

    name: str
    capabilities: Capabilities
    fallback: str | None  # the backend that runs the layers this one does not declare (None: refused)
    auto_devices: frozenset[str] | None  # device types "auto" may pick it for (None: any)

    def unavailable(self, device: torch.device) -> str | None:
        """Why this backend cannot serve steps on `device` at all (None: it can), worded to follow
        "HF_PAGED_BACKEND=<name> "."""

    def refusal(self, call: LayerCall) -> str | None:
        """None when it takes `call`, else what it does not take."""

    def run(self, call: LayerCall, plan: "StepPlan") -> torch.Tensor | None:
        """[num_tokens, num_q_heads, head_dim_v]; None hands the call to `fallback` (nothing written)."""

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, has_skipped_slots: bool, scales: KVScales | None) -> None:
        """Write new K/V rows into their slots (see `torch_paged.store_kv`)."""


@dataclass
class Backend:
    """A backend whose declaration is its `capabilities` (plus `extra_refusal`) and whose K/V writes
    are the torch path's; `run` is the subclass's."""

    name: str
    capabilities: Capabilities
    fallback: str | None = "torch"
    auto_devices: frozenset[str] | None = frozenset()
    extra_refusal: Callable[[LayerCall], str | None] | None = field(default=None, repr=False)

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def refusal(self, call: LayerCall) -> str | None:
        why = self.capabilities.refusal(call)
        if why is None and self.extra_refusal is not None:
            why = self.extra_refusal(call)
        return why

    def run(self, call: LayerCall, plan: "StepPlan") -> torch.Tensor | None:
        raise NotImplementedError

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping, has_skipped_slots, scales) -> None:
        torch_paged.store_kv(key, value, key_cache, value_cache, slot_mapping, has_skipped_slots, scales=scales)


class TorchBackend(Backend):
    def run(self, call: LayerCall, plan: "StepPlan") -> torch.Tensor:
        return _torch_run(call, plan, native=False)


class CpuBackend(Backend):
    """The native kernel for the decode and verify runs of a layer it takes, the torch path for that
    layer's prefill runs (one plan: `torch_paged.AttentionPlan(native=True)`)."""

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"runs on CPU tensors, not {device.type}; use auto"
        if cpu_kernel.load() is None:
            return (f"cannot run: the CPU attention kernel could not be built ({cpu_kernel.load_error()}); use "
                    "HF_PAGED_BACKEND=torch")
        return None

    def run(self, call: LayerCall, plan: "StepPlan") -> torch.Tensor | None:
        if call.latent_dim is not None:
            return cpu_kernel.latent_attention(call, plan.workspace)  # None (a prefill run): the torch path runs it
        return _torch_run(call, plan, native=True)


def _torch_run(call: LayerCall, plan: "StepPlan", native: bool) -> torch.Tensor:
    return torch_paged.paged_attention(
        call.query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens, call.cu_seqlens_q,
        call.max_seqlen_q, call.max_seqlen_k, call.scale, sliding_window=call.mask.window, softcap=call.softcap,
        sinks=call.sinks, plan=plan.torch_plan(call), scales=call.scales, chunk_size=call.mask.chunk, native=native)


class FlexBackend(Backend):
    def run(self, call: LayerCall, plan: "StepPlan") -> torch.Tensor | None:
        # None: a shape past flex's compile limit, which the fallback runs
        return flex_paged.paged_attention(call.query, call.key_cache, call.value_cache, plan.flex_plan(call),
                                          call.scale, call.mask.window, call.softcap, call.sinks,
                                          chunk_size=call.mask.chunk)


class TritonBackend(Backend):
    """Up to `MAX_DECODE_QUERY_LEN` queries per sequence the split-KV decode kernel, above it the tiled
    prefill kernel. The Triton modules are imported on first use only."""

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return ("on a non-CUDA device needs Triton's interpreter: set TRITON_INTERPRET=1 before hf_paged's "
                    "kernels are first used")
        try:
            import triton  # noqa: F401
        except ImportError:
            return "needs Triton, which is not installed"
        return None

    def run(self, call: LayerCall, plan: "StepPlan") -> torch.Tensor | None:
        if call.latent_dim is not None:
            if call.sinks is not None or call.softcap is not None or call.mask.kinds:
                return None  # the latent kernel is plain causal: the torch path runs the rest
            from .triton import latent

            return latent.latent_attention(call.query, call.key_cache, call.latent_dim, call.block_tables,
                                           call.seq_lens, call.cu_seqlens_q, call.max_seqlen_q, call.max_seqlen_k,
                                           call.scale)
        if call.max_seqlen_q <= MAX_DECODE_QUERY_LEN:
            from .triton import decode

            kernel = decode.paged_decode  # looked up per call: tests count the launches through it
        else:
            from .triton import prefill

            kernel = prefill.flash_prefill
        return kernel(call.query, call.key_cache, call.value_cache, call.block_tables, call.seq_lens,
                      call.cu_seqlens_q, call.max_seqlen_q, call.max_seqlen_k, call.scale,
                      sliding_window=call.mask.window, softcap=call.softcap, sinks=call.sinks, scales=call.scales,
                      plan=plan.triton_plan(call), chunk_size=call.mask.chunk)

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping, has_skipped_slots, scales) -> None:
        from .triton.store_kv import store_kv as triton_store_kv

        triton_store_kv(key, value, key_cache, value_cache, slot_mapping, scales=scales)


def _triton_refusal(call: LayerCall) -> str | None:
    if call.key_cache.dtype == torch.float8_e4m3fn and not has_fp8e4nv(call.key_cache.device):
        return "a float8_e4m3fn cache on a GPU below compute capability 8.9"
    return None


def _torch_refusal(call: LayerCall) -> str | None:
    if call.query.is_cuda and torch.cuda.is_current_stream_capturing():
        return "a CUDA graph capture (the torch path reads the step's lengths on the host)"
    return None


def _cpu_reads_kv(query_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    return kv_dtype in cpu_kernel.FLOAT_KV_DTYPES.get(query_dtype, ()) or kv_dtype in cpu_kernel.QUANTIZED_KV_DTYPES


def _cpu_refusal(call: LayerCall) -> str | None:
    num_kv_heads = call.key_cache.shape[2]
    if not num_kv_heads or call.query.shape[1] % num_kv_heads:
        return f"num_q_heads {call.query.shape[1]} over num_kv_heads {num_kv_heads}"
    return None


_BUILT_IN = (
    TritonBackend("triton", Capabilities(
        devices=frozenset({"cuda", "cpu"}),  # the CPU under Triton's interpreter only (`unavailable`)
        reads_kv=can_read_kv_dtype, quant_schemes=frozenset({"dynamic", "dynamic_token", "unit"}),
        max_head_dim=256, differentiable=None, latent_kv=True), auto_devices=frozenset({"cuda"}), extra_refusal=_triton_refusal),
    # The kernel reads fp32/bf16/fp16 queries over their own dtype's K/V (fp32 also over 16-bit K/V) and every
    # quantised scheme in registers; a call it does not take runs on the torch path inside the same plan
    # (`cpu_kernel.can_run`), strided byte pages included.
    CpuBackend("cpu", Capabilities(
        devices=frozenset({"cpu"}), query_dtypes=frozenset(cpu_kernel.QUERY_DTYPES), reads_kv=_cpu_reads_kv,
        quant_schemes=frozenset({"dynamic", "dynamic_token", "unit", "asymmetric"}),
        max_head_dim=cpu_kernel.MAX_HEAD_DIM, head_dim_multiple=cpu_kernel.LANES,
        max_block_size=cpu_kernel.MAX_BLOCK_SIZE, differentiable=False, latent_kv=True),
        auto_devices=frozenset({"cpu"}), extra_refusal=_cpu_refusal),
    TorchBackend("torch", Capabilities(
        devices=None, query_dtypes=None, reads_kv=_any_float, mixed_kv_dtypes=True,
        quant_schemes=frozenset({"dynamic", "dynamic_token", "unit", "asymmetric"}), key_limits=True),
        fallback=None, auto_devices=None, extra_refusal=_torch_refusal),
    FlexBackend("flex", Capabilities(
        devices=frozenset({"cpu", "cuda"}), sinks_on=frozenset({"cuda"}), strided_caches=False,
        differentiable=False)),
)

_registry: dict[str, AttentionBackend] = {b.name: b for b in _BUILT_IN}


def backends() -> dict[str, AttentionBackend]:
    """The registered backends by name, in the order "auto" tries them."""
    return _registry


def register(backend: AttentionBackend, before: str | None = None) -> None:
    """Add (or replace) `backend`; it goes before `before` in auto's order (None: last)."""
    if backend.name == "auto":
        raise ValueError("'auto' is the choice among backends, not a backend's name")
    entries = [(n, b) for n, b in _registry.items() if n != backend.name]
    at = next((i for i, (n, _) in enumerate(entries) if n == before), len(entries))
    entries.insert(at, (backend.name, backend))
    _registry.clear()
    _registry.update(entries)


def unregister(name: str) -> None:
    """Remove a backend added with `register` (the built-in ones stay)."""
    if name in {b.name for b in _BUILT_IN}:
        raise ValueError(f"{name!r} is a built-in backend")
    _registry.pop(name, None)


_said: set[tuple[str, str]] = set()


def note_fallback(name: str, why: str, to: str) -> None:
    """Log, once per (backend, reason), that a layer went to a fallback (it runs slower there)."""
    if (name, why) not in _said:
        _said.add((name, why))
        logger.info("hf_paged: the %s attention backend does not take %s; those layers run on %s", name, why, to)
