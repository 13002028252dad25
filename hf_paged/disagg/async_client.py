"""`AsyncDisaggregatedEngine`: a `DisaggregatedEngine` for asyncio programs, and an
`engine.EngineClient`, so `hf-paged serve --num-prefill P --num-decode D` serves the OpenAI API over
disaggregated workers with the same server code as over one `AsyncEngine`.

The supervisor's router thread hands each request's events and output to the event loop with
`call_soon_threadsafe`; prompts are checked and tokenised on an intake thread, never on the loop.
Streams are real: the decode worker sends its tokens after every engine step, so a stream gets one
`StreamEvent` per token as it is produced (without per-token logprobs: those come with the final
output only). Metrics keep vLLM's names: requests, tokens and latencies counted here, the prefix
cache and the KV usage summed over the workers' last heartbeats.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..engine import EngineClosedError, RequestOutput, StreamEvent
from ..engine.async_engine import LIVENESS_POLL_SECONDS
from ..engine.metrics import EngineMetrics, kv_cache_usage
from ..engine.outputs import CompletionOutput
from ..sampling_params import SamplingParams
from .client import DisaggregatedEngine
from .supervisor import Routed


class AsyncDisaggregatedEngine:
    """asyncio front of a `DisaggregatedEngine` (which it closes on `shutdown`).

    Args:
        engine: the running disaggregated engine; its `tokenizer` encodes string prompts.
        vocab_size: token ids a request may name; default what the workers reported at start.
    """

    def __init__(self, engine: DisaggregatedEngine, vocab_size: int | None = None):
        self.engine = engine
        reported = list(engine.supervisor.ready_reports.values())
        self.vocab_size = vocab_size or next((st["vocab_size"] for st in reported if st.get("vocab_size")), None)
        if self.vocab_size is None:
            raise ValueError("the workers did not report their vocabulary size: pass vocab_size=")
        self.max_model_len = min((st["max_model_len"] for st in reported if st.get("max_model_len")), default=None)
        self._closed = False
        self._intake = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_paged-disagg-intake")
        self._lock = threading.Lock()
        self._running = 0
        self._counts = {"prompt_tokens": 0, "generation_tokens": 0, "request_success": 0}
        self._latencies = {"ttft": [0, 0.0], "itl": [0, 0.0], "e2e": [0, 0.0]}  # count, sum (what /metrics shows)
        self._rids: dict[str, str] = {}  # the caller's request id -> the router's, while it runs

    @classmethod
    def launch(cls, model_factory, *, tokenizer, num_prefill: int, num_decode: int, engine_kwargs: dict | None = None,
               **kwargs) -> "AsyncDisaggregatedEngine":
        """Start the workers (`DisaggregatedEngine(model_factory, num_prefill, num_decode, ...)`) and
        serve them: what `hf-paged serve --num-prefill P --num-decode D` runs, and, with no prefill worker,
        `--data-parallel-size D`."""
        engine_kwargs = {k: v for k, v in (engine_kwargs or {}).items() if v is not None}
        return cls(DisaggregatedEngine(model_factory, num_prefill, num_decode, tokenizer=tokenizer,
                                       engine_kwargs=engine_kwargs, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def tokenizer_lock(self):
        return self.engine.tokenizer_lock

    async def generate(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> RequestOutput:
        """The finished output of one request (as `AsyncEngine.generate`)."""
        request = await self.add_request(prompt, sampling_params, request_id, stream=False)
        return await request.result()

    async def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """Each `StreamEvent` of one request, as it is produced (as `AsyncEngine.stream`)."""
        request = await self.add_request(prompt, sampling_params, request_id, stream=True)
        async for event in request.events():
            yield event

    async def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, *, stream: bool = True) -> "AsyncDisaggregatedRequest":
        """Check and route one request; its outputs come from the returned request.

        Raises:
            ValueError/TypeError: the request cannot be served (n > 1, prompt logprobs, a bad prompt).
            EngineClosedError: shut down, or the router stopped.
        """
        self._check_open()
        loop = asyncio.get_running_loop()
        prompt_ids, params = await loop.run_in_executor(self._intake, self.engine.prepare, prompt, sampling_params)
        params.validate(self.vocab_size)
        self._check_open()
        request = AsyncDisaggregatedRequest(self, request_id, loop)
        with self._lock:
            self._running += 1
            self._rids[request.request_id] = request.rid
        request.routed = Routed(request.rid, 0, prompt_ids, params, request, stream=stream)  # before it can end
        try:
            self.engine.submit(request.routed)
        except RuntimeError as exc:
            self.count_end(request, None, 0)
            raise EngineClosedError(str(exc)) from None
        return request

    async def abort(self, request_id: str) -> None:
        """Stop a request by the id `add_request` was given (or its routed id)."""
        with self._lock:
            rid = self._rids.get(request_id, request_id)
        self.engine.abort(rid)

    def is_alive(self) -> bool:
        """Whether it serves: not shut down, the router running and a decode worker alive."""
        supervisor = self.engine.supervisor
        return (not self._closed and supervisor.is_running()
                and any(name not in supervisor.router.dead for name in supervisor.decode_names))

    @property
    def is_closed(self) -> bool:
        return self._closed or self.engine.is_closed

    def metrics(self) -> dict:
        """`Engine.metrics`' vLLM names: requests, tokens and latencies (time to first token from the
        prefill worker's first token) counted here; prefix-cache lookups and KV usage from the
        workers' last reports (KV usage: the decode workers' pools). Plus the engine's own
        `metrics()` under "disaggregated" (transfers, re-routes, workers)."""
        m = EngineMetrics().as_dict()  # every name, zeroed, with the summaries' shape
        details = self.engine.metrics()
        workers = details["workers"]
        engines = [st.get("engine", {}) for st in workers.values()]
        for key in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            m[key] = sum(e.get(key, 0) for e in engines)
        decode = [workers[name] for name in self.engine.supervisor.decode_names if name in workers]
        m["vllm:kv_cache_usage_perc"] = kv_cache_usage(sum(st.get("num_blocks", 0) for st in decode),
                                                       sum(st.get("free_blocks", 0) for st in decode))
        with self._lock:
            m["vllm:num_requests_running"] = self._running
            m["vllm:prompt_tokens"] = self._counts["prompt_tokens"]
            m["vllm:generation_tokens"] = self._counts["generation_tokens"]
            m["vllm:request_success"] = self._counts["request_success"]
            for name, key in (("vllm:time_to_first_token_seconds", "ttft"),
                              ("vllm:inter_token_latency_seconds", "itl"), ("vllm:e2e_request_latency_seconds", "e2e")):
                count, total_seconds = self._latencies[key]
                m[name] = {**m[name], "count": count, "sum": total_seconds}
        m["disaggregated"] = details
        return m

    async def shutdown(self, drain: bool = True) -> None:
        """Stop for good: new calls raise `EngineClosedError`; with `drain`, the requests in flight
        finish first; then the workers stop (what is still running ends with an error)."""
        self._closed = True
        try:
            await asyncio.to_thread(self._intake.shutdown, True)
            while drain and self._running and self.engine.is_running():
                await asyncio.sleep(0.05)
            await asyncio.to_thread(self.engine.close)
        finally:
            self._intake.shutdown(wait=False)

    def _check_open(self) -> None:
        if self.is_closed:
            raise EngineClosedError("this AsyncDisaggregatedEngine was shut down")
        if not self.engine.is_running():
            raise EngineClosedError("the disaggregated engine's router is not running (closed or failed)")

    def count_end(self, request: "AsyncDisaggregatedRequest", finish_reason: str | None, num_tokens: int) -> None:
        """Count one request's end (called once per request, on the router's thread)."""
        now = time.perf_counter()
        routed = request.routed
        with self._lock:
            self._running -= 1
            self._rids.pop(request.request_id, None)
            if routed is None or finish_reason not in ("stop", "length"):
                return
            self._counts["request_success"] += 1
            self._counts["prompt_tokens"] += len(routed.prompt)
            self._counts["generation_tokens"] += num_tokens
            self._observe("e2e", now - routed.arrival)
            if routed.first_token_time is not None:
                self._observe("ttft", routed.first_token_time - routed.arrival)
                if num_tokens > 1:
                    self._observe("itl", (now - routed.first_token_time) / (num_tokens - 1))

    def _observe(self, key: str, seconds: float) -> None:
        self._latencies[key][0] += 1
        self._latencies[key][1] += seconds


class AsyncDisaggregatedRequest:
    """One routed request of an `AsyncDisaggregatedEngine` (an `engine.EngineRequest`): iterate over
    its `events()` or await its `result()`; leaving either early aborts it.

    Attributes:
        request_id: the id the caller gave (or the routed one).
    """

    def __init__(self, owner: AsyncDisaggregatedEngine, request_id: str | None, loop: asyncio.AbstractEventLoop):
        self.rid = owner.engine.new_request_id()  # the router's: unique whatever the caller's ids
        self.request_id = request_id or self.rid
        self.routed = None
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._final: RequestOutput | None = None
        self._tokens: list[int] = []  # a stream's tokens and texts so far (on the loop)
        self._text: list[str] = []
        self._num_routed_tokens = 0  # the same count, on the router's thread
        self._counted = False

    # ------------------------------------------------------------------ the router's side
    def put(self, item) -> None:
        """An event or the final output, from the router's thread."""
        if isinstance(item, StreamEvent) and item.token_id is not None:
            self._num_routed_tokens += 1
        if isinstance(item, RequestOutput):
            self._count_end(item.finish_reason, len(item.token_ids))
        elif isinstance(item, StreamEvent) and item.finish_reason is not None:
            self._count_end(item.finish_reason, self._num_routed_tokens)
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is waiting for it
            pass

    def _count_end(self, finish_reason: str | None, num_tokens: int) -> None:
        if not self._counted:
            self._counted = True
            self._owner.count_end(self, finish_reason, num_tokens)

    # ------------------------------------------------------------------ the caller's side
    async def events(self) -> AsyncIterator[StreamEvent]:
        """Each `StreamEvent`, in order; the last carries the finish_reason (a request routed
        without `stream` gives one event per token at its end)."""
        async for item in self._items():
            if isinstance(item, StreamEvent):
                yield StreamEvent(self.request_id, 0, item.token_id, item.text, item.finish_reason)
            else:  # the whole output at once: one event per token, the last with the finish reason
                tokens = item.token_ids or [None]
                for j, token in enumerate(tokens):
                    last = j == len(tokens) - 1
                    yield StreamEvent(self.request_id, 0, token, (item.text or "") if last else "",
                                      item.finish_reason if last else None)

    async def result(self) -> RequestOutput:
        """The finished `RequestOutput` (finish_reason "stop", "length", "abort" or "error")."""
        async for _ in self._items():
            pass
        return self._final

    @property
    def finished(self) -> bool:
        return self._final is not None

    async def abort(self) -> None:
        if self._final is None:
            self._owner.engine.abort(self.rid)

    async def _items(self):
        try:
            while self._final is None:
                item = await self._next()
                if isinstance(item, RequestOutput):
                    item.request_id = self.request_id
                    self._final = item
                elif isinstance(item, StreamEvent):
                    if item.token_id is not None:
                        self._tokens.append(item.token_id)
                    self._text.append(item.text or "")
                    if item.finish_reason is not None:
                        self._final = self._streamed_output(item.finish_reason)
                yield item
        finally:
            if self._final is None:
                await self.abort()

    def _streamed_output(self, finish_reason: str) -> RequestOutput:
        """A streamed request's final output, from the events it gave."""
        sample = CompletionOutput(0, token_ids=list(self._tokens), text="".join(self._text),
                                  finish_reason=finish_reason)
        prompt = list(self.routed.prompt) if self.routed is not None else []
        return RequestOutput(request_id=self.request_id, prompt_token_ids=prompt, outputs=[sample],
                             finish_reason=finish_reason)

    async def _next(self):
        while True:
            try:
                return await asyncio.wait_for(self._queue.get(), LIVENESS_POLL_SECONDS)
            except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11 on
                if self._owner.engine.is_running():
                    continue
            try:  # what the router delivered before it stopped is already scheduled on this loop
                return await asyncio.wait_for(self._queue.get(), LIVENESS_POLL_SECONDS)
            except (TimeoutError, asyncio.TimeoutError):
                raise EngineClosedError(f"the disaggregated engine stopped without ending request "
                                        f"{self.request_id!r}") from None
