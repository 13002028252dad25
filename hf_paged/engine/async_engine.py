"""`AsyncEngine`: the engine for asyncio programs (web servers, notebooks with an event loop).

The wrapped `Engine` runs its step loop in its background thread; each request's items are handed
to the event loop with `call_soon_threadsafe`, so coroutines never block on a forward:

    engine = hf_paged.AsyncEngine(hf_paged.Engine(model, tokenizer))
    out = await engine.generate("Hello!", hf_paged.SamplingParams(max_new_tokens=32))
    async for event in engine.stream("Tell me a story", params):
        print(event.text, end="")

Request set-up (checking, tokenising a string prompt, the detokenizer's stop strings) runs on an
intake thread, never on the event loop, so one costly request cannot stall the others. A structured
request's grammar compiles before that, on the engine's grammar compile threads, and is awaited here
(at most `grammar_compile_timeout_seconds`): a request waiting for its grammar never holds the intake
thread, so it never delays one that needs none. A bad request raises ValueError/TypeError from
`add_request` (or `generate` / `stream`) before anything is queued. Cancelling a coroutine (or leaving
an `async for` early) aborts its request. After `shutdown()`, or once the engine's loop is no longer
running, every call raises `EngineClosedError` at once, and a request already waiting gets its end (or
that error): nothing waits forever.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..sampling_params import SamplingParams
from .delivery import Inbox
from .engine import Engine, EngineClosedError
from .outputs import RequestOutput, StreamEvent

# How often a waiting request checks that the engine's loop is still alive (seconds). Outputs
# arrive as they are produced; this only bounds how long a request waits on a loop that is gone.
LIVENESS_POLL_SECONDS = 1.0


class AsyncEngine:
    """asyncio front of an `Engine` (started here if it is not running yet); an `EngineClient`.

    Args:
        engine: the engine to serve from; `AsyncEngine(model, tokenizer, **engine_kwargs)` builds one.
    """

    def __init__(self, engine_or_model, tokenizer=None, **engine_kwargs):
        if isinstance(engine_or_model, Engine):
            if tokenizer is not None or engine_kwargs:
                raise TypeError("pass either an Engine, or a model with its tokenizer and Engine arguments")
            self.engine = engine_or_model
        else:
            self.engine = Engine(engine_or_model, tokenizer, **engine_kwargs)
        self.engine.start()
        self._closed = False
        # One intake thread: requests are set up in arrival order (encoding under the engine's
        # `tokenizer_lock`), none of it on the event loop.
        self._intake = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_paged-intake")

    async def generate(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """The finished output of one request.

        Raises:
            ValueError/TypeError: the request is malformed (nothing was queued).
            EngineClosedError: the engine was shut down, or its loop stopped.
        """
        request = await self.add_request(prompt, sampling_params, request_id, stream=False)
        return await request.result()

    async def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """Each `StreamEvent` of one request, as it is produced; the last carries its finish_reason.

        Raises:
            ValueError/TypeError: the request is malformed (nothing was queued).
            EngineClosedError: the engine was shut down, or its loop stopped.
        """
        request = await self.add_request(prompt, sampling_params, request_id, stream=True)
        async for event in request.events():
            yield event

    async def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, *, stream: bool = True) -> "AsyncRequest":
        """Check and queue one request; its outputs come from the returned `AsyncRequest`.

        Args:
            stream: deliver every token as a `StreamEvent` (text included); else only the end.

        Raises:
            ValueError/TypeError: the request is malformed (nothing was queued).
            EngineClosedError: the engine was shut down, or its loop stopped.
        """
        self._check_open()
        compiled = None
        if isinstance(sampling_params, SamplingParams) and sampling_params.structured is not None:
            # Checking it and starting the compile may build the engine's `Grammars` (its tokenizer's
            # vocabulary): off the event loop too.
            compiling = await asyncio.to_thread(self.engine.intake.compile_grammar, sampling_params)
            compiled = await compiling.result_async()
            self._check_open()  # shut down meanwhile: the intake thread is gone
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def deliver(item) -> None:  # on the engine's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is closed: nobody is waiting for it
                pass

        inbox = Inbox(wants_tokens=stream, on_item=deliver)
        add = functools.partial(self.engine.add_owned_request, prompt, sampling_params, request_id, inbox, 0,
                                streamed=stream, compiled_grammar=compiled)
        future = loop.run_in_executor(self._intake, add)
        try:
            request_id = await asyncio.shield(future)
        except asyncio.CancelledError:  # its caller left while it was being queued: abort it once queued
            future.add_done_callback(self._abort_orphan)
            raise
        return AsyncRequest(self, request_id, queue)

    async def abort(self, request_id: str) -> RequestOutput | None:
        return await asyncio.to_thread(self.engine.abort, request_id)

    async def shutdown(self, drain: bool = True) -> None:
        """Stop for good: new calls raise `EngineClosedError` at once; the requests in flight finish
        (`drain`) or are aborted, and their owners get their ends."""
        self._closed = True
        try:
            # Intakes already submitted finish first: each then ends with the engine (its owner is told).
            await asyncio.to_thread(self._intake.shutdown, True)
            await asyncio.to_thread(self.engine.shutdown, drain)
        finally:
            self._intake.shutdown(wait=False)

    @property
    def is_closed(self) -> bool:
        return self._closed or self.engine.is_closed

    # ------------------------------------------------------------------ the rest of `EngineClient`
    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def tokenizer_lock(self):
        return self.engine.tokenizer_lock

    def is_alive(self) -> bool:
        """Whether it serves: not shut down, and the engine's loop running."""
        return self.engine.is_running() and not self.is_closed

    def metrics(self) -> dict:
        """The engine's metrics (`Engine.metrics`)."""
        return self.engine.metrics()

    def _check_open(self) -> None:
        if self.is_closed:
            raise EngineClosedError("this AsyncEngine was shut down; create a new one")
        if not self.engine.is_running():
            raise EngineClosedError("the engine's background loop is not running (stopped or failed); "
                                    "AsyncEngine needs it: call engine.start() or create a new AsyncEngine")

    def _abort_orphan(self, future) -> None:
        if not future.cancelled() and future.exception() is None:
            asyncio.get_running_loop().run_in_executor(None, self.engine.abort, future.result())


