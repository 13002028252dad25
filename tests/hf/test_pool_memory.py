"""The K/V pools' host memory (`hf/pool_memory.py`): zeros, advised to huge pages on Linux before the
first touch, and the pools a paged cache allocates take that path."""

from __future__ import annotations

import sys

import pytest
import torch

from hf_paged.hf import pool_memory


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")


@linux
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.bfloat16])
def test_a_large_pool_is_zeros_advised_to_huge_pages(dtype):
    shape = (700, 16, 3, 64)  # about 8.6 MB at fp32, 2.2 MB at int8 (under the threshold: not advised)
    tensor = pool_memory.zeros(shape, dtype, "cpu")
    assert tensor.shape == shape and tensor.dtype == dtype and not bool(tensor.any())
    nbytes = tensor.untyped_storage().nbytes()
    advised = nbytes >= pool_memory.MIN_ADVISED_BYTES
    inner = -(-tensor.data_ptr() // pool_memory.HUGE_PAGE_BYTES) * pool_memory.HUGE_PAGE_BYTES
    if advised:  # hg: MADV_HUGEPAGE on the mapping. (A small tensor may share a mapping that another
        # allocation of this process had advised, so its flags say nothing about whether it was.)
        assert "hg" in _vm_flags(inner)
    assert pool_memory.advise_huge_pages(tensor) == advised  # advising again is harmless; small: not advised


def test_small_and_non_cpu_tensors_are_plain_zeros():
    small = pool_memory.zeros((4, 16, 1, 8), torch.float32, torch.device("cpu"))
    assert not bool(small.any()) and not pool_memory.advise_huge_pages(small)
    meta = pool_memory.zeros((4096, 4096), torch.float32, "meta")  # no host memory: nothing to advise
    assert meta.device.type == "meta" and not pool_memory.advise_huge_pages(meta)


@linux
def test_byte_pages_are_advised():
    from hf_paged.hf.pages import PageBuffers

    pages = PageBuffers(block_size=16, page_k=3 * 64, page_v=3 * 64)
    pages.allocate(800, torch.float32, torch.device("cpu"))  # 9.8 MB each
    for pool in (pages.keys, pages.values):
        assert not bool(pool.any())
        assert "hg" in _vm_flags(-(-pool.data_ptr() // pool_memory.HUGE_PAGE_BYTES) * pool_memory.HUGE_PAGE_BYTES)
