"""Tensor-parallel ranks without torchrun: `hf-paged serve --tensor-parallel-size N` starts its own.

The serving process becomes rank 0 (HTTP, the engine, sampling); `start_ranks` starts ranks 1..N-1 as
child processes (`python -m hf_paged.parallel.launch`), each of which loads its shard of the same model
and builds an `Engine` with the same settings, then follows rank 0's steps until rank 0's engine shuts
down. They meet through torch.distributed's environment rendezvous on a free loopback port (gloo on
CPU, NCCL on GPU: what transformers' tensor parallelism initialises).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys

from ..engine import rank_liveness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(model: str, tensor_parallel_size: int, engine_kwargs: dict, module: str = "hf_paged.parallel.launch",
                settings: dict | None = None) -> list[subprocess.Popen]:
    """Make this process rank 0 of `tensor_parallel_size` ranks and start the others; returns their
    processes. Load the model (`ModelFromPath(model, tensor_parallel_size)`) after this: every rank
    loads at once. Each rank runs `python -m module SPEC` (default: follow rank 0's engine; a
    disaggregated worker's ranks run `hf_paged.disagg.rank`), SPEC a JSON object with `model`,
    `tensor_parallel_size`, `engine_kwargs` and `settings`."""
    if tensor_parallel_size < 2:
        raise ValueError(f"tensor_parallel_size must be 2 or more to start ranks, got {tensor_parallel_size}")
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                  "WORLD_SIZE": str(tensor_parallel_size), "LOCAL_WORLD_SIZE": str(tensor_parallel_size)}
    spec = json.dumps({"model": model, "tensor_parallel_size": tensor_parallel_size, "engine_kwargs": engine_kwargs,
                       "settings": settings or {}})
    timeout = rank_liveness.heartbeat_timeout()  # a bad override fails here, before any rank starts
    procs, read_fds = StartedRanks(), []
    for rank in range(1, tensor_parallel_size):
        read_fd, write_fd = os.pipe()  # the rank's heartbeats (engine.rank_liveness)
        env = {**os.environ, **rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank),
               rank_liveness.FD_ENV: str(write_fd)}
        try:
            procs.append(subprocess.Popen([sys.executable, "-m", module, spec], env=env, pass_fds=(write_fd,),
                                          preexec_fn=_die_with_parent))
        finally:
            os.close(write_fd)
        read_fds.append(read_fd)
    os.environ.update({**rendezvous, "RANK": "0", "LOCAL_RANK": "0"})
    atexit.register(_kill, procs)  # rank 0 exiting any way but `stop_ranks` (an error at start) leaves none behind
    procs.watch = rank_liveness.RankWatch(procs, read_fds, timeout)  # a hung rank is ended, not waited for
    return procs


class StartedRanks(list):
    """The processes `start_ranks` started (ranks 1..N-1, in order), and the `watch` over their heartbeats."""

    watch: rank_liveness.RankWatch | None = None


class TensorParallelReplica:
    """A picklable model factory for a data-parallel replica that is itself tensor-parallel
    (`hf-paged serve --data-parallel-size M --tensor-parallel-size N`): called in the replica's worker
    process, it makes that process rank 0 of `tensor_parallel_size`, starts the other ranks (with the
    worker's own engine settings, so that every rank builds the same engine) and loads rank 0's shard."""

    starts_ranks = True  # the disaggregated worker passes its engine settings (`disagg.worker.main`)

    def __init__(self, model: str, tensor_parallel_size: int = 2):
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
        self.model = model
        self.tensor_parallel_size = tensor_parallel_size

    def __call__(self, tokenizer_only: bool = False, engine_kwargs: dict | None = None,
                 tensor_parallel_size: int | None = None, rank_module: str = "hf_paged.parallel.launch",
                 rank_settings: dict | None = None):
        """The model (and tokenizer) of rank 0, its other ranks started first. The caller may set the
        size (a disaggregated worker: its pool's), and what each other rank runs (`start_ranks`)."""
        from ..model_source import ModelFromPath

        if tokenizer_only:
            return ModelFromPath(self.model)(tokenizer_only=True)
        size = tensor_parallel_size or self.tensor_parallel_size
        if size == 1:
            return ModelFromPath(self.model)()
        import torch

        per_rank = max(1, torch.get_num_threads() // size)  # the ranks share the replica's cores
        torch.set_num_threads(per_rank)
        os.environ["OMP_NUM_THREADS"] = str(per_rank)
        start_ranks(self.model, size, engine_kwargs or {}, module=rank_module, settings=rank_settings)
        return ModelFromPath(self.model, size)()


def _die_with_parent() -> None:
    """In a started rank, before it runs: the kernel sends it SIGTERM when rank 0's process dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_ranks(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """Wait for the ranks `start_ranks` started (rank 0's engine shut down: they stop following), killing
    any still running after `timeout` seconds: none outlives the server."""
    if getattr(procs, "watch", None) is not None:
        procs.watch.stop()  # they exit now on purpose
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def follower_main(spec: str) -> int:
    """A started rank: load the shard, build the same engine, follow rank 0 until it shuts down."""
    from ..engine import Engine
    from ..model_source import ModelFromPath
    from ..worker import bound_cpu_kernel_caches

    rank_liveness.beat_to_parent()
    settings = json.loads(spec)
    bound_cpu_kernel_caches()
    model, tokenizer = ModelFromPath(settings["model"], settings["tensor_parallel_size"])()
    engine = Engine(model.eval(), tokenizer, **settings["engine_kwargs"], show_progress=False)
    engine.serve_as_follower()
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(follower_main(sys.argv[1]))
