"""`EngineClient`: what a front end (the HTTP server) needs of an engine, as a `typing.Protocol`.

`AsyncEngine` (one `Engine` in this process) implements it, and so does
`disagg.AsyncDisaggregatedEngine` (prefill and decode workers in their own processes), so `serve`
fronts either without knowing which. Both hand out an `EngineRequest` per request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from ..sampling_params import SamplingParams
from .outputs import RequestOutput, StreamEvent


@runtime_checkable
class EngineRequest(Protocol):
    """One queued request: iterate over its `events()` (a stream) or await its `result()`. Leaving
    either early aborts it."""

    request_id: str

    def events(self) -> AsyncIterator[StreamEvent]:
        """Each `StreamEvent`, in order; the last carries the finish_reason.

        Raises:
            EngineClosedError: the engine stopped without ending this request.
        """

    async def result(self) -> RequestOutput:
        """The finished output (finish_reason "stop", "length", "abort" or "error").

        Raises:
            EngineClosedError: the engine stopped without ending this request.
        """

    @property
    def finished(self) -> bool:
        """Whether its final output arrived."""

    async def abort(self) -> None:
        """Stop the request if it has not ended."""


@runtime_checkable
class EngineClient(Protocol):
    """An engine as an asyncio front end sees it.

    Attributes:
        vocab_size: token ids a request may name (`SamplingParams.validate`, logit bias).
        tokenizer: the model's tokenizer (prompts, chat templates), or None.
        tokenizer_lock: held while the tokenizer is used (the engine encodes string prompts under it).
    """

    vocab_size: int
    tokenizer: object
    tokenizer_lock: object

    async def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, *, stream: bool = True) -> EngineRequest:
        """Check and queue one request.

        Raises:
            ValueError/TypeError: the request is malformed or cannot be served (nothing was queued).
            EngineClosedError: the engine was shut down, or stopped.
        """

    async def abort(self, request_id: str) -> object:
        """Stop a request by id (nothing if it already ended)."""

    def is_alive(self) -> bool:
        """Whether it is serving (not shut down, its loop or workers running): the health check."""

    def metrics(self) -> dict:
        """Engine-wide metrics under vLLM's names (`vllm:num_requests_running`, `vllm:prompt_tokens`,
        the latency summaries as {"count", "sum"}, ...), as `Engine.metrics` gives them."""

    async def shutdown(self, drain: bool = True) -> None:
        """Stop for good: requests in flight finish (`drain`) or are aborted."""
