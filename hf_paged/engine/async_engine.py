"""`AsyncEngine`: the engine for asyncio programs (web servers, notebooks with an event loop).

The wrapped `Engine` runs its step loop in its background thread; each request's items are handed
to the event loop with `call_soon_threadsafe`, so coroutines never block on a forward:

    engine = hf_paged.AsyncEngine(hf_paged.Engine(model, tokenizer))
    out = await engine.generate("Hello!", hf_paged.SamplingParams(max_new_tokens=32))
    async for event in engine.stream("Tell me a story", params):
        print(event.text, end="")

Cancelling a coroutine (or leaving an `async for` early) aborts its request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from ..worker.sampling import SamplingParams
from .delivery import Inbox
from .engine import Engine
from .outputs import RequestOutput, StreamEvent


class AsyncEngine:
    """asyncio front of an `Engine` (started here if it is not running yet).

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

    async def generate(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """The finished output of one request."""
        final = None
        async for _, output in self._items(prompt, sampling_params, request_id, wants_tokens=False):
            final = output
        return final

    async def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """Each `StreamEvent` of one request, as it is produced; the last carries its finish_reason."""
        async for event, _ in self._items(prompt, sampling_params, request_id, wants_tokens=True):
            if event is not None:
                yield event

    async def _items(self, prompt, sampling_params, request_id, wants_tokens: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        inbox = Inbox(wants_tokens=wants_tokens, on_item=lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))
        request_id = self.engine.add_owned_request(prompt, sampling_params, request_id, inbox, 0, streamed=wants_tokens)
        finished = False
        try:
            while not finished:
                event, final = await queue.get()
                finished = final is not None
                yield event, final
        finally:
            if not finished:
                await asyncio.to_thread(self.engine.abort, request_id)

    async def abort(self, request_id: str) -> RequestOutput | None:
        return await asyncio.to_thread(self.engine.abort, request_id)

    async def shutdown(self, drain: bool = True) -> None:
        """Stop the engine's loop (after finishing its requests, or aborting them)."""
        await asyncio.to_thread(self.engine.stop, drain)
