"""Disaggregated prefill and decode: prefill and decode workers in their own processes, K/V moved
between them over torch.distributed.

* `client`: `DisaggregatedEngine`, the callers' side (`generate` / `stream` / `metrics`, checks and
  tokenisation). `async_client`: `AsyncDisaggregatedEngine`, an `engine.EngineClient` over it, so
  `hf-paged serve --num-prefill P --num-decode D` can serve it.
* `supervisor`: the worker processes and the router thread (placement, heartbeats, faults, re-runs).
* `router`: where each request goes (torch-free; prefix affinity over `core`'s block hash chain).
* Data parallelism is the same machinery with no prefill worker: `DataParallelEngine` (and
  `hf-paged serve --data-parallel-size M`) runs M replicas, each request whole on one of them.
* `mailbox`: control messages over the job's `TCPStore`. `transfer`: K/V buffers point to point.
* `worker`: one worker process (its `Engine`, its loop). `torchrun`: the same topology under torchrun.

A front at the top of the dependency chain, beside `serve`: it uses `engine` and below, never
`serve`, and nothing below imports it.
"""

from .async_client import AsyncDisaggregatedEngine
from .client import DataParallelEngine, DisaggregatedEngine

__all__ = ["AsyncDisaggregatedEngine", "DataParallelEngine", "DisaggregatedEngine"]
