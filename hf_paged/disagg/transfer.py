"""K/V transfers between workers: one contiguous buffer per request, point to point over the workers'
torch.distributed process group (gloo on CPU, NCCL on GPU), never one message per block.

The prefill side posts `isend` and goes on with its next step; the decode side posts `irecv` when
the request's control message arrives and checks it between steps. A gloo point-to-point work only
reports completion from `wait()`, so each transfer has a small daemon thread blocked in `wait()`
that flags the result; the worker's loop reads the flag and never blocks, so a peer that died costs
a timeout, not a hang (the thread is abandoned).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Transfer:
    """One request's K/V on the wire, from either end.

    Attributes:
        key: (request id, attempt).
        peer: the other worker's rank in the process group.
        tag: the message tag (unique per pair and transfer).
        buffer: [num_tokens * kv_numel_per_token] in the pool's dtype: what is sent, or where it lands.
        work: the pending `isend` / `irecv`.
        started: when it was posted (`time.monotonic()`).
        meta: whatever the owner needs when it completes (the control message).
    """

    key: tuple
    peer: int
    tag: int
    buffer: torch.Tensor
    work: object
    started: float = field(default_factory=time.monotonic)
    meta: dict = field(default_factory=dict)
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def watch(self) -> "Transfer":
        """Start the thread that waits on the work and flags its end."""
        def wait() -> None:
            try:
                self.work.wait()
            except BaseException as exc:  # noqa: BLE001 - a dead peer or a broken connection
                self.error = exc
            self.finished.set()

        threading.Thread(target=wait, name=f"hf_paged-kv-{self.tag}", daemon=True).start()
        return self

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def send(key: tuple, buffer: torch.Tensor, peer: int, tag: int, meta: dict | None = None) -> Transfer:
    """Post the send of `buffer` (contiguous) to rank `peer`; returns at once."""
    buffer = buffer.contiguous()
    return Transfer(key, peer, tag, buffer, dist.isend(buffer, dst=peer, tag=tag), meta=meta or {}).watch()


def receive(key: tuple, numel: int, dtype: torch.dtype, device, peer: int, tag: int,
            meta: dict | None = None) -> Transfer:
    """Post the receive of `numel` elements from rank `peer` into a new buffer; returns at once."""
    buffer = torch.empty(numel, dtype=dtype, device=device)
    return Transfer(key, peer, tag, buffer, dist.irecv(buffer, src=peer, tag=tag), meta=meta or {}).watch()


def state(transfer: Transfer, timeout: float) -> str:
    """"done", "pending", "failed" (the backend reported an error) or "timeout"."""
    if transfer.finished.is_set():
        return "failed" if transfer.error is not None else "done"
    return "timeout" if time.monotonic() - transfer.started > timeout else "pending"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown K/V dtype {name!r}")
    return dtype
