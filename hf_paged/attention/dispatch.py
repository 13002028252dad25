"""One dispatch for the attention kernels, in FlashInfer's shape: `plan` once per step, then
`store_kv` and `paged_attention` (the `run`) per layer with that plan.

Owns the choice of backend and nothing else: callers (the `interface` attention function, the cache
adapter) call `plan` / `store_kv` / `paged_attention` here and never import a backend directly. The
backends and what each declares it takes are in `backend.py`.

The choice, made by `plan` once per step: the caller's (`plan(step, backend=...)`, e.g. an engine
option), else `HF_PAGED_BACKEND` (`torch`, `cpu`, `flex`, `triton`, or `auto`, the default). "auto"
takes the first registered backend that runs on the step's device (`backend.AttentionBackend.auto_devices`):
Triton on CUDA tensors; on the CPU "cpu", the native kernel (`cpu_kernel`, built on first use) for
the decode and verify runs and the torch path for the prefill runs, or "torch" alone where that
kernel cannot be built. "flex" (`flex_paged`, FlexAttention compiled by Inductor, on either device)
runs when asked for. The tests force Triton on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`). A step whose facts the chosen backend does not declare (queries that see
past their own position: Gemma 3's images) goes to its fallback, torch.

Per layer, `paged_attention` builds one `backend.LayerCall` and hands it to the first of the step's
backends (the chosen one, then its fallbacks) whose declaration covers it: a strided (byte-page)
cache, for instance, goes past the CPU kernel and flex to the torch path, and a head wider than the
Triton kernels take (Gemma 4's 512) from Triton to torch (said once in the log; inside a CUDA graph
capture the torch path cannot run, as it reads the step's lengths on the host, so there it is
refused). A layer no backend takes is a ValueError naming what is unsupported, raised before any
kernel runs. A call with a plan reads no
environment; a call without one (a kernel test, a caller with no step) plans for itself.

The Triton modules are imported on first use only, so importing hf_paged never needs a GPU or
compiles anything.
"""

from __future__ import annotations

import os

import torch

from . import backend as backends
from . import cpu_kernel
from .backend import LayerCall, mask_rule
from .kv_quant import rotate
from .plan import StepPlan
from .workspace import Workspace

ENVIRONMENT_VARIABLE = "HF_PAGED_BACKEND"


def choices() -> tuple[str, ...]:
    """What a caller may choose: "auto" and every registered backend's name."""
    return ("auto", *backends.backends())


def backend(device: torch.device, choice: str | None = None) -> str:
    """The backend a step on `device` runs first: `choice` (None: `HF_PAGED_BACKEND`, default "auto")
    resolved to a backend that serves the device (see the module docstring). "flex" only when asked
    for: on the CPU it measures slower than "cpu" at every shape of `benchmarks/attention.py`, and on
    CUDA it has not been measured against Triton.

    Raises:
        ValueError: an unknown choice, or a backend asked for that cannot serve `device`, naming why.
    """
    return _chain(device, choice)[0]


def _chain(device: torch.device, choice: str | None, key_limits: bool = False) -> tuple[str, ...]:
    """The step's backends: the one chosen (or auto's), then its fallbacks, each serving the step."""
    source = "attention_backend" if choice is not None else ENVIRONMENT_VARIABLE
    if choice is None:
        choice = os.environ.get(ENVIRONMENT_VARIABLE, "auto")
    name = str(choice).lower()
    registry = backends.backends()
    if name not in registry and name != "auto":
        raise ValueError(f"{source} must be one of {choices()}, got {choice!r}")
    if name == "auto":
        name = next((n for n, b in registry.items()
                     if (b.auto_devices is None or device.type in b.auto_devices) and b.unavailable(device) is None),
                    "torch")
    else:
        why = registry[name].unavailable(device)
        if why is not None:
            raise ValueError(f"{source}={name} {why}")
    chain, seen = [], set()
    while name is not None and name not in seen:
        seen.add(name)
        entry = registry[name]
        if not (key_limits and not entry.capabilities.key_limits) and (not chain or entry.unavailable(device) is None):
            chain.append(name)
        name = entry.fallback
    if not chain:
        raise ValueError(f"hf_paged: no attention backend from {choice!r} on runs this step (its queries see past "
                         "their own position, which only the torch backend reads)")
    return tuple(chain)


