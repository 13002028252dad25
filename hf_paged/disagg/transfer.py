"""K/V transfers between workers: one contiguous buffer per request and pair of ranks, point to point
over the job's K/V process group (gloo on CPU, NCCL on GPU), never one message per block.

The K/V group is a process group of its own (`kv_group`), not torch.distributed's default group: a
tensor-parallel worker's default group is its model's (transformers' tensor parallelism), and every
rank of every worker joins the K/V group. Between workers with their own tensor-parallel sizes, a
request's K/V move in pieces (`plan_pieces`): each KV head once, from the prefill rank that holds it
to the decode rank that needs it.

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
from datetime import timedelta

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


@dataclass
class Pieces:
    """The pieces of one request's K/V that one rank receives (each a `Transfer`), with the control
    message (`meta`) that announced them."""

    key: tuple
    parts: list  # [(Transfer, dst_heads)]
    meta: dict = field(default_factory=dict)

    @property
    def peers(self) -> set[int]:
        return {t.peer for t, _ in self.parts}


def kv_group(backend: str, store, rank: int, world_size: int, timeout: timedelta):
    """The job's K/V process group (every rank of every worker), apart from the default group. Every
    member constructs it (it connects them all), after its model is loaded."""
    store = dist.PrefixStore("hf_paged/kv", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def plan_pieces(num_kv_heads: int, src_ranks: list[int], dst_ranks: list[int]) -> list[dict]:
    """How a request's K/V move from a worker split over `src_ranks` (K/V-group ranks, TP rank order) to
    one split over `dst_ranks`: one piece per pair of ranks whose KV heads overlap, each head in exactly
    one piece. A piece: `src`, `dst`, `heads` ([first, end) of the model's KV heads), and the same heads
    as each side's pool numbers them (`src_heads`, `dst_heads`)."""
    p, d = len(src_ranks), len(dst_ranks)
    if num_kv_heads % p or num_kv_heads % d:
        raise ValueError(f"{num_kv_heads} KV heads do not split over {p} and {d} tensor-parallel ranks")
    per_src, per_dst = num_kv_heads // p, num_kv_heads // d
    pieces = []
    for i, src in enumerate(src_ranks):
        for j, dst in enumerate(dst_ranks):
            lo, hi = max(i * per_src, j * per_dst), min((i + 1) * per_src, (j + 1) * per_dst)
            if lo < hi:
                pieces.append({"src": src, "dst": dst, "heads": (lo, hi), "src_heads": (lo - i * per_src, hi - i * per_src),
                               "dst_heads": (lo - j * per_dst, hi - j * per_dst)})
    return pieces


def send(key: tuple, buffer: torch.Tensor, peer: int, tag: int, group, meta: dict | None = None) -> Transfer:
    """Post the send of `buffer` (contiguous) to rank `peer` of `group`; returns at once (a peer found gone
    while posting gives a transfer that failed already)."""
    buffer = buffer.contiguous()
    return _posted(key, peer, tag, buffer, lambda: group.send([buffer], peer, tag), meta)


def receive(key: tuple, numel: int, dtype: torch.dtype, device, peer: int, tag: int, group,
            meta: dict | None = None) -> Transfer:
    """Post the receive of `numel` elements from rank `peer` of `group` into a new buffer; returns at once
    (a peer found gone while posting gives a transfer that failed already)."""
    buffer = torch.empty(numel, dtype=dtype, device=device)
    return _posted(key, peer, tag, buffer, lambda: group.recv([buffer], peer, tag), meta)


def _posted(key: tuple, peer: int, tag: int, buffer: torch.Tensor, post, meta: dict | None) -> Transfer:
    try:
        work = post()
    except RuntimeError as exc:  # gloo raises at once when the peer's connection is closed already
        failed = Transfer(key, peer, tag, buffer, None, meta=meta or {}, error=exc)
        failed.finished.set()
        return failed
    return Transfer(key, peer, tag, buffer, work, meta=meta or {}).watch()


def state(transfer: Transfer | Pieces, timeout: float) -> str:
    """"done", "pending", "failed" (the backend reported an error) or "timeout"; pieces are done when
    every one is, failed when one failed."""
    if isinstance(transfer, Pieces):
        states = [state(t, timeout) for t, _ in transfer.parts]
        for worst in ("failed", "timeout", "pending"):
            if worst in states:
                return worst
        return "done"
    if transfer.finished.is_set():
        return "failed" if transfer.error is not None else "done"
    return "timeout" if time.monotonic() - transfer.started > timeout else "pending"


def wait_all(pieces: Pieces, timeout: float) -> bool:
    """Block until every piece is in (True) or one failed or `timeout` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    for t, _ in pieces.parts:
        if not t.finished.wait(max(0.0, deadline - time.monotonic())) or t.error is not None:
            return False
    return True


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown K/V dtype {name!r}")
    return dtype
