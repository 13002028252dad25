"""Structured outputs on the embedded SmolLM2-135M: 64 requests, each held to one of 4 JSON schemas.

Three methods on the same 64 prompts, greedy, `--new-tokens` at most, alternated `--repeats` times
(medians of output tokens/s, generation only):

  * engine-structured: one `Engine.generate` over all 64 with `SamplingParams(structured=json schema)`
    (continuous batching, one batched grammar mask pass per step);
  * engine-free: the same call without the constraint, each request generating exactly as many tokens
    as its structured run did (`ignore_eos`, `max_new_tokens` = that count): the same requests and the
    same work unconstrained, so the ratio is the constraint's cost alone (left free, the requests run
    to `--new-tokens` and the batch stays full longer, which says nothing about the constraint);
  * stock-processor: stock `model.generate` (sdpa, `DynamicCache`) with the same constraint as a
    `GrammarLogitsProcessor` (one schema per row), in static batches of 8, left-padded.

Every structured output (engine and stock) must parse and validate against its schema (jsonschema_rs).
Also printed: each schema's compile time (a fresh compiler, so the first compile), and the per-step
mask cost at 64 rows (fill + apply over the 49,152-token vocabulary, median of 50).

    python benchmarks/structured.py [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24}}, "required": ["name", "age", "city"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "sunny": {"type": "boolean"}, "temp_c": {"type": "integer"}},
        "required": ["city", "sunny", "temp_c"], "additionalProperties": False},
    "product": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 32}, "price": {"type": "number", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["title", "price", "tags"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 32}, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "kind": {"type": "string", "enum": ["concert", "match", "talk", "fair"]}},
        "required": ["name", "date", "kind"], "additionalProperties": False},
}
ASKS = {
    "person": "Extract the person from this text as JSON: {}",
    "weather": "Extract the weather report from this text as JSON: {}",
    "product": "Extract the product from this text as JSON: {}",
    "event": "Extract the event from this text as JSON: {}",
}
TEXTS = {
    "person": ["Maria Lopez, 34, moved to Madrid last year.", "Our new neighbour Tom is 71 and lives in Leeds.",
               "Aiko (age 19) studies in Osaka.", "Dr. Ben Okafor, forty-two, works in Lagos."],
    "weather": ["Sunny skies in Lisbon today, around 24 degrees.", "It is raining in Bergen at 9 C.",
                "Cairo: clear and hot, 38 degrees Celsius.", "Grey and cold in Warsaw, minus 3."],
    "product": ["The Acme kettle costs 29.99 and comes in red.", "Buy the trail shoes for 89, waterproof and light.",
                "A USB-C cable, two metres, only 7.50.", "The oak desk is 240 euros, solid wood."],
    "event": ["The jazz concert is on 2025-07-14 in the park.", "City play United on 2025-03-02.",
              "Dr. Kim talks about bees on 2024-11-20.", "The book fair opens 2026-05-09."],
}


def workload(tokenizer, n: int = 64):
    """(prompt text, schema name) for n requests, cycling through the schemas and their texts."""
    names = list(SCHEMAS)
    rows = []
    for i in range(n):
        name = names[i % 4]
        text = TEXTS[name][(i // 4) % 4] + ("" if i < 16 else f" (record {i})")
        chat = [{"role": "user", "content": ASKS[name].format(text)}]
        rows.append((tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), name))
    return rows


def check(texts, names) -> int:
    """How many outputs parse and validate against their schemas."""
    import jsonschema_rs

    ok = 0
    for text, name in zip(texts, names):
        try:
            jsonschema_rs.validate(SCHEMAS[name], json.loads(text))
            ok += 1
        except Exception:  # noqa: BLE001 - counted as a failure
            pass
    return ok


def run_engine(engine, rows, new_tokens: int, structured: bool, lengths: list[int] | None = None):
    """`lengths`: unconstrained, each request generates exactly this many tokens."""
    from hf_paged import SamplingParams, StructuredOutputs

    if structured:
        params = [SamplingParams(max_new_tokens=new_tokens, structured=StructuredOutputs(json=SCHEMAS[name]))
                  for _, name in rows]
    else:
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    began = time.perf_counter()
    outs = engine.generate([p for p, _ in rows], params)
    seconds = time.perf_counter() - began
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds, [o.outputs[0].text for o in outs], tokens, seconds, outs


def run_stock(model, tokenizer, rows, new_tokens: int, batch: int = 8):
    from hf_paged.structured import GrammarLogitsProcessor, StructuredOutputs

    texts, tokens, seconds = [], 0, 0.0
    for start in range(0, len(rows), batch):
        part = rows[start:start + batch]
        enc = tokenizer([p for p, _ in part], return_tensors="pt", padding=True, add_special_tokens=False)
        processor = GrammarLogitsProcessor(tokenizer, [StructuredOutputs(json=SCHEMAS[name]) for _, name in part])
        began = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, logits_processor=[processor])
        seconds += time.perf_counter() - began
        gen = out[:, enc["input_ids"].shape[1]:]
        for row in gen.tolist():
            row = row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row
            tokens += len(row)
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return tokens / seconds, texts, tokens, seconds


def compile_and_mask_costs(tokenizer):
    from hf_paged import StructuredOutputs
    from hf_paged.structured.grammar import Grammars, GrammarMasks

    for name, schema in SCHEMAS.items():
        grammars = Grammars(tokenizer, 49152, [tokenizer.eos_token_id])
        began = time.perf_counter()
        grammars.compile(StructuredOutputs(json=schema))
        first = time.perf_counter() - began
        began = time.perf_counter()
        grammars.compile(StructuredOutputs(json=schema))
        print(f"compile {name:8s}: first {first * 1e3:6.2f} ms, cached {(time.perf_counter() - began) * 1e3:.3f} ms")
    grammars = Grammars(tokenizer, 49152, [tokenizer.eos_token_id])
    states = []
    for i in range(64):  # rows spread over grammar positions: start, inside a key, inside a string value
        name = list(SCHEMAS)[i % 4]
        state = grammars.state(StructuredOutputs(json=SCHEMAS[name]))
        key = next(iter(SCHEMAS[name]["properties"]))
        prefix = tokenizer.encode(['', '{"', f'{{"{key}": "ab'][i % 3], add_special_tokens=False)
        assert state.accept(prefix)
        states.append(state)
    masks, logits = GrammarMasks(), torch.randn(64, 49152)
    rows = [(i, s, ()) for i, s in enumerate(states)]
    times = []
    for _ in range(55):
        x = logits.clone()
        began = time.perf_counter()
        masks.apply(x, rows)
        times.append(time.perf_counter() - began)
    print(f"mask pass at 64 rows x 49152 (fill + apply): median {statistics.median(times[5:]) * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from hf_paged import Engine
    from hf_paged.defaults.models import load_default

    torch.manual_seed(0)
    model, tokenizer = load_default()
    rows = workload(tokenizer)
    names = [name for _, name in rows]
    compile_and_mask_costs(tokenizer)
    engine = Engine(model, tokenizer=tokenizer, max_num_seqs=64)
    _, _, _, _, outs = run_engine(engine, rows, args.new_tokens, True)  # warm-up, and each request's length
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    results = {"engine-structured": [], "engine-free": [], "stock-processor": []}
    valid = {}
    for r in range(args.repeats):
        order = list(results) if r % 2 == 0 else list(reversed(results))
        for method in order:
            if method == "stock-processor":
                tps, texts, tokens, seconds = run_stock(model, tokenizer, rows, args.new_tokens)
            else:
                tps, texts, tokens, seconds, _ = run_engine(engine, rows, args.new_tokens,
                                                            method == "engine-structured", lengths)
            results[method].append(tps)
            if method != "engine-free":
                valid[method] = check(texts, names)
            print(f"repeat {r} {method:18s} {tokens:5d} tokens in {seconds:6.2f} s = {tps:7.1f} tok/s")
    med = {m: statistics.median(v) for m, v in results.items()}
    print()
    for m, v in med.items():
        print(f"{m:18s} median {v:7.1f} tok/s" + (f"   valid {valid[m]}/64" if m in valid else ""))
    print(f"engine-structured / engine-free     = {med['engine-structured'] / med['engine-free']:.2f}x (need >= 0.85)")
    print(f"engine-structured / stock-processor = {med['engine-structured'] / med['stock-processor']:.2f}x (need >= 3)")


if __name__ == "__main__":
    main()
