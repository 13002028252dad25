"""Paged attention: the "hf_paged" function transformers calls, the per-step metadata, and the
kernels behind one dispatch.

* `interface.py`: the function and mask registered in transformers' `AttentionInterface` /
  `AttentionMaskInterface` (`ATTN_IMPLEMENTATION = "hf_paged"`).
* `metadata.py`: `StepMetadata`, built once per forward and read by every layer.
* `dispatch.py`: Triton on CUDA, the torch backend elsewhere.
* `torch_paged.py`: the torch (CPU) backend. `triton/`: the GPU kernels.
* `reference.py`: the deliberately naive oracle the tests hold every backend to.

Works on tensors, block tables and slot mappings only: it never decides which block holds a token
(that is `core`) and never sees a request.
"""

from .interface import ATTN_IMPLEMENTATION, paged_attention_forward, register
from .metadata import DENSE, PAGED, StepMetadata, build_packed_metadata, build_step_metadata

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DENSE",
    "PAGED",
    "StepMetadata",
    "build_packed_metadata",
    "build_step_metadata",
    "paged_attention_forward",
    "register",
]
