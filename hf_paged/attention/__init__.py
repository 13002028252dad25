"""Paged attention: the "hf_paged" function transformers calls, the per-step metadata, and the
kernels behind one dispatch.

* `interface.py`: the function and mask registered in transformers' `AttentionInterface` /
  `AttentionMaskInterface` (`ATTN_IMPLEMENTATION = "hf_paged"`).
* `metadata.py`: `StepMetadata`, built once per forward and read by every layer.
* `backend.py`: the backend protocol: one `LayerCall` per layer (its `MaskRule`: causal, sliding
  window, local chunk), and each backend's declaration of what it takes (`Capabilities`).
* `dispatch.py`: the choice among the backends (Triton on CUDA, the native CPU kernel and the torch
  path elsewhere, FlexAttention when asked for), in FlashInfer's shape: `plan` once per step,
  `store_kv` / `paged_attention` (the `run`) per layer, each layer on the first of the step's
  backends that declares it.
* `plan.py`: `StepPlan`, the step's backends, launch plans and scratch; `workspace.py`: the scratch
  buffers the cache owns and every step's plan takes views of.
* `torch_paged.py`: the torch (CPU) backend, with `slots.py` (K/V rows by slot: the write, the dense
  gather). `cpu_kernel.py` (+ `csrc/paged_attention.c`): the native CPU kernel for decode and verify
  runs, built on first use. `flex_paged.py`: the FlexAttention backend. `triton/`: the GPU kernels.
* `reference.py`: the deliberately naive oracle the tests hold every backend to.

Works on tensors, block tables and slot mappings only: it never decides which block holds a token
(that is `core`) and never sees a request.
"""

from .interface import ATTN_IMPLEMENTATION, UnsupportedModelError, paged_attention_forward, register
from .metadata import DENSE, PAGED, StepMetadata, build_packed_metadata, build_step_metadata

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DENSE",
    "PAGED",
    "StepMetadata",
    "UnsupportedModelError",
    "build_packed_metadata",
    "build_step_metadata",
    "paged_attention_forward",
    "register",
]
