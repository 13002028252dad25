"""Attention kernels and their torch references, behind one dispatch.

`backend()` picks the implementation for a tensor: Triton on CUDA tensors, torch elsewhere. Set
`HF_PAGED_BACKEND=torch` or `=triton` to force one (tests force Triton on CPU under
`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import os

import torch

from . import reference

_BACKENDS = ("auto", "torch", "triton")


def backend(device: torch.device) -> str:
    """The kernel family to use for tensors on `device`."""
    choice = os.environ.get("HF_PAGED_BACKEND", "auto").lower()
    if choice not in _BACKENDS:
        raise ValueError(f"HF_PAGED_BACKEND must be one of {_BACKENDS}, got {choice!r}")
    if choice == "auto":
        return "torch"  # the Triton kernels plug in here (CUDA tensors) once they land
    if choice == "triton":
        raise NotImplementedError("the Triton paged-attention kernels are not available in this build yet")
    return choice


def store_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write new K/V rows into their slots; slot -1 is skipped. See `reference.store_kv`."""
    backend(key.device)
    reference.store_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q,
                    max_seqlen_k, scale, sliding_window=None, softcap=None, sinks=None, plan=None):
    """Varlen causal attention over paged K/V. See `reference.paged_attention` for the contract;
    `plan` is the torch path's per-step `reference.AttentionPlan` (optional)."""
    backend(query.device)
    return reference.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k,
        scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks, plan=plan,
    )
