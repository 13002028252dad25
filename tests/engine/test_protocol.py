"""`EngineClient`, what the HTTP server needs of an engine: `AsyncEngine` implements every member
(the server reaches nothing else), and the disaggregated engine's async client declares them all."""

from __future__ import annotations

import asyncio
import inspect

from hf_paged import AsyncEngine, Engine, SamplingParams
from hf_paged.engine import EngineClient, EngineRequest
from tiny_models import tiny_model


def _members(protocol) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    return names | {n for n, v in vars(protocol).items() if not n.startswith("_") and
                    (inspect.isfunction(v) or isinstance(v, property))}


def test_async_engine_is_an_engine_client():
    engine = Engine(tiny_model("llama", "hf_paged"), num_blocks=64, block_size=4)

    async def main():
        client = AsyncEngine(engine)
        assert isinstance(client, EngineClient)
        assert client.is_alive() and client.vocab_size == engine.vocab_size
        assert client.tokenizer is engine.tokenizer and client.tokenizer_lock is engine.tokenizer_lock
        request = await client.add_request([5, 6, 7], SamplingParams(max_new_tokens=3), stream=True)
        assert isinstance(request, EngineRequest)
        events = [e async for e in request.events()]
        assert events[-1].finish_reason == "length" and request.finished
        assert client.metrics()["vllm:request_success"] == 1
        await client.shutdown()
        assert not client.is_alive()

    asyncio.run(main())


def test_the_disaggregated_client_declares_every_member():
    from hf_paged.disagg.async_client import AsyncDisaggregatedEngine, AsyncDisaggregatedRequest

    init = inspect.getsource(AsyncDisaggregatedEngine.__init__)
    missing = [n for n in _members(EngineClient) if not hasattr(AsyncDisaggregatedEngine, n)
               and f"self.{n} =" not in init]
    assert not missing, missing
    init = inspect.getsource(AsyncDisaggregatedRequest.__init__)
    missing = [n for n in _members(EngineRequest) if not hasattr(AsyncDisaggregatedRequest, n)
               and f"self.{n} =" not in init]
    assert not missing, missing
