"""The serving engine: continuous batching over a transformers model with a paged KV cache.

* `engine.py`: `Engine`, the step loop (schedule, forward, sample, commit), streaming, abort, and the
  thread-safe front (`start` / `submit` / `stop`). `async_engine.py`: `AsyncEngine` for asyncio.
* `delivery.py`: each owner's inbox of outputs, and `RequestHandle`. `detokenizer.py`: incremental
  text and stop strings.
* `protocol.py`: `EngineClient`, what a front end (the HTTP server) needs of an engine; `AsyncEngine`
  implements it.
* `inputs.py`: prompts and sampling parameters, checked before anything is queued.
* `kv_budget.py`: the default KV pool size. `outputs.py`: `RequestOutput`, `StreamEvent` and text.
* `metrics.py`: per-request and engine-wide metrics with vLLM's names.

Drives `core` (scheduler), `worker` (forward, sampling) and `spec_decode` (drafts); the
transformers-facing glue that calls it lives in `integrations`.
"""

from .async_engine import AsyncEngine, AsyncRequest
from .delivery import RequestHandle
from .engine import Engine, EngineClosedError
from .metrics import EngineMetrics, RequestMetrics
from .outputs import RequestOutput, StreamEvent
from .protocol import EngineClient, EngineRequest

__all__ = ["AsyncEngine", "AsyncRequest", "Engine", "EngineClient", "EngineClosedError", "EngineMetrics", "EngineRequest", "RequestHandle", "RequestMetrics", "RequestOutput", "StreamEvent"]
