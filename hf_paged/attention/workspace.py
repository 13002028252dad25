"""`Workspace`: scratch buffers one owner keeps for the attention backends, reused across layers and
steps.

The KV owner keeps one (`hf.KVOwner`); each step's `plan.StepPlan` takes views of it: the torch path's
gathered K/V, the Triton decode kernel's split-K partial outputs and log-sum-exps. Layers of a step
run one after another on one stream, so one buffer per name serves them all.
"""

from __future__ import annotations

import torch


class Workspace:
    """Reusable scratch buffers, one per (name, dtype, device), regrown (by 25%) only when a step
    needs more.

    A fresh multi-megabyte CPU tensor is served by mmap and page-faults on first touch, which costs
    several times the gather itself; every layer of every step would pay it. On CUDA a view handed
    to a captured graph keeps its buffer alive after a regrow (the view holds the storage), and a
    regrow inside a capture is refused: the capture's eager warm-up on the same shapes sizes every
    buffer first, so a capture only takes views."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.num_allocations = 0  # buffers allocated so far (tests: reuse across layers and steps)

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous `shape` view of buffer `name` (its contents are whatever the last user left)."""
        numel = 1
        for n in shape:
            numel *= n
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"hf_paged: workspace {name!r} would grow during a CUDA graph capture; the "
                                   "warm-up before a capture must run the same shapes")
            buf = torch.empty(int(numel * 1.25) + 1, dtype=dtype, device=device)
            self._buffers[key] = buf
            self.num_allocations += 1
        return buf[:numel].view(shape)