def plan(step, workspace: Workspace | None = None, backend: str | None = None) -> StepPlan:
    """The attention plan of `step` (a `metadata.StepMetadata`): its backends, chosen here once, and
    the per-kind launch plans its layers fill in (see `plan.StepPlan`).

    Args:
        workspace: the cache's scratch, reused by every layer and step.
        backend: "auto" or a backend's name (`choices()`), e.g. an engine's `attention_backend`
            option; it wins over HF_PAGED_BACKEND. None: read HF_PAGED_BACKEND.
    """
    key_limits = getattr(step, "key_limits", None)
    chain = _chain(step.seq_lens.device, backend, key_limits is not None)
    return StepPlan(chain[0], workspace, key_limits=key_limits, fallbacks=chain[1:])


def check_kv_cache_dtype(dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
                         quant_scheme: str | None = None, backend_name: str | None = None) -> None:
    """Raise ValueError, before any forward, when paged attention on `device` cannot read a `kv_dtype`
    K/V cache under `dtype` queries. The torch backend reads any float or quantised cache (it casts or
    dequantises K/V to the query's dtype); the Triton kernels read the query's own dtype, fp16/bf16
    under fp32 queries, and int8/fp8 payloads with symmetric scales (`quant_scheme` not "asymmetric").
    `backend_name`: the step plan's backend (None: read it for `device`)."""
    if (backend_name or backend(device)) != "triton":
        return
    from .triton.checks import can_read_kv_dtype, has_fp8e4nv

    if quant_scheme == "asymmetric" and kv_dtype.itemsize == 1:  # the scheme means nothing unquantised
        raise ValueError("kv_quant_scheme='asymmetric' is implemented on the torch path only; the Triton kernels "
                         "read symmetric scales ('dynamic', 'dynamic_token', 'unit'); or set HF_PAGED_BACKEND=torch")
    if kv_dtype == torch.float8_e4m3fn and not has_fp8e4nv(device):
        raise ValueError("kv_cache_dtype='fp8_e4m3' ('fp8') needs an NVIDIA GPU of compute capability 8.9+ (Ada, "
                         "Hopper) in Triton; use kv_cache_dtype='fp8_e5m2' or 'int8' here, or HF_PAGED_BACKEND=torch")
    if not can_read_kv_dtype(dtype, kv_dtype):
        name = str(kv_dtype).removeprefix("torch.")
        raise ValueError(
            f"kv_cache_dtype={name!r} under a {dtype} model: the Triton attention kernels read a KV cache of the "
            "model's dtype, or a float16/bfloat16 cache under a float32 model; use kv_cache_dtype='auto', or "
            "HF_PAGED_BACKEND=torch"
        )


def store_kv(key, value, key_cache, value_cache, slot_mapping, has_skipped_slots: bool = True, scales=None,
             plan: StepPlan | None = None) -> None:
    """Write new K/V rows into their slots; slot -1 is skipped. See `torch_paged.store_kv`
    (`has_skipped_slots=False` promises there is no -1, which spares the torch path a check;
    `scales`, a quantised cache's `kv_quant.KVScales`, makes the write quantise, after rotating the
    rows when its scheme rotates: see `kv_quant`; `plan`: the step's, whose backend writes; the
    caches may be strided views of byte pages)."""
    if scales is not None and scales.quant.rotate:
        key, value = rotate(key), rotate(value)
    name = plan.backend if plan is not None else backend(key.device)
    backends.backends()[name].store_kv(key, value, key_cache, value_cache, slot_mapping, has_skipped_slots, scales)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
                    max_seqlen_k, scale, sliding_window=None, softcap=None, sinks=None, plan=None, scales=None,
                    chunk_size=None, latent_dim=None):
    """Varlen causal attention over paged K/V: FlashInfer's `run`. See `torch_paged.paged_attention`
    for the contract.

    Args:
        sliding_window: w: a query at position p sees keys p - w < j <= p. None: no window.
        chunk_size: C (Llama 4's attention chunk): a query at p sees keys (p // C) * C <= j <= p,
            positions counted per sequence from 0. With a window too, both bounds apply.
        plan: the step's `plan.StepPlan` (`dispatch.plan`): its backends, and the launch plan (tiling,
            split count, tuned config, scratch) the first layer of this kind made, are used as
            planned. None: this call plans for itself.
        scales: a quantised cache's `kv_quant.KVScales` (K/V are dequantised as they are read).
        latent_dim: latent attention (absorbed MLA): `value_cache` is `key_cache[..., :latent_dim]`,
            the same rows (`backend.LayerCall.latent_dim`).

    Raises:
        ValueError: no backend of the step takes this layer (naming what it lacks), before any kernel runs.
    """
    # Rotated K/V (see `kv_quant`): the backends attend rotated queries over them as over any K/V,
    # and the output comes back rotated.
    rotated = scales is not None and scales.quant.rotate
    call = LayerCall(rotate(query) if rotated else query, key_cache, value_cache, block_tables, seq_lens,
                     cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale, mask_rule(sliding_window, chunk_size),
                     softcap, sinks, scales, latent_dim)
    out = run(call, plan)
    return rotate(out) if rotated else out


