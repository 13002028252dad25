"""Who receives each request's outputs: a per-owner inbox, filled by whichever thread runs the step.

Every request started by `generate`, `stream` or `submit` has an `Inbox`. The step that produces a
token (or ends the request) puts it there, whoever called `step()`; the owner drains its own inbox.
So several callers can interleave on one engine, or a background loop can step for all of them, and
nobody sees another's events or loses its own. `RequestHandle` is the owner's view of one submitted
request. Nothing here touches the scheduler or the cache: the engine passes in how to make progress.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator

from .outputs import RequestOutput, StreamEvent


class Inbox:
    """What the engine delivers to one owner, in order: `(event, final)` pairs. `event` is a
    `StreamEvent` (None when the owner asked for final outputs only); `final` is the request's
    `RequestOutput` on its last item, else None.

    Args:
        wants_tokens: deliver an item per token (streams), or only each request's end (`generate`).
        on_item: also call this with each item (the asyncio bridge); runs on the stepping thread.
    """

    def __init__(self, wants_tokens: bool = True, on_item: Callable | None = None):
        self.wants_tokens = wants_tokens
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._on_item = on_item

    def put(self, event: StreamEvent | None, final: RequestOutput | None) -> None:
        if event is not None and final is None and not self.wants_tokens:
            return
        item = (event if self.wants_tokens else None, final)
        if self._on_item is not None:
            self._on_item(item)
        else:
            self._items.put(item)

    def get(self, timeout: float | None = None):
        """The next item, waiting up to `timeout` seconds (None: forever); raises `queue.Empty`."""
        return self._items.get(timeout=timeout)

    def get_nowait(self):
        return self._items.get_nowait()

    def take_all(self) -> list:
        """Every item delivered so far, without waiting (for an owner that steps the engine itself)."""
        items = []
        while True:
            try:
                items.append(self._items.get_nowait())
            except queue.Empty:
                return items


def drain(inbox: Inbox, num_requests: int, step: Callable[[], object], is_looping: Callable[[], bool],
          timeout: float | None = None) -> Iterator[tuple[StreamEvent | None, RequestOutput | None]]:
    """Yield `inbox`'s items until `num_requests` finals have come. Without a background loop the
    caller makes progress itself by calling `step()`; with one it waits.

    Raises:
        TimeoutError: `timeout` seconds passed first.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    remaining = num_requests
    while remaining:
        item = _next_item(inbox)
        if item is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no result within {timeout} s")
            if not is_looping():
                step()
                continue
            try:
                item = inbox.get(timeout=0.05 if left is None else min(left, 0.05))
            except queue.Empty:
                continue
        if item[1] is not None:
            remaining -= 1
        yield item


def _next_item(inbox: Inbox):
    try:
        return inbox.get_nowait()
    except queue.Empty:
        return None


class RequestHandle:
    """One request submitted with `Engine.submit`: wait for its result or iterate over its events,
    from any thread. Without a started loop, `result()` and iteration run the engine's steps
    themselves.

    Attributes:
        request_id: the request's id.
    """

    def __init__(self, engine, request_id: str, inbox: Inbox):
        self._engine = engine
        self.request_id = request_id
        self._inbox = inbox
        self._final: RequestOutput | None = None
        self._iterating = False

    def _pump(self, timeout: float | None) -> Iterator[StreamEvent]:
        if self._final is not None:
            return
        for event, final in drain(self._inbox, 1, self._engine.advance, self._engine.is_running, timeout):
            if final is not None:
                self._final = final  # before yielding: the caller may stop iterating at this event
            if event is not None:
                yield event

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The finished `RequestOutput` (finish_reason "stop", "length", "abort" or "error").

        Raises:
            TimeoutError: not finished within `timeout` seconds (the request keeps running).
        """
        for _ in self._pump(timeout):
            pass  # events not consumed by an iterator are dropped once the result is asked for
        return self._final

    def __iter__(self) -> Iterator[StreamEvent]:
        """Each `StreamEvent` of the request, in order, the last one with its finish_reason."""
        if self._iterating:
            raise RuntimeError(f"request {self.request_id!r} is already being iterated")
        self._iterating = True
        yield from self._pump(None)

    def done(self) -> bool:
        return self._final is not None

    def abort(self) -> None:
        """Stop the request (between steps); its result then has finish_reason "abort"."""
        self._engine.abort(self.request_id)
