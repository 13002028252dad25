"""Structured outputs' resource limits (`config.DEFAULT_GRAMMAR_*`), measured on the embedded SmolLM2-135M.

* cache: `--num-enums` distinct 10,000-value enums (random 12-letter strings: ~160 KB of schema, ~34 MiB
  compiled each) through one engine's grammars (a 1-token request each), default cache budget
  (512 MiB): the process RSS before, at most and after (and after glibc's `malloc_trim`), the bytes
  the cache holds, and what the grammars would take kept whole (the old cache kept 512 of any size).
* compile: through `AsyncEngine` (its grammars built by a first structured request), a regex that
  compiles for ~16 s (3.7 KB: 319 alternatives of bounded repeats), then 0.5 s later a plain request:
  the plain one's latency beside it (and alone); when and how the slow one fails (the default limit is
  10 s); the same regex sent again.
* masks: an ambiguous EBNF (`s ::= [a-z] | [a-z] s | s [a-z]`, whose mask fills grow with the output)
  batched with a plain request: the plain one's inter-token latency alone, beside a request without a
  grammar, beside it with the default budget (20 ms per step), and beside it with no budget (what
  every request batched with it paid before).

    python benchmarks/grammar_limits.py [--num-enums 50] [--mask-tokens 40] [--skip cache compile masks]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import random
import statistics
import string
import time

from hf_paged import AsyncEngine, Engine, SamplingParams, StructuredOutputs
from hf_paged.config import (DEFAULT_GRAMMAR_CACHE_BYTES, DEFAULT_GRAMMAR_COMPILE_TIMEOUT_SECONDS,
                             DEFAULT_GRAMMAR_MASK_BUDGET_SECONDS)

MIB = 1 << 20
SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 320)) + ")"
AMBIGUOUS = 'root ::= s*\ns ::= [a-z] | [a-z] s | s [a-z]'


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def malloc_trim() -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def enum_schema(seed: int, n: int = 10_000) -> dict:
    rng = random.Random(seed)
    return {"enum": ["".join(rng.choices(string.ascii_lowercase, k=12)) for _ in range(n)]}


def cache_phase(model, tokenizer, num_enums: int) -> None:
    engine = Engine(model, tokenizer, max_num_seqs=4)
    prompt = tokenizer.encode("Pick one:")
    engine.generate([prompt], SamplingParams(max_new_tokens=1, structured=StructuredOutputs(choice=["a", "b"])))
    before, peak, compiled = rss_mib(), 0.0, []
    began = time.perf_counter()
    for i in range(num_enums):
        engine.generate([prompt], SamplingParams(max_new_tokens=1, structured=StructuredOutputs(json=enum_schema(i))))
        peak = max(peak, rss_mib())
        # The newest entry of the cache (a private look: the size of what was just compiled).
        compiled.append(next(reversed(engine.intake.grammars._cache.values()))[1])
    took = time.perf_counter() - began
    grammars = engine.intake.grammars
    after = rss_mib()
    malloc_trim()
    trimmed = rss_mib()
    print(f"[cache] {num_enums} distinct 10,000-value enums in {took:.0f} s, cache budget "
          f"{DEFAULT_GRAMMAR_CACHE_BYTES / MIB:.0f} MiB; one compiled enum {statistics.mean(compiled) / MIB:.1f} MiB as counted (MEMORY_OVERHEAD x its reported size), "
          f"all {num_enums} kept whole (the old 512-entry cache) {sum(compiled) / MIB:.0f} MiB")
    print(f"[cache]   kept: {len(grammars._cache)} grammars (the enums and one choice), "
          f"{grammars.cached_bytes / MIB:.1f} MiB")
    print(f"[cache]   RSS before {before:.0f} MiB, at most {peak:.0f} MiB (+{peak - before:.0f}), "
          f"after {after:.0f} MiB "
          f"(+{after - before:.0f}), after malloc_trim {trimmed:.0f} MiB (+{trimmed - before:.0f})")
    engine.shutdown()


async def _timed(coroutine):
    began = time.perf_counter()
    try:
        return await coroutine, time.perf_counter() - began
    except Exception as exc:  # noqa: BLE001 - reported
        return exc, time.perf_counter() - began


def compile_phase(model, tokenizer) -> None:
    engine = Engine(model, tokenizer, max_num_seqs=4)
    prompt = tokenizer.encode("Hello, how are you?")
    plain = SamplingParams(max_new_tokens=8, min_new_tokens=8)
    slow = SamplingParams(max_new_tokens=4, structured=StructuredOutputs(regex=SLOW_REGEX))

    async def main():
        front = AsyncEngine(engine)
        await front.generate(prompt, plain)  # warm up, and build the engine's grammars (once per engine)
        await front.generate(prompt, SamplingParams(max_new_tokens=1, structured=StructuredOutputs(choice=["a"])))
        _, alone = await _timed(front.generate(prompt, plain))
        slow_task = asyncio.ensure_future(_timed(front.generate(prompt, slow)))
        await asyncio.sleep(0.5)
        _, beside = await _timed(front.generate(prompt, plain))
        error, failed_after = await slow_task
        again, refused_after = await _timed(front.generate(prompt, slow))
        await front.shutdown()
        return alone, beside, error, failed_after, again, refused_after

    alone, beside, error, failed_after, again, refused_after = asyncio.run(main())
    print(f"[compile] plain request (8 tokens) alone: {alone:.2f} s; sent 0.5 s after a slow regex "
          f"({len(SLOW_REGEX)} chars): {beside:.2f} s")
    print(f"[compile]   the slow one failed after {failed_after:.1f} s "
          f"(limit {DEFAULT_GRAMMAR_COMPILE_TIMEOUT_SECONDS:g} s): "
          f"{type(error).__name__}: {error}")
    print(f"[compile]   sent again: {type(again).__name__} after {refused_after * 1e3:.1f} ms: {again}")
    grammars = engine.intake.grammars
    began = time.perf_counter()
    while grammars.num_compiling:  # its compile runs on in the background: wait, not to skew what follows
        time.sleep(0.2)
    print(f"[compile]   its compile ended in the background {time.perf_counter() - began + failed_after:.1f} s "
          "after it was sent (not kept)")


def _itl(out) -> tuple[float, float, float]:
    itl = out.metrics.inter_token_latencies
    return statistics.median(itl) * 1e3, statistics.mean(itl) * 1e3, max(itl) * 1e3


def mask_phase(model, tokenizer, num_tokens: int) -> None:
    """The plain request alone, then beside the ambiguous one with the default budget, then with none."""
    amb_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a very long word."}],
                                               tokenize=False, add_generation_prompt=True)
    plain_prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                                 tokenize=False, add_generation_prompt=True)
    plain = SamplingParams(max_new_tokens=num_tokens, min_new_tokens=num_tokens)
    amb = SamplingParams(max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                         structured=StructuredOutputs(grammar=AMBIGUOUS))
    print(f"[masks] a plain request's inter-token latency, {num_tokens} tokens (median / mean / max ms):")
    for budget in (DEFAULT_GRAMMAR_MASK_BUDGET_SECONDS, None):
        engine = Engine(model, tokenizer, max_num_seqs=4, grammar_mask_budget_seconds=budget)
        engine.generate([plain_prompt], plain)  # warm up
        if budget is not None:
            (alone,) = engine.generate([plain_prompt], plain)
            print("[masks]   alone                                            %.1f / %.1f / %.1f" % _itl(alone))
            _, pair = engine.generate([amb_prompt, plain_prompt], plain)
            print("[masks]   beside a request without a grammar               %.1f / %.1f / %.1f" % _itl(pair))
        began = time.perf_counter()
        slow, beside = engine.generate([amb_prompt, plain_prompt], [amb, plain])
        took = time.perf_counter() - began
        name = f"budget {budget * 1e3:g} ms" if budget is not None else "no budget (before)"
        print(f"[masks]   beside the ambiguous grammar, {name:18s} %.1f / %.1f / %.1f" % _itl(beside)
              + f"  ({took:.1f} s for the batch)")
        error = slow.outputs[0].error
        print(f"[masks]     the ambiguous request: {slow.finish_reason!r} after {len(slow.outputs[0].token_ids)} "
              f"tokens ({len(slow.outputs[0].text)} letters)" + (f": {error}" if error is not None else ""))
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-enums", type=int, default=50)
    parser.add_argument("--mask-tokens", type=int, default=40,
                        help="tokens per request in the masks phase (the ambiguous grammar's fills grow with them: "
                             "without a budget, its last steps take about a second)")
    parser.add_argument("--skip", nargs="*", default=(), choices=("cache", "compile", "masks"))
    args = parser.parse_args()
    from hf_paged.defaults.models import load_default

    model, tokenizer = load_default()
    if "cache" not in args.skip:
        cache_phase(model, tokenizer, args.num_enums)
    if "compile" not in args.skip:
        compile_phase(model, tokenizer)
    if "masks" not in args.skip:
        mask_phase(model, tokenizer, args.mask_tokens)


if __name__ == "__main__":
    main()
