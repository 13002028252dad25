"""Attention kernels and their torch references, behind one dispatch.

`backend()` picks the implementation for a device: Triton on CUDA tensors, torch elsewhere. Set
`HF_PAGED_BACKEND=torch` or `=triton` to force one; the tests force Triton on CPU tensors under
Triton's interpreter (`TRITON_INTERPRET=1`).

The Triton modules are imported on first use only, so importing hf_paged never needs a GPU or
compiles anything.
"""

from __future__ import annotations

import os

import torch

from . import reference

_BACKENDS = ("auto", "torch", "triton")
# Up to this many queries per sequence (decode, or a speculative verify step of k+1 tokens) the
# split-KV decode kernel is used; above it, the tiled prefill kernel.
DECODE_MAX_QUERY_LEN = 16


def backend(device: torch.device) -> str:
    """The kernel family ("torch" or "triton") for tensors on `device`."""
    choice = os.environ.get("HF_PAGED_BACKEND", "auto").lower()
    if choice not in _BACKENDS:
        raise ValueError(f"HF_PAGED_BACKEND must be one of {_BACKENDS}, got {choice!r}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and _has_triton() else "torch"
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "HF_PAGED_BACKEND=triton on a non-CUDA device needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before hf_paged's kernels are first used"
        )
    return choice


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def store_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write new K/V rows into their slots; slot -1 is skipped. See `reference.store_kv`."""
    if backend(key.device) == "triton":
        from .triton_store_kv import store_kv as triton_store_kv

        return triton_store_kv(key, value, key_cache, value_cache, slot_mapping)
    reference.store_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
                    max_seqlen_k, scale, sliding_window=None, softcap=None, sinks=None, plan=None):
    """Varlen causal attention over paged K/V. See `reference.paged_attention` for the contract;
    `plan` is the torch path's per-step `reference.AttentionPlan` (ignored by Triton)."""
    if backend(query.device) == "triton":
        if max_seqlen_q <= DECODE_MAX_QUERY_LEN:
            from .triton_decode import paged_decode as kernel
        else:
            from .triton_prefill import flash_prefill as kernel
        return kernel(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
                      max_seqlen_k, scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    return reference.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
        scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks, plan=plan,
    )
