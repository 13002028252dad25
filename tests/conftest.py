"""Test-wide set-up.

Without a CUDA GPU the Triton kernels run under Triton's interpreter (`TRITON_INTERPRET=1`) on CPU
tensors. The variable is read when a kernel is decorated, so it is set here, before any test module
imports `hf_paged.attention`'s kernels. On a GPU machine it stays unset and the kernels compile for real (the
interpreter-only tests then skip, and the `cuda`-marked tests run instead).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`make test` runs two workers on two cores) each worker computes on one thread:
# two workers of two intra-op threads each would fight over the cores. Subprocesses a test starts
# (servers, torchrun ranks) inherit it through the environment.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture
def engine_calls(monkeypatch):
    """Whether each drop-in call was served by the engine (True) or fell back to stock (False)."""
    import hf_paged.integrations.batch_generate as batch_generate  # here, so collecting a test imports no engine

    calls = []
    original = batch_generate.try_engine_generate

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(batch_generate, "try_engine_generate", spy)
    return calls