class AsyncRequest:
    """One queued request of an `AsyncEngine`: iterate over its `events()` (a stream) or await its
    `result()`. Leaving either early (cancelled, or breaking out of the loop) aborts the request.

    Attributes:
        request_id: the request's id.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue):
        self._engine = engine
        self.request_id = request_id
        self._queue = queue
        self._final: RequestOutput | None = None

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Each `StreamEvent` of the request, in order; the last one carries its finish_reason.

        Raises:
            EngineClosedError: the engine's loop stopped without ending this request.
        """
        async for event, _ in self._items():
            if event is not None:
                yield event

    async def result(self) -> RequestOutput:
        """The finished `RequestOutput` (finish_reason "stop", "length", "abort" or "error").

        Raises:
            EngineClosedError: the engine's loop stopped without ending this request.
        """
        async for _ in self._items():
            pass
        return self._final

    @property
    def finished(self) -> bool:
        """Whether its final output arrived (it ended: finished, aborted or failed)."""
        return self._final is not None

    async def abort(self) -> None:
        """Stop the request if it has not ended (from any task)."""
        if self._final is None:
            await self._engine.abort(self.request_id)

    async def _items(self):
        loop_gone = False
        try:
            while self._final is None:
                try:
                    event, final = await self._next()
                except EngineClosedError:
                    loop_gone = True
                    raise
                if final is not None:
                    self._final = final
                yield event, final
        finally:
            if self._final is None:
                if loop_gone:  # an abort may wait on a wedged loop: it is sent, not awaited
                    asyncio.get_running_loop().run_in_executor(None, self._engine.engine.abort, self.request_id)
                else:
                    await self.abort()

    async def _next(self):
        while True:
            try:
                return await asyncio.wait_for(self._queue.get(), LIVENESS_POLL_SECONDS)
            except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11 on
                if self._engine.engine.is_running():
                    continue
            # The loop is gone: what it delivered before it stopped is already scheduled on this loop.
            try:
                return await asyncio.wait_for(self._queue.get(), LIVENESS_POLL_SECONDS)
            except (TimeoutError, asyncio.TimeoutError):
                raise EngineClosedError(f"the engine's loop stopped without ending request {self.request_id!r}") \
                    from None
