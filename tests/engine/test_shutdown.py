"""The engine's front ends fail loudly: after `shutdown()` every call on an `Engine` or
`AsyncEngine` raises `EngineClosedError` at once (before, a later `await generate(...)` hung
forever); an `AsyncEngine` whose engine loop is stopped, or dies, never leaves a caller waiting; and
streamed events carry their token's logprobs."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hf_paged import AsyncEngine, Engine, EngineClosedError, SamplingParams
from tiny_models import tiny_model

PROMPT = [5, 6, 7, 8, 9]


def _engine(**kwargs) -> Engine:
    return Engine(tiny_model("llama", "hf_paged"), num_blocks=64, block_size=4, **kwargs)


def test_every_call_on_a_shut_down_engine_raises_at_once():
    engine = _engine()
    assert engine.generate([PROMPT], SamplingParams(max_new_tokens=3))[0].finish_reason == "length"
    engine.start()
    handle = engine.submit(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True))
    engine.shutdown()
    assert handle.result(timeout=30).finish_reason in ("abort", "length")  # its owner got its end
    assert engine.is_closed and not engine.is_running()
    assert engine.cache.pool.num_used_blocks == 0
    calls = {
        "add_request": lambda: engine.add_request(PROMPT),
        "submit": lambda: engine.submit(PROMPT),
        "generate": lambda: engine.generate([PROMPT]),
        "stream": lambda: next(iter(engine.stream([PROMPT]))),
        "step": engine.step,
        "start": engine.start,
    }
    for name, call in calls.items():
        with pytest.raises(EngineClosedError, match="shut down"):
            call()
    engine.shutdown()  # idempotent


def test_shutdown_with_drain_finishes_what_runs():
    engine = _engine().start()
    handle = engine.submit(PROMPT, SamplingParams(max_new_tokens=6, min_new_tokens=6))
    engine.shutdown(drain=True)
    out = handle.result(timeout=30)
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_async_engine_after_shutdown_raises_at_once():
    async def main():
        engine = AsyncEngine(_engine())
        assert (await engine.generate(PROMPT, SamplingParams(max_new_tokens=2))).finish_reason == "length"
        await engine.shutdown()
        # Before: the request was queued on an engine nobody stepped, and this awaited forever.
        with pytest.raises(EngineClosedError):
            await asyncio.wait_for(engine.generate(PROMPT, SamplingParams(max_new_tokens=2)), 5)
        with pytest.raises(EngineClosedError):
            await asyncio.wait_for(engine.stream(PROMPT).__anext__(), 5)
        with pytest.raises(EngineClosedError):
            await asyncio.wait_for(engine.add_request(PROMPT), 5)

    asyncio.run(main())


def test_async_engine_over_a_stopped_loop_raises_at_once():
    async def main():
        engine = AsyncEngine(_engine())
        await asyncio.to_thread(engine.engine.stop)
        with pytest.raises(EngineClosedError, match="not running"):
            await asyncio.wait_for(engine.generate(PROMPT), 5)

    asyncio.run(main())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_loop_that_dies_ends_every_waiting_request_with_an_error():
    class LoopKilled(BaseException):
        pass

    async def main():
        engine = AsyncEngine(_engine())
        real_step, calls = engine.engine.core.step, []

        def dying_step():
            calls.append(1)
            if len(calls) > 2:
                raise LoopKilled("the loop dies")  # not an Exception: `advance` does not swallow it
            return real_step()

        engine.engine.core.step = dying_step
        out = await asyncio.wait_for(engine.generate(PROMPT, SamplingParams(max_new_tokens=50, ignore_eos=True)), 30)
        assert out.finish_reason == "error" and isinstance(out.error, RuntimeError)
        with pytest.raises(EngineClosedError):
            await engine.generate(PROMPT)

    asyncio.run(main())


def test_stream_events_carry_their_tokens_logprobs():
    engine = _engine()
    params = SamplingParams(max_new_tokens=6, min_new_tokens=6, logprobs=2)
    handle = engine.submit(PROMPT, params)
    tokens = [e for e in handle if e.token_id is not None]
    final = handle.result()
    assert [e.logprobs for e in tokens] == final.logprobs and all(e.logprobs is not None for e in tokens)
    assert all(e.logprobs is None for e in engine.stream([PROMPT], SamplingParams(max_new_tokens=3)))


def test_requests_handed_over_as_the_engine_shuts_down_end_with_an_error(monkeypatch):
    """The race `shutdown` meets under load: an add handed to the loop (its inbox) just as the loop
    stops, so nobody applied it. Shutdown ends it (EngineClosedError in its owner's output) and
    completes, with every block free."""
    engine = _engine().start()
    engine.stop()
    monkeypatch.setattr(Engine, "is_running", lambda self: True)  # as if the loop were still there
    handle = engine.submit(PROMPT, SamplingParams(max_new_tokens=5))  # queued in the loop's inbox
    monkeypatch.undo()
    assert engine.has_unfinished_requests()
    engine.shutdown(drain=False)  # (drain=True would run it to its end first)
    out = handle.result(timeout=10)
    assert out.finish_reason == "error" and isinstance(out.error, EngineClosedError), out
    assert engine.is_closed and engine.cache.pool.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_an_async_request_whose_loop_goes_away_raises_instead_of_waiting_forever(monkeypatch):
    """The loop stops making progress and is reported gone while a request waits: the waiter polls its
    liveness and raises EngineClosedError within a few seconds."""
    import hf_paged.engine.async_engine as async_engine

    monkeypatch.setattr(async_engine, "LIVENESS_POLL_SECONDS", 0.2)

    async def main():
        engine = AsyncEngine(_engine())
        request = await engine.add_request(PROMPT, SamplingParams(max_new_tokens=50, ignore_eos=True))
        wedged, release = threading.Event(), threading.Event()

        def wedge():  # the loop makes no progress: it waits for the engine's lock
            with engine.engine._lock:  # noqa: SLF001
                wedged.set()
                release.wait(30)

        threading.Thread(target=wedge, daemon=True).start()
        wedged.wait(10)
        monkeypatch.setattr(Engine, "is_running", lambda self: False)
        with pytest.raises(EngineClosedError, match="without ending request"):
            await asyncio.wait_for(request.result(), 10)  # before: awaited forever
        monkeypatch.undo()
        release.set()
        await engine.shutdown(drain=False)

    asyncio.run(main())
