"""One dispatch for the attention kernels, in FlashInfer's shape: `plan` once per step, then
`store_kv` and `paged_attention` (the `run`) per layer with that plan.

Owns the choice of backend and nothing else: callers (the `interface` attention function, the cache
adapter) call `plan` / `store_kv` / `paged_attention` here and never import a backend directly.
`backend()` picks the implementation for a device: Triton on CUDA tensors; on the CPU "cpu", the
native kernel (`cpu_kernel`, built on first use) for the decode and verify runs and the torch path
for the prefill chunks, or "torch" alone where that kernel cannot be built. "flex" (`flex_paged`,
FlexAttention compiled by Inductor, on either device) runs when asked for. Set
`HF_PAGED_BACKEND=torch`, `=cpu`, `=flex` or `=triton` to force one; the tests force Triton on CPU tensors under
Triton's interpreter (`TRITON_INTERPRET=1`). The environment is read by `plan`, once per step (see
`plan.StepPlan`); a call with a plan reads nothing per layer. A call without one (a kernel test, a
caller with no step) plans for itself.

The Triton modules are imported on first use only, so importing hf_paged never needs a GPU or
compiles anything.
"""

from __future__ import annotations

import os

import torch

from ..config import MAX_DECODE_QUERY_LEN
from . import cpu_kernel, flex_paged, torch_paged
from .kv_quant import rotate
from .plan import StepPlan
from .workspace import Workspace

_BACKENDS = ("auto", "torch", "cpu", "triton", "flex")


def backend(device: torch.device) -> str:
    """The kernel family for tensors on `device`: "triton" on CUDA, "cpu" (the native CPU kernel for
    decode and verify runs, the torch path for the rest) elsewhere where that kernel builds, else
    "torch". "flex" (FlexAttention, `flex_paged`) only when asked for: on the CPU it measures slower
    than "cpu" at every shape of `benchmarks/attention.py`, and on CUDA it has not been measured
    against Triton."""
    choice = os.environ.get("HF_PAGED_BACKEND", "auto").lower()
    if choice not in _BACKENDS:
        raise ValueError(f"HF_PAGED_BACKEND must be one of {_BACKENDS}, got {choice!r}")
    if choice == "auto":
        if device.type == "cuda":
            return "triton" if _has_triton() else "torch"
        return "cpu" if device.type == "cpu" and cpu_kernel.load() is not None else "torch"
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "HF_PAGED_BACKEND=triton on a non-CUDA device needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before hf_paged's kernels are first used"
        )
    if choice == "cpu":
        if device.type != "cpu":
            raise ValueError(f"HF_PAGED_BACKEND=cpu runs on CPU tensors, not {device.type}; use auto")
        if cpu_kernel.load() is None:
            raise ValueError(f"HF_PAGED_BACKEND=cpu: the CPU attention kernel could not be built "
                             f"({cpu_kernel.load_error()}); use HF_PAGED_BACKEND=torch")
    return choice


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def plan(step, workspace: Workspace | None = None) -> StepPlan:
    """The attention plan of `step` (a `metadata.StepMetadata`): its backend, read here once, and the
    per-kind launch plans its layers fill in (see `plan.StepPlan`). `workspace`: the cache's scratch,
    reused by every layer and step."""
    if getattr(step, "key_limits", None) is not None:  # queries past causal: the Triton kernels are causal only
        return StepPlan("torch", workspace, key_limits=step.key_limits)
    return StepPlan(backend(step.seq_lens.device), workspace)


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
    rows when its scheme rotates: see `kv_quant`; `plan`: the step's, whose backend is used)."""
    if scales is not None and scales.quant.rotate:
        key, value = rotate(key), rotate(value)
    if (plan.backend if plan is not None else backend(key.device)) == "triton":
        from .triton.store_kv import store_kv as triton_store_kv

        return triton_store_kv(key, value, key_cache, value_cache, slot_mapping, scales=scales)
    torch_paged.store_kv(key, value, key_cache, value_cache, slot_mapping, has_skipped_slots, scales=scales)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
                    max_seqlen_k, scale, sliding_window=None, softcap=None, sinks=None, plan=None, scales=None):
    """Varlen causal attention over paged K/V: FlashInfer's `run`. See `torch_paged.paged_attention`
    for the contract.

    Args:
        plan: the step's `plan.StepPlan` (`dispatch.plan`): its backend, and the launch plan (tiling,
            split count, tuned config, scratch) the first layer of this kind made, are used as
            planned. None: this call plans for itself.
        scales: a quantised cache's `kv_quant.KVScales` (K/V are dequantised as they are read).

    Up to `MAX_DECODE_QUERY_LEN` queries per sequence the split-KV decode kernel runs, above it the
    tiled prefill kernel."""
    # Rotated K/V (see `kv_quant`): the backends attend rotated queries over them as over any K/V,
    # and the output comes back rotated.
    rotated = scales is not None and scales.quant.rotate
    out = _attend(rotate(query) if rotated else query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                  max_seqlen_q, max_seqlen_k, scale, sliding_window, softcap, sinks, plan, scales)
    return rotate(out) if rotated else out


def _attend(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale,
            sliding_window, softcap, sinks, plan, scales):
    name = plan.backend if plan is not None else backend(query.device)
    if name == "triton":
        if max_seqlen_q <= MAX_DECODE_QUERY_LEN:
            from .triton import decode

            kernel = decode.paged_decode  # looked up per call: tests count the launches through it
        else:
            from .triton import prefill

            kernel = prefill.flash_prefill
        launch_plan = None if plan is None else plan.triton_plan(query, key_cache, value_cache, block_tables,
                                                                 max_seqlen_q, max_seqlen_k, sliding_window)
        return kernel(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
                      max_seqlen_k, scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
                      scales=scales, plan=launch_plan)
    if name == "flex" and flex_paged.can_run(query, key_cache, value_cache, scales, sinks):
        if plan is not None:
            flex_plan = plan.flex_plan(block_tables, seq_lens, cu_seqlens_q, key_cache.shape[1], key_cache.shape[0])
        else:
            flex_plan = flex_paged.FlexPlan(block_tables, seq_lens, cu_seqlens_q, key_cache.shape[1],
                                            key_cache.shape[0])
        out = flex_paged.paged_attention(query, key_cache, value_cache, flex_plan, scale, sliding_window, softcap,
                                         sinks)
        if out is not None:
            return out  # None: a shape past flex's compile limit, which the torch path runs
    if plan is not None:
        torch_plan = plan.torch_plan(block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                                     key_cache.shape[1])
    else:  # "cpu": the native kernel takes the short runs; "torch": the torch path takes everything
        torch_plan = torch_paged.AttentionPlan(block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
                                               key_cache.shape[1], native=name == "cpu")
    return torch_paged.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
        scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks, plan=torch_plan, scales=scales,
    )
