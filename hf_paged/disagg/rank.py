"""A tensor-parallel rank (1 .. N-1) of a disaggregated worker: `python -m hf_paged.disagg.rank SPEC`.

The worker's process is its model's rank 0 and starts the others through its model factory
(`parallel.TensorParallelReplica`, told to run this module). Each loads its shard, builds the same
engine, joins the job's K/V group at its own rank, and follows rank 0's steps; between them it moves
its own KV heads when rank 0 tells it to (`Engine.tell_ranks`):

    ("kv_out", {key, slots, pieces})   prefill: gather this rank's heads at `slots`, send each piece it holds
    ("kv_recv", {key, dtype, pieces})  decode: post the receives of the pieces this rank needs
    ("kv_write", {key, slots})         decode: wait for them, write them at rank 0's reserved `slots`, and
                                       say whether it could (`Engine.all_ranks_ok`, with every rank)
    ("kv_drop", {key})                 decode: forget them (rank 0 recomputes the request)

It exits when rank 0's engine shuts down, or with rank 0's process.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import timedelta

import torch

from . import transfer
from .worker import exit_process

logger = logging.getLogger(__name__)


class RankTransfers:
    """One follower rank's side of the K/V transfers (see the module's messages)."""

    def __init__(self, engine, group, rank: int, timeout: float):
        self.engine, self.group, self.rank, self.timeout = engine, group, rank, timeout
        self.sends: list[transfer.Transfer] = []
        self.recvs: dict[tuple, transfer.Pieces] = {}

    def register(self) -> None:
        for kind, handler in (("kv_out", self.send), ("kv_recv", self.receive), ("kv_write", self.write),
                              ("kv_drop", self.drop)):
            self.engine.on_rank_message(kind, handler)

    def send(self, payload: dict) -> None:
        now = time.monotonic()
        self.sends = [t for t in self.sends if not t.finished.is_set() and now - t.started < 4 * self.timeout]
        for piece in payload["pieces"]:
            if piece["src"] == self.rank:
                buffer = self.engine.gather_kv(payload["slots"], piece["src_heads"])
                self.sends.append(transfer.send(payload["key"], buffer, piece["dst"], piece["tag"], self.group))

    def receive(self, payload: dict) -> None:
        dtype = transfer.dtype_of(payload["dtype"])
        parts = [(transfer.receive(payload["key"], p["numel"], dtype, self.engine.device, p["src"], p["tag"],
                                   self.group), p["dst_heads"]) for p in payload["pieces"] if p["dst"] == self.rank]
        self.recvs[payload["key"]] = transfer.Pieces(payload["key"], parts)

    def write(self, payload: dict) -> None:
        pieces = self.recvs.pop(payload["key"], None)
        ok = pieces is not None and transfer.wait_all(pieces, self.timeout)
        if ok:
            try:
                for t, heads in pieces.parts:
                    self.engine.write_kv(payload["slots"], t.buffer, heads, payload.get("num_blocks"))
            except Exception:  # noqa: BLE001 - rank 0 learns it below and recomputes
                logger.warning("hf_paged: a tensor-parallel rank could not write its K/V", exc_info=True)
                ok = False
        self.engine.all_ranks_ok(ok)

    def drop(self, payload: dict) -> None:
        self.recvs.pop(payload["key"], None)


def main(spec: str) -> int:
    from ..engine import Engine, rank_liveness
    from ..model_source import ModelFromPath
    from ..worker import bound_cpu_kernel_caches

    rank_liveness.beat_to_parent()
    settings = json.loads(spec)
    kv = settings["settings"]["kv"]
    torch.set_num_threads(max(1, int(kv.get("num_threads") or 1)))
    bound_cpu_kernel_caches()
    model, tokenizer = ModelFromPath(settings["model"], settings["tensor_parallel_size"])()
    engine = Engine(model.eval(), tokenizer, **settings["engine_kwargs"], show_progress=False)
    rank = kv["ranks"][engine.tensor_parallel_rank]
    import torch.distributed as dist

    store = dist.TCPStore(kv["host"], kv["port"], is_master=False, timeout=timedelta(seconds=kv["timeout"]))
    group = transfer.kv_group(kv["backend"], store, rank, kv["world"], timedelta(seconds=kv["timeout"]))
    RankTransfers(engine, group, rank, kv["transfer_timeout"]).register()
    engine.serve_as_follower()
    exit_process(0)  # never block on a K/V group whose peers may be gone


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
