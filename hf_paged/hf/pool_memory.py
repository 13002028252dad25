"""The K/V pools' host memory: zero-filled tensors backed by transparent huge pages where Linux offers
them (`madvise(MADV_HUGEPAGE)` before the first touch; the system's THP setting `madvise` or `always`).

Decode attention reads each sequence's blocks from all over a pool of hundreds of MB: on 4 KiB pages
nearly every block costs a TLB miss, and the native kernel's int8 K/V (one 64-byte line per head and
token) spends more time on page walks than on its arithmetic (`benchmarks/attention.py`). 2 MiB pages
cover a block's whole neighbourhood. Elsewhere (another OS, a GPU tensor, a small pool, THP off) the
tensor is the same zeros, on whatever pages the allocator gives.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
MADV_HUGEPAGE = 14  # <linux/mman.h>
MIN_ADVISED_BYTES = 4 * HUGE_PAGE_BYTES  # smaller pools gain nothing worth a system call


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.zeros(shape)`; on a Linux CPU, large, its memory advised to huge pages before it is zeroed
    (the zeroing is the first touch, so the pages are faulted in huge)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if tensor.device.type == "cpu":
        advise_huge_pages(tensor)
    return tensor.zero_()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Advise the 2 MiB-aligned part of `tensor`'s CPU storage to huge pages; True where the kernel took
    the advice (False: not Linux, too small, or madvise refused, which changes nothing else)."""
    storage = tensor.untyped_storage()
    if not sys.platform.startswith("linux") or storage.device.type != "cpu" or storage.nbytes() < MIN_ADVISED_BYTES:
        return False
    start = storage.data_ptr()
    lo = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    hi = (start + storage.nbytes()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if hi <= lo:
        return False
    return _libc().madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_HUGEPAGE) == 0


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
        _LIBC = libc
    return _LIBC
