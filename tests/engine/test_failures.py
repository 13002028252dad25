"""Failure injection: an exception at each stage of a step, once or every time.

After each injection, in one test per stage:
  (a) an identical later prompt gives stock-identical greedy output (nothing unwritten was published in
      the prefix cache; the prompts share a prefix of two full blocks so a stale hit would show);
  (b) the engine keeps serving;
  (c) `check_invariants()` passes and, once every request ended, the pool is entirely free;
  (d) every request ends exactly once, with its output (a once-off failure is retried, so the output is
      stock's) or, when the stage always fails, with finish_reason="error".
"""

from __future__ import annotations

import pytest
import torch

import hf_paged.attention.dispatch as dispatch
import hf_paged.engine.detokenizer as detokenizer
import hf_paged.engine.core as engine_module
import hf_paged.worker.runner as runner_module
from hf_paged import Engine, SamplingParams
from hf_paged.core import BlockManager, Scheduler
from hf_paged.spec_decode import NgramProposer
from hf_paged.worker import ModelRunner, Sampler
from tiny_models import VOCAB, CharTokenizer, tiny_model

NEW = 10
NUM_LAYERS = 3  # tiny_models' llama


def _prompts():
    g = torch.Generator().manual_seed(42)
    shared = torch.randint(3, VOCAB, (8,), generator=g).tolist()  # two full blocks of 4
    tails = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 2, 9)]
    return [shared + t for t in tails]


@pytest.fixture(scope="module")
def stock():
    model = tiny_model("llama", "sdpa")
    outs = []
    for p in _prompts():
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                             min_new_tokens=NEW)
        outs.append(out[0, len(p):].tolist())
    return outs


class Injector:
    """Makes `owner.name` raise on chosen calls: `calls` is which (0-based) calls raise, or "always"."""

    def __init__(self, monkeypatch, owner, name, calls=(0,)):
        self.calls, self.count, self.raised = calls, 0, 0
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            index, self.count = self.count, self.count + 1
            if self.calls == "always" or index in self.calls:
                self.raised += 1
                raise RuntimeError(f"injected failure in {name}")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)


def _after_forward(monkeypatch, calls):
    """The forward succeeds (K/V written, blocks published), then the engine's step raises."""
    original = ModelRunner.forward
    state = {"count": 0, "raised": 0}

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        index, state["count"] = state["count"], state["count"] + 1
        if calls == "always" or index in calls:
            state["raised"] += 1
            raise RuntimeError("injected failure after the forward")
        return out

    monkeypatch.setattr(ModelRunner, "forward", forward)
    return type("Injected", (), {"raised": property(lambda self: state["raised"])})()


# stage -> (how to inject, engine kwargs, sampling kwargs)
STAGES = {
    "scheduling": (lambda mp, c: Injector(mp, Scheduler, "schedule", c), {}, {}),
    "scheduling_midway": (lambda mp, c: Injector(mp, BlockManager, "append_tokens", (1,) if c != "always" else c),
                          {}, {}),
    "metadata": (lambda mp, c: Injector(mp, runner_module, "build_packed_metadata", c), {}, {}),
    "attention_first_layer": (lambda mp, c: Injector(mp, dispatch, "paged_attention", c), {}, {}),
    "attention_last_layer": (lambda mp, c: Injector(mp, dispatch, "paged_attention",
                                                    (NUM_LAYERS - 1,) if c != "always" else c), {}, {}),
    "after_forward": (_after_forward, {}, {}),
    "sampling": (lambda mp, c: Injector(mp, Sampler, "__call__", c), {}, {}),
    "verification": (lambda mp, c: Injector(mp, engine_module, "verify_greedy", c),
                     dict(speculative_method="ngram", num_speculative_tokens=3), {}),
    "proposer": (lambda mp, c: Injector(mp, NgramProposer, "propose", c),
                 dict(speculative_method="ngram", num_speculative_tokens=3), {}),
    "detokenizing": (lambda mp, c: Injector(mp, detokenizer.IncrementalDetokenizer, "add", c),
                     dict(tokenizer=True), dict(stop=["zzzz"])),
    "stop_string_check": (lambda mp, c: Injector(mp, detokenizer.StopStringMatcher, "push", c),
                          dict(tokenizer=True), dict(stop=["zzzz"])),
}


def _engine(extra):
    extra = dict(extra)
    tokenizer = CharTokenizer() if extra.pop("tokenizer", False) else None
    return Engine(tiny_model("llama", "hf_paged"), tokenizer, block_size=4, num_blocks=64, **extra)


def _check_pool(engine):
    pool = engine.cache.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks  # every request ended: nothing is held
    assert not engine.has_unfinished_requests()


