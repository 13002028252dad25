"""Several callers on one engine: interleaved streams, a started engine fed by 8 threads, and
`AsyncEngine` with 50 concurrent tasks. Every greedy output equals stock, every seeded one equals
the same request run alone, every request ends exactly once, no block leaks, and nothing deadlocks
(each test runs under a watchdog)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from hf_paged import AsyncEngine, Engine, SamplingParams
from tiny_models import VOCAB, tiny_model

WATCHDOG_S = 240


@pytest.fixture
def watchdog():
    """Fails the test (instead of hanging CI) if it is not done in time."""
    done = threading.Event()
    fired = []

    def bark():
        if not done.wait(WATCHDOG_S):
            fired.append(True)
            import _thread

            _thread.interrupt_main()

    threading.Thread(target=bark, daemon=True).start()
    yield
    done.set()
    assert not fired, f"watchdog: the test did not finish within {WATCHDOG_S} s"


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 4, 9, 17, 30, 45]))]


def _params(rng: random.Random, i: int) -> SamplingParams:
    new = rng.choice([1, 3, 8, 12])
    if rng.random() < 0.5:
        return SamplingParams(max_new_tokens=new, min_new_tokens=new)
    return SamplingParams(max_new_tokens=new, min_new_tokens=new, temperature=0.9, top_k=40, seed=1000 + i)


def _expected(prompts, params):
    """Greedy: stock generate per prompt; seeded: the same request alone on a fresh engine."""
    stock = tiny_model("llama", "sdpa")
    alone = Engine(tiny_model("llama", "hf_paged"))
    out = []
    for prompt, p in zip(prompts, params):
        if p.is_greedy:
            ids = torch.tensor([prompt])
            ref = stock.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=p.max_new_tokens, min_new_tokens=p.min_new_tokens)
            out.append(ref[0, len(prompt):].tolist())
        else:
            out.append(alone.generate([prompt], p)[0].token_ids)
    return out


def _assert_idle_and_free(engine):
    assert not engine.has_unfinished_requests()
    pool = engine.cache.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def test_interleaved_streams_and_generate_see_all_their_events(watchdog):
    """A stream paused while `generate()` runs, and two streams advanced turn by turn: each gets every
    one of its events (the other callers' steps produced them) and exactly one final event."""
    rng = random.Random(0)
    prompts = [_prompt(rng) for _ in range(4)]
    params = SamplingParams(max_new_tokens=10, min_new_tokens=10)
    expected = _expected(prompts, [params] * 4)
    engine = Engine(tiny_model("llama", "hf_paged"), block_size=4)
    paused = engine.stream(prompts[0], params)
    first = next(paused)
    others = engine.generate(prompts[1:3], params)  # advances the paused stream's request too
    rest = [first] + list(paused)
    assert [e.token_id for e in rest] == expected[0] and [o.token_ids for o in others] == expected[1:3]
    assert [e.finish_reason for e in rest].count("length") == 1
    a, b = engine.stream(prompts[0], params), engine.stream(prompts[3], params)
    seen = {"a": [], "b": []}
    pending = {"a": a, "b": b}
    while pending:
        for name in list(pending):
            try:
                seen[name].append(next(pending[name]))
            except StopIteration:
                del pending[name]
    assert [e.token_id for e in seen["a"]] == expected[0] and [e.token_id for e in seen["b"]] == expected[3]
    assert all([e.finish_reason for e in events].count("length") == 1 for events in seen.values())
    _assert_idle_and_free(engine)


def test_eight_threads_two_hundred_requests_on_a_started_engine(watchdog):
    rng = random.Random(1)
    n = 200
    prompts = [_prompt(rng) for _ in range(n)]
    params = [_params(rng, i) for i in range(n)]
    expected = _expected(prompts, params)
    engine = Engine(tiny_model("llama", "hf_paged"), block_size=4, num_blocks=160, max_num_seqs=16,
                    max_num_batched_tokens=96).start()
    results: dict[int, object] = {}
    ends: dict[int, int] = {}
    aborted: set[int] = set()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(worker_id: int):
        local = random.Random(100 + worker_id)
        try:
            for i in range(worker_id, n, 8):
                handle = engine.submit(prompts[i], params[i], request_id=f"r{i}")
                mode = local.random()
                if mode < 0.15:  # a stream closed early: the request is aborted
                    events = iter(handle)
                    next(events)
                    handle.abort()
                    with lock:
                        aborted.add(i)
                    out = handle.result(timeout=60)
                elif mode < 0.25:  # aborted right away, from another thread than the loop's
                    handle.abort()
                    with lock:
                        aborted.add(i)
                    out = handle.result(timeout=60)
                elif mode < 0.6:  # streamed to the end
                    events = list(handle)
                    with lock:
                        ends[i] = sum(e.finish_reason is not None for e in events)
                    out = handle.result(timeout=60)
                    assert [e.token_id for e in events if e.token_id is not None] == out.token_ids
                else:
                    out = handle.result(timeout=60)
                with lock:
                    assert i not in results
                    results[i] = out
        except BaseException as exc:  # surfaced below, with the thread's traceback
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WATCHDOG_S)
    engine.stop(drain=True, timeout=60)
    assert not errors, errors[0]
    assert sorted(results) == list(range(n))  # every request ended, exactly once
    for i, out in results.items():
        if i in aborted:
            assert out.finish_reason in ("abort", "length")  # it may have finished before the abort
            assert out.token_ids == expected[i][: len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and out.token_ids == expected[i], i
    assert all(count == 1 for count in ends.values())
    _assert_idle_and_free(engine)


def test_async_engine_fifty_concurrent_tasks(watchdog):
    rng = random.Random(2)
    n = 50
    prompts = [_prompt(rng) for _ in range(n)]
    params = [_params(rng, i) for i in range(n)]
    expected = _expected(prompts, params)

    async def main():
        engine = AsyncEngine(tiny_model("llama", "hf_paged"), block_size=4, num_blocks=160, max_num_seqs=16)

        async def one(i: int):
            if i % 3 == 0:
                tokens, finals = [], 0
                async for event in engine.stream(prompts[i], params[i]):
                    if event.token_id is not None:
                        tokens.append(event.token_id)
                    finals += event.finish_reason is not None
                assert finals == 1
                return tokens
            if i % 7 == 1:  # cancelled mid-way: its request is aborted
                task = asyncio.ensure_future(engine.generate(prompts[i], SamplingParams(max_new_tokens=200,
                                                                                        ignore_eos=True)))
                await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                return None
            return (await engine.generate(prompts[i], params[i])).token_ids

        outs = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), WATCHDOG_S)
        await engine.shutdown()
        return engine.engine, outs

    engine, outs = asyncio.run(main())
    for i, out in enumerate(outs):
        if out is not None:
            assert out == expected[i], i
    _assert_idle_and_free(engine)
