"""Tensor-parallel ranks without torchrun: a front beside `serve` and `disagg`.

`launch.py` makes the calling process rank 0 of N and starts ranks 1..N-1 as child processes, each of
which loads its shard of the same model and follows rank 0's engine (`engine.tensor_parallel`) until it
shuts down. `hf-paged serve --tensor-parallel-size N` and `hf-paged generate --input ...
--tensor-parallel-size N` use it (the `hf-paged` command hands it to the server). Under `torchrun` no
launcher is needed: every process loads its shard and `Engine` / drop-in `generate` lead or follow.
"""

from .launch import start_ranks, stop_ranks

__all__ = ["start_ranks", "stop_ranks"]
