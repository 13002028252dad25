"""Tensor-parallel ranks without torchrun: a front beside `serve` and `disagg`.

`launch.py` makes the calling process rank 0 of N and starts ranks 1..N-1 as child processes, each of
which loads its shard of the same model and follows rank 0's engine (`engine.tensor_parallel`) until it
shuts down. `hf-paged serve --tensor-parallel-size N` and `hf-paged generate --input ...
--tensor-parallel-size N` use it (the `hf-paged` command hands it to the server), and so does each
replica of `hf-paged serve --data-parallel-size M --tensor-parallel-size N` (`TensorParallelReplica`,
a model factory that the replica's worker process calls). Under `torchrun` no
launcher is needed: every process loads its shard and `Engine` / drop-in `generate` lead or follow.
"""

from .launch import TensorParallelReplica, start_ranks, stop_ranks

__all__ = ["TensorParallelReplica", "start_ranks", "stop_ranks"]