def run(call: LayerCall, plan: StepPlan | None = None) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim_v]
    """Attend `call` on the first of the plan's backends that declares it (see the module docstring).

    Raises:
        ValueError: none of them takes it, naming what each lacks; nothing has run.
    """
    if plan is None:  # a caller outside a step: plan for this call alone
        chain = _chain(call.query.device, None)
        plan = StepPlan(chain[0], fallbacks=chain[1:])
    registry = backends.backends()
    refused = []
    for name in plan.backends:
        entry = registry[name]
        why = entry.refusal(call)
        if why is None:
            out = entry.run(call, plan)
            if out is not None:
                if refused:
                    backends.note_fallback(plan.backend, refused[0][1], name)
                return out
            why = "this shape at run time"  # e.g. flex past its compile limit: the next backend runs it
        refused.append((name, why))
    raise ValueError("hf_paged: no attention backend takes this layer: "
                     + "; ".join(f"{name} does not take {why}" for name, why in refused))


class DecodeRuns:
    """A decode step's plain layers on the native CPU kernel, planned once per step and KV group: what
    `paged_attention` does for such a layer on a "cpu" step (every sequence one query, no mask beyond
    causality, no softcap, sinks or scales), without the per-layer planning and checks that hold for
    the whole step (about 0.1 ms a layer on a 2-core CPU): a compiled decode step's attention
    (`worker.cpu_graphs`). `plan` returns None where the step is not such a step; a call returns None
    for a layer whose tensors the kernel does not read, which the caller then runs through
    `paged_attention`.
    """

    def __init__(self, plan: StepPlan, runs, block_size: int):
        self.plan, self.runs, self.block_size = plan, runs, block_size
        self._readable: dict[tuple, bool] = {}  # per (K/V tensors, query dtype): `cpu_kernel.can_run`

    @classmethod
    def plan_step(cls, plan: StepPlan | None, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  block_size: int) -> "DecodeRuns | None":
        """The step's runs over `block_tables` ([B, W] int32: one query per sequence, `seq_lens` [B]
        int32 its lengths, one host read here), or None where the plan's backend is not "cpu", there is
        no kernel, or the metadata would send the kernel outside the tables (the caller's
        `paged_attention` then raises what is wrong)."""
        if plan is None or plan.backend != "cpu" or plan.key_limits is not None or cpu_kernel.load() is None:
            return None
        lens = seq_lens.tolist()
        if not lens or min(lens) < 1 or max(lens) > block_tables.shape[1] * block_size \
                or block_tables.shape[0] != len(lens):
            return None
        seqs = list(range(len(lens)))
        runs = cpu_kernel.ShortRuns(seqs, [1] * len(lens), lens, list(range(len(lens) + 1)), block_tables, block_size,
                                    len(lens))
        return cls(plan, runs, block_size)

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 scale: float) -> torch.Tensor | None:  # [B, Hq, Dv]
        """Attend `query` ([B, Hq, D], last dim contiguous) over the layer's blocks; None: not on the kernel."""
        key = (key_cache.data_ptr(), value_cache.data_ptr(), tuple(key_cache.shape), tuple(value_cache.shape),
               query.dtype, tuple(query.shape))
        readable = self._readable.get(key)
        if readable is None:
            readable = self._readable[key] = (
                key_cache.shape[1] == self.block_size and query.shape[0] == self.runs.seq_lens.shape[0]
                and query.stride(-1) == 1 and cpu_kernel.can_run(query, key_cache, value_cache, None)
                and 0 <= self.runs.block_range[0] and self.runs.block_range[1] < key_cache.shape[0])
        if not readable:
            return None
        workspace, device = self.plan.workspace, query.device
        runs = self.runs
        return cpu_kernel.attend(
            query, key_cache, value_cache, runs.block_tables, runs.seq_lens, runs.cu_seqlens_q,
            runs.max_q_len * query.shape[1], runs.num_splits, runs.kv_tokens, scale, None, None, None,
            lambda name, shape: (torch.empty(shape, dtype=torch.float32, device=device) if workspace is None
                                 else workspace.get(name, shape, torch.float32, device)))
