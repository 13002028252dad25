"""The engine's parts: `EngineCore.step` reads as a sentence, the executor seam takes any executor,
and the KV owner's step is a transaction (begin, then commit or abort)."""

from __future__ import annotations

import inspect

import torch

from hf_paged import Engine, SamplingParams
from hf_paged.engine.core import EngineCore
from hf_paged.engine.executor import ExecutorStep, InProcessExecutor
from tiny_models import tiny_model

PROMPTS = [list(range(3, 3 + n)) for n in (1, 17, 40)]


def test_the_core_step_is_schedule_execute_sample_update():
    lines = [line for line in inspect.getsource(EngineCore.step).splitlines()
             if line.strip() and not line.strip().startswith(("#", '"""', "failed step", "Raises"))]
    body = inspect.getsource(EngineCore.step)
    assert len(lines) <= 15, "\n".join(lines)
    for verb in ("_schedule", "execute", "_sample", "_update"):
        assert verb in body


class CountingExecutor:
    """An executor of our own on the seam: it runs each step on the in-process one and counts them."""

    def __init__(self, inner: InProcessExecutor):
        self.inner, self.steps, self.tokens = inner, 0, 0

    def execute(self, step: ExecutorStep) -> torch.Tensor:
        self.steps += 1
        self.tokens += sum(len(c.token_ids) for c in step.chunks)
        return self.inner.execute(step)

    @property
    def last_times(self):
        return self.inner.last_times


def test_any_executor_on_the_seam_gives_the_same_tokens():
    model = tiny_model("llama", "hf_paged")
    params = SamplingParams(max_new_tokens=6)
    expected = [o.token_ids for o in Engine(model, block_size=4).generate(PROMPTS, params)]
    engine = Engine(model, block_size=4)
    counting = CountingExecutor(engine.core.executor)
    engine.core.executor = counting
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == expected
    m = engine.step_profile()
    assert counting.steps == m["num_steps"] > 0 and counting.tokens == m["num_forward_tokens"]


def test_a_step_whose_forward_raises_leaves_no_trace_in_the_kv_owner():
    model = tiny_model("llama", "hf_paged")
    engine = Engine(model, block_size=4, num_blocks=64)

    class Failing:
        last_times = engine.core.executor.last_times

        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def execute(self, step):
            self.calls += 1
            if self.calls == 2:  # the step is planned (blocks appended), then its forward fails
                raise RuntimeError("injected forward failure")
            return self.inner.execute(step)

    engine.core.executor = Failing(engine.core.executor)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5))
    fresh = Engine(model, block_size=4).generate(PROMPTS, SamplingParams(max_new_tokens=5))
    assert [o.token_ids for o in out] == [o.token_ids for o in fresh]
    assert engine.metrics()["vllm:num_preemptions"] >= 1  # the failed step's requests went back to waiting
    engine.cache.pool.check_invariants()
    assert engine.kv.num_used_blocks == 0
