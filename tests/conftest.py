"""Test-wide set-up.

Without a CUDA GPU the Triton kernels run under Triton's interpreter (`TRITON_INTERPRET=1`) on CPU
tensors. The variable is read when a kernel is decorated, so it is set here, before any test module
imports `hf_paged.attention`'s kernels. On a GPU machine it stays unset and the kernels compile for real (the
interpreter-only tests then skip, and the `cuda`-marked tests run instead).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
