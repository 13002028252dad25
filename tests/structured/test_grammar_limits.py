"""A caller's grammar cannot take the engine's resources: compiled grammars are kept up to a byte budget
(least recently used evicted first); a compile runs off the intake thread, within a time limit, and a
constraint that ran past it is refused at once next time; a request whose token masks take longer than
the per-step budget ends with an error naming it, while the requests batched with it go on."""

from __future__ import annotations

import asyncio
import random
import string
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_paged import AsyncEngine, Engine, SamplingParams, StructuredOutputs

xgr = pytest.importorskip("xgrammar")

from hf_paged.structured import grammar as grammar_module  # noqa: E402  (needs xgrammar)
from hf_paged.structured.grammar import MEMORY_OVERHEAD, GrammarMasks, Grammars  # noqa: E402

VOCAB = 49152  # SmolLM2's tokenizer, and the tiny model's logits width
EOS = 2  # "<|im_end|>"
# Highly ambiguous: every split of a run of letters is a parse, so the Earley state a mask is filled
# from grows with the output; after 20 letters a fill takes ~10 ms, after 60 over 100 ms (a plain JSON
# schema's: a few µs).
AMBIGUOUS = 'root ::= s*\ns ::= [a-z] | [a-z] s | s [a-z]'
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    from hf_paged.defaults.models import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="module")
def model():
    """A tiny random Llama over SmolLM2's vocabulary (the grammars need its tokenizer)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config).eval()


def _choice(seed: int, n: int = 20) -> StructuredOutputs:
    """n random 12-letter strings: ~3 KB compiled per string."""
    rng = random.Random(seed)
    return StructuredOutputs(choice=["".join(rng.choices(string.ascii_lowercase, k=12)) for _ in range(n)])


def _slow_compiles(monkeypatch, seconds: float, release: threading.Event | None = None) -> dict:
    """Grammars compile a regex starting with "slow" in `seconds` more (a sleep releases the GIL, as
    xgrammar's compile does), or, given `release`, once it is set (`seconds` at most); returns the
    counts of such compiles started, running now, and running at most."""
    real, lock, counts = Grammars._compile, threading.Lock(), {"started": 0, "running": 0, "peak": 0}

    def compile(self, spec):
        if spec.kind == "regex" and spec.regex.startswith("slow"):
            with lock:
                counts["started"] += 1
                counts["running"] += 1
                counts["peak"] = max(counts["peak"], counts["running"])
            try:
                if release is None:
                    time.sleep(seconds)
                else:
                    release.wait(seconds)
            finally:
                with lock:
                    counts["running"] -= 1
        return real(self, spec)

    monkeypatch.setattr(Grammars, "_compile", compile)
    return counts


# ---------------------------------------------------------------------------------------- the cache
def test_the_compiled_grammar_cache_is_bounded_by_bytes_least_recently_used_first(tokenizer):
    a, b, c = _choice(0), _choice(1), _choice(2)
    size = Grammars(tokenizer, VOCAB, [EOS]).compile(a).memory_size_bytes * MEMORY_OVERHEAD  # as counted
    budget = int(2.5 * size)  # two fit, three do not
    grammars = Grammars(tokenizer, VOCAB, [EOS], cache_bytes=budget)
    grammars.compile(a)
    grammars.compile(b)
    assert grammars.num_compiled == 2 and 0 < grammars.cached_bytes <= budget
    grammars.compile(a)  # a hit: b is now the least recently used
    assert grammars.num_compiled == 2
    grammars.compile(c)  # evicts b
    assert grammars.num_compiled == 3 and grammars.cached_bytes <= budget
    grammars.compile(a)
    assert grammars.num_compiled == 3  # kept
    grammars.compile(b)  # evicted: compiled again (evicting c)
    assert grammars.num_compiled == 4 and grammars.cached_bytes <= budget
    grammars.compile(a)
    assert grammars.num_compiled == 4
    # One grammar larger than the whole budget is used, but not kept (nor does it evict the others).
    kept = grammars.cached_bytes
    big = _choice(3, n=60)
    state = grammars.state(big)
    assert state.compiled.memory_size_bytes * MEMORY_OVERHEAD > budget and not state.is_terminated
    assert grammars.cached_bytes == kept and grammars.num_compiled == 5
    grammars.compile(big)
    grammars.compile(a)
    assert grammars.num_compiled == 6 and grammars.cached_bytes == kept


# ---------------------------------------------------------------------------------------- compiles
def test_a_compile_past_the_time_limit_is_refused_naming_it_then_refused_at_once(tokenizer, monkeypatch):
    counts = _slow_compiles(monkeypatch, 1.0)
    # At the usual low priority, a real compile on a machine busy with other work may take longer than
    # this test's 0.2 s limit.
    monkeypatch.setattr(grammar_module, "COMPILE_NICENESS", 0)
    grammars = Grammars(tokenizer, VOCAB, [EOS], compile_timeout_seconds=0.2)
    slow = StructuredOutputs(regex="slow[0-9]+")
    began = time.perf_counter()
    with pytest.raises(ValueError, match=r"regex did not compile within 0.2 s \(grammar_compile_timeout_seconds\)"):
        grammars.compile(slow)
    assert 0.15 < time.perf_counter() - began < 0.8
    grammars.compile(_choice(0))  # others compile meanwhile (the slow one holds one compile thread)
    assert counts["running"] == 1
    deadline = time.monotonic() + 20
    while grammars.num_compiling and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not grammars.num_compiling and counts["running"] == 0
    began = time.perf_counter()
    with pytest.raises(ValueError, match=r"\(grammar_compile_timeout_seconds\) when it was last tried; it is refused "
                                         "at once for 600 s after that"):
        grammars.compile(slow)
    assert time.perf_counter() - began < 0.05 and grammars.num_compiled == 1  # it was not kept


def test_a_constraint_too_slow_to_compile_is_tried_again_after_a_while(tokenizer, monkeypatch):
    """Compile threads run at low priority: one starved of the CPU by the engine is not refused for good."""
    _slow_compiles(monkeypatch, 0.4)
    monkeypatch.setattr(grammar_module, "REMEMBER_SLOW_SECONDS", 0.6)
    grammars = Grammars(tokenizer, VOCAB, [EOS], compile_timeout_seconds=0.2)
    slow = StructuredOutputs(regex="slow[0-9]+")
    with pytest.raises(ValueError, match="did not compile within 0.2 s"):
        grammars.compile(slow)
    time.sleep(0.3)  # its compile ended, too late
    with pytest.raises(ValueError, match="refused at once"):
        grammars.compile(slow)
    time.sleep(0.7)  # remembered when its compile ended: 0.6 s ago
    with pytest.raises(ValueError, match=r"did not compile within 0.2 s \(grammar_compile_timeout_seconds\)$"):
        grammars.compile(slow)  # compiled again


def test_background_compiles_are_bounded(tokenizer, monkeypatch):
    counts = _slow_compiles(monkeypatch, 0.6)
    grammars = Grammars(tokenizer, VOCAB, [EOS], compile_timeout_seconds=0.3)
    errors = []

    def wait(i):
        try:
            grammars.compile(StructuredOutputs(regex=f"slow{i}"))
        except ValueError as exc:
            errors.append(str(exc))

    waiters = [threading.Thread(target=wait, args=(i,)) for i in range(grammar_module.MAX_PENDING_COMPILES)]
    for waiter in waiters:
        waiter.start()
    deadline = time.monotonic() + 0.25  # before the waiters give up
    while grammars.num_compiling < grammar_module.MAX_PENDING_COMPILES and time.monotonic() < deadline:
        time.sleep(0.005)
    began = time.perf_counter()
    with pytest.raises(ValueError, match="grammars are compiling or waiting to"):  # the queue is full
        grammars.compile(StructuredOutputs(regex="slow-one-more"))
    assert time.perf_counter() - began < 0.05
    for waiter in waiters:
        waiter.join()
    assert len(errors) == grammar_module.MAX_PENDING_COMPILES
    assert sum("busy with other grammars" in e for e in errors) == len(errors) - grammar_module.MAX_CONCURRENT_COMPILES
    # The queued compiles nobody waits for any more are dropped; the running ones run on...
    assert grammars.num_compiling == grammar_module.MAX_CONCURRENT_COMPILES
    deadline = time.monotonic() + 5
    while grammars.num_compiling and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not grammars.num_compiling and grammars.num_compiled == 0  # too slow: not kept
    # ... and never start: only the first ones ran, no more at once than the compile threads.
    assert counts["started"] == counts["peak"] == grammar_module.MAX_CONCURRENT_COMPILES


def test_a_request_waiting_for_its_grammar_never_delays_a_plain_one(model, tokenizer, monkeypatch):
    # The slow compile holds until the plain request is answered (or 60 s pass): a plain request that
    # waited for it would be answered only after 60 s, with the compile done, whatever the machine's load.
    release = threading.Event()
    counts = _slow_compiles(monkeypatch, 60.0, release)
    prompt = tokenizer.encode("Hello there")

    async def main():
        engine = AsyncEngine(Engine(model, tokenizer, max_num_seqs=4))
        try:
            slow = asyncio.ensure_future(engine.generate(prompt, SamplingParams(
                max_new_tokens=8, structured=StructuredOutputs(regex="slow[0-9]"))))
            while not counts["running"]:  # its compile is running
                await asyncio.sleep(0.01)
            began = time.perf_counter()
            plain = await engine.generate(prompt, SamplingParams(max_new_tokens=4))
            plain_seconds = time.perf_counter() - began
            answered_while_compiling = counts["running"] == 1 and not slow.done()
            release.set()
            return plain, plain_seconds, answered_while_compiling, await slow
        finally:
            release.set()
            await engine.shutdown()

    plain, plain_seconds, answered_while_compiling, slow = asyncio.run(main())
    assert answered_while_compiling, plain_seconds
    assert plain.finish_reason == "length" and plain_seconds < 30.0, plain_seconds  # ~0.3 s when quiet
    assert slow.outputs[0].text.startswith("slow") and slow.finish_reason == "stop"


def test_the_compile_time_limit_holds_on_the_async_and_the_blocking_paths(model, tokenizer, monkeypatch):
    _slow_compiles(monkeypatch, 1.5)
    engine = Engine(model, tokenizer, max_num_seqs=4, grammar_compile_timeout_seconds=0.3)
    prompt = tokenizer.encode("Hello there")
    slow = SamplingParams(max_new_tokens=4, structured=StructuredOutputs(regex="slow[0-9]"))

    async def main():
        front = AsyncEngine(engine)
        try:
            began = time.perf_counter()
            with pytest.raises(ValueError, match=r"did not compile within 0.3 s \(grammar_compile_timeout_seconds\)"):
                await front.add_request(prompt, slow)
            return time.perf_counter() - began
        finally:
            await front.shutdown()

    assert asyncio.run(main()) < 1.0
    fresh = Engine(model, tokenizer, max_num_seqs=4, grammar_compile_timeout_seconds=0.3)
    began = time.perf_counter()
    with pytest.raises(ValueError, match="grammar_compile_timeout_seconds"):
        fresh.add_request(prompt, SamplingParams(max_new_tokens=4, structured=StructuredOutputs(regex="slow[1-2]")))
    assert time.perf_counter() - began < 1.0
    assert not fresh.has_unfinished_requests()


# ---------------------------------------------------------------------------------------- masks
def test_a_row_whose_mask_is_over_the_budget_is_ended_on_its_third_slow_step_and_the_others_are_masked(tokenizer):
    grammars = Grammars(tokenizer, VOCAB, [EOS], mask_budget_seconds=0.002)
    slow = grammars.state(StructuredOutputs(grammar=AMBIGUOUS))
    assert slow.accept(tokenizer.encode("abcdefghij" * 3))  # a fill now takes ~20 ms
    quick = grammars.state(StructuredOutputs(json=PERSON))
    assert quick.accept(tokenizer.encode('{"name": "A'))
    masks = GrammarMasks()
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    reference = xgr.allocate_token_bitmask(3, VOCAB)
    quick.matcher.fill_next_token_bitmask(reference, 0)
    for step in range(3):
        out = logits.clone()
        masks.apply(out, [(0, quick, ()), (2, slow, ())])
        assert (slow.error is None) == (step < 2), step  # a grace of two slow steps (caches warm up)
        assert quick.error is None
        ref = logits.clone()
        xgr.apply_token_bitmask_inplace(ref, reference, indices=[0], backend="cpu")
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], logits[1])
    assert "grammar_mask_budget_seconds" in slow.error and "over the 2 ms budget per step" in slow.error


def test_a_request_whose_masks_are_too_slow_ends_with_an_error_and_its_neighbours_go_on(model, tokenizer):
    engine = Engine(model, tokenizer, max_num_seqs=4, grammar_mask_budget_seconds=0.003)
    prompts = [tokenizer.encode(t) for t in ("Spell a word:", "Hello there", "Who is Ann?")]
    neighbours = [SamplingParams(max_new_tokens=8, min_new_tokens=8),
                  SamplingParams(max_new_tokens=8, structured=StructuredOutputs(json=PERSON))]
    alone = engine.generate(prompts[1:], neighbours)
    slow = SamplingParams(max_new_tokens=40, min_new_tokens=40, structured=StructuredOutputs(grammar=AMBIGUOUS))
    outs = engine.generate(prompts, [slow] + neighbours)
    error = outs[0].outputs[0].error
    assert outs[0].finish_reason == "error" and isinstance(error, ValueError), outs[0]
    assert "over the 3 ms budget per step (grammar_mask_budget_seconds)" in str(error)
    assert len(outs[0].outputs[0].token_ids) < 8  # ~5: the neighbours run on after it ended
    for out, ref in zip(outs[1:], alone):  # the step committed for them, as if the slow one were not there
        assert out.finish_reason == ref.finish_reason and out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert engine.intake.grammars.mask_budget_seconds == 0.003
    assert not engine.has_unfinished_requests() and engine.num_used_kv_blocks == 0
