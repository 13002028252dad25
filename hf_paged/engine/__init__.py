"""The serving engine: continuous batching over a transformers model with a paged KV cache.

* `engine.py`: `Engine`, the public front: intake, commands from other threads, the background
  loop, shutdown, the kept-KV API and metrics; `blocking.py`: its `generate` / `stream`;
  `async_engine.py`: `AsyncEngine` for asyncio.
* `core.py`: `EngineCore`, one step (schedule -> execute -> sample -> update) and the live requests;
  it knows no text. `executor.py`: the executor seam (`InProcessExecutor` today).
* `output_processor.py`: text, stop strings, streaming events and `RequestOutput`s;
  `detokenizer.py`: incremental text and linear-time stop-string matching.
* `intake.py`: a caller's request checked and registered; `inputs.py`: prompts and sampling
  parameters, checked before anything is queued. `tracked.py`: the engine's record of a request.
* `delivery.py`: each owner's inbox of outputs, and `RequestHandle`.
* `kv_budget.py`: the default KV pool size. `outputs.py`: `RequestOutput`, `StreamEvent`.
* `protocol.py`: `EngineClient`, what a front end (the HTTP server) needs of an engine; `AsyncEngine`
  implements it.
* `metrics.py`: per-request and engine-wide metrics with vLLM's names.

Drives `core` (scheduler), `hf` (the KV owner), `worker` (forward, sampling) and `spec_decode`
(drafts); the transformers-facing glue that calls it lives in `integrations`.
"""

from .async_engine import AsyncEngine, AsyncRequest
from .delivery import RequestHandle
from .engine import Engine, EngineClosedError
from .executor import ExecutorLostError
from .metrics import EngineMetrics, RequestMetrics
from .outputs import RequestOutput, StreamEvent
from .protocol import EngineClient, EngineRequest

__all__ = ["AsyncEngine", "AsyncRequest", "Engine", "EngineClient", "EngineClosedError", "EngineMetrics", "ExecutorLostError", "EngineRequest", "RequestHandle", "RequestMetrics", "RequestOutput", "StreamEvent"]