def _run_streams(engine, prompts, params):
    """All prompts through `stream`; returns per prompt (token ids, the finish reasons its events had)."""
    tokens = {i: [] for i in range(len(prompts))}
    ends = {i: [] for i in range(len(prompts))}
    for event in engine.stream(prompts, params):
        if event.token_id is not None:
            tokens[event.index].append(event.token_id)
        if event.finish_reason is not None:
            ends[event.index].append(event.finish_reason)
    return tokens, ends


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_failure_once_is_undone_and_retried(stage, monkeypatch, stock):
    inject, engine_kwargs, sampling_kwargs = STAGES[stage]
    engine = _engine(engine_kwargs)
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, **sampling_kwargs)
    # Warm the prefix cache with the first prompt, then inject into the step that admits the rest.
    first = engine.generate(prompts[:1], params)[0]
    assert first.token_ids == stock[0]
    injected = inject(monkeypatch, (0,))
    tokens, ends = _run_streams(engine, prompts, params)
    monkeypatch.undo()
    assert injected.raised == 1, "the injection point was never reached"
    assert [tokens[i] for i in range(3)] == stock  # (d) retried: each request ends once, with stock's output
    assert [ends[i] for i in range(3)] == [["length"]] * 3
    _check_pool(engine)  # (c)
    assert engine.metrics()["num_failed_steps"] >= 1
    again = engine.generate(prompts, params)  # (a) + (b): the prefix cache holds nothing unwritten
    assert [o.token_ids for o in again] == stock
    _check_pool(engine)


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_failure_every_time_ends_requests_with_an_error_and_the_engine_recovers(stage, monkeypatch, stock):
    inject, engine_kwargs, sampling_kwargs = STAGES[stage]
    engine = _engine(engine_kwargs)
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, **sampling_kwargs)
    injected = inject(monkeypatch, "always")
    outs = engine.generate(prompts, params)  # returns: nothing hangs
    monkeypatch.undo()
    assert injected.raised >= 1
    for out, expected in zip(outs, stock):
        # (d) each ends exactly once: with an error, or (a proposer / verifier that always fails only
        # costs speculation) with its output
        if out.finish_reason == "error":
            assert isinstance(out.error, RuntimeError) and "injected" in str(out.error)
        else:
            assert stage in ("proposer",) and out.token_ids == expected
    _check_pool(engine)  # (c)
    again = engine.generate(prompts, params)  # (a) + (b)
    assert [o.token_ids for o in again] == stock
    _check_pool(engine)


def test_nan_logits_end_that_request_alone(monkeypatch, stock):
    """A bad logits row is the request's own failure: it ends with an error at once, the others finish."""
    engine = _engine({})
    prompts = _prompts()
    original = ModelRunner.forward

    def forward(self, chunks, *args, **kwargs):
        logits = original(self, chunks, *args, **kwargs).clone()  # inference tensors are read-only
        row = 0
        for chunk in chunks:
            if chunk.num_logits and chunk.token_ids[-1] == prompts[1][-1] and chunk.start + len(chunk.token_ids) == len(
                    prompts[1]):
                logits[row] = float("nan")
            row += chunk.num_logits
        return logits

    monkeypatch.setattr(ModelRunner, "forward", forward)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
    monkeypatch.undo()
    assert outs[1].finish_reason == "error" and "NaN" in str(outs[1].error)
    assert [outs[0].token_ids, outs[2].token_ids] == [stock[0], stock[2]]
    _check_pool(engine)


def test_step_raises_after_undoing_and_the_next_step_carries_on(monkeypatch, stock):
    """Driven by hand, a failed step propagates (the caller sees it) and leaves no trace."""
    engine = _engine({})
    prompts = _prompts()
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)) for p in prompts]
    Injector(monkeypatch, dispatch, "paged_attention", (1,))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.cache.pool.check_invariants()
    assert engine.metrics()["vllm:num_preemptions"] == 3  # requeued, counted
    monkeypatch.undo()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out.token_ids
    assert [finished[i] for i in ids] == stock
    _check_pool(engine)


def test_a_text_failure_after_some_tokens_ends_only_its_request(monkeypatch, stock):
    """The stop-string check starts failing after a few tokens, for good: the request's text state
    cannot even be replayed, so it ends with an error (its text decoded whole), and nothing hangs."""
    engine = _engine(dict(tokenizer=True))
    prompts = _prompts()
    stop = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, stop=["zzzz"])
    plain = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)
    Injector(monkeypatch, detokenizer.StopStringMatcher, "push", calls=range(4, 10**9))
    outs = engine.generate(prompts, [plain, stop, plain])
    monkeypatch.undo()
    assert outs[1].finish_reason == "error" and "injected" in str(outs[1].error)
    assert outs[1].text == CharTokenizer().decode(outs[1].token_ids) and outs[1].token_ids == stock[1][:len(outs[1].token_ids)]
    assert [outs[0].token_ids, outs[2].token_ids] == [stock[0], stock[2]]
    _check_pool(engine)
    assert [o.token_ids for o in engine.generate(prompts, stop)] == stock


def test_a_request_of_several_samples_that_fails_before_forking_ends(monkeypatch, stock):
    """A request with n > 1 whose prompt step fails every time ends with an error for each of its n
    samples (its others were never forked): before, its group never counted as finished, so no final
    output came and `generate` (and drop-in generate of repeated prompts) waited forever."""
    engine = _engine({})
    injected = Injector(monkeypatch, dispatch, "paged_attention", "always")
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, n=3)
    outs = engine.generate(_prompts()[:2], params)  # returns: nothing hangs
    monkeypatch.undo()
    assert injected.raised >= 1
    for out in outs:
        assert out.finish_reason == "error" and "injected" in str(out.error)
        assert [o.finish_reason for o in out.outputs] == ["error"] * 3
    _check_pool(engine)
    again = engine.generate(_prompts(), SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
    assert [o.token_ids for o in again] == stock
