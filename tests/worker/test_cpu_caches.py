"""`worker.cpu_caches`: with the caps, oneDNN linears over hundreds of distinct row counts (what a
continuous-batching engine's steps look like to hf.linear's fast kernel) keep native memory flat;
without them the same calls hold ~0.5 MB per new shape (the control, so the test can fail)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

from hf_paged.worker.cpu_caches import VARIABLES, bound_cpu_kernel_caches

PROBE = r"""
import ctypes, sys
if sys.argv[1] == "bound":
    from hf_paged.worker.cpu_caches import bound_cpu_kernel_caches
    bound_cpu_kernel_caches()
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def in_use():  # bytes malloc has handed out and not had back (heap and mmapped chunks)
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd

linear = torch.ops.mkldnn._linear_pointwise
w, b = torch.randn(128, 64), torch.randn(128)
with torch.inference_mode():
    for m in range(1, 20):  # warm up: the caps' worth of entries, allocator pools
        linear(torch.randn(m, 64), w, b, "none", [], "")
    before = in_use()
    for m in range(20, 320):
        linear(torch.randn(m, 64), w, b, "none", [], "")
    print(in_use() - before)
"""


def _growth_mib(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1]) / 2**20


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and _has_mallinfo2()),
                    reason="needs torch with oneDNN and glibc's mallinfo2")
def test_capped_caches_keep_native_memory_flat_over_new_shapes():
    capped, uncapped = _growth_mib("bound"), _growth_mib("free")
    assert uncapped > 60, f"the control: without caps 300 new shapes should hold > 60 MiB, held {uncapped:.1f}"
    assert capped < 20, f"with caps 300 new shapes held {capped:.1f} MiB (uncapped: {uncapped:.1f})"


def test_the_environment_wins_and_bad_capacities_are_refused(monkeypatch):
    monkeypatch.setenv(VARIABLES[0], "3")
    monkeypatch.delenv(VARIABLES[1], raising=False)
    assert bound_cpu_kernel_caches(16) == {VARIABLES[0]: "3", VARIABLES[1]: "16"}
    for bad in (0, -1, 2.5, True, "16"):
        with pytest.raises(ValueError, match="capacity"):
            bound_cpu_kernel_caches(bad)
