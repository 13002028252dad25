"""The drop-in `model.generate` paths on the default model (SmolLM2-135M-Instruct), stock beside
hf_paged in the same run, with ratios.

1. Engine reuse: 20 successive `generate` calls of 8 chat prompts that share a ~300-token system
   prompt (greedy, 16 new tokens). Stock sdpa + DynamicCache; hf_paged with its one engine per model
   (first call and the median later call, prefix-cache hits per call); hf_paged with a new engine
   per call (`hf_paged.release(model)` before each call: what every call cost before).
2. A `TextIteratorStreamer` consumed in a thread, batch 1 (64 new tokens).
3. `stop_strings` on a batch of 8 (stock's criteria called step by step on the engine's rows).

Every hf_paged output is checked token for token against stock's.

    python benchmarks/dropin.py [--calls 20] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from transformers import TextIteratorStreamer

import hf_paged
from hf_paged.defaults.models import load_default
from hf_paged.defaults.prompts import CHAT_PROMPTS, PASSAGE

SYSTEM = "You are a careful assistant. Use the notes below when they help.\n\n" + PASSAGE[:1100]


def _batch(tokenizer, call: int):
    prompts = CHAT_PROMPTS[call % 3:] + CHAT_PROMPTS[: call % 3]
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}],
                                           tokenize=False, add_generation_prompt=True) for p in prompts]
    return tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def reuse(model, tokenizer, calls: int) -> None:
    gen = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    batches = [_batch(tokenizer, c) for c in range(calls)]
    system_tokens = len(tokenizer(tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                                                tokenize=False))["input_ids"])
    print(f"== {calls} generate calls of 8 prompts sharing a {system_tokens}-token system prompt, 16 new tokens ==")
    model.set_attn_implementation("sdpa")
    stock, stock_times = [], []
    for b in batches:
        out, t = _timed(lambda: model.generate(**b, **gen))
        stock.append(out)
        stock_times.append(t)
    model.set_attn_implementation("hf_paged")
    hf_paged.release(model)
    kept_times, hits, same = [], [], True
    for b, ref in zip(batches, stock):
        out, t = _timed(lambda: model.generate(**b, **gen))
        kept_times.append(t)
        hits.append(model.hf_paged_last_metrics["vllm:prefix_cache_hits"])
        same &= torch.equal(out, ref)
    fresh_times = []
    for b, ref in zip(batches, stock):
        hf_paged.release(model)
        out, t = _timed(lambda: model.generate(**b, **gen))
        fresh_times.append(t)
        same &= torch.equal(out, ref)
    hf_paged.release(model)
    model.set_attn_implementation("sdpa")
    total = sum(stock_times)
    print(f"{'':34}{'total s':>9}{'first s':>9}{'later median s':>16}{'total vs stock':>16}")
    for label, times in (("stock sdpa + DynamicCache", stock_times), ("hf_paged, one engine per model", kept_times),
                         ("hf_paged, a new engine per call", fresh_times)):
        print(f"{label:34}{sum(times):>9.2f}{times[0]:>9.2f}{statistics.median(times[1:]):>16.3f}"
              f"{sum(times) / total:>15.3f}x")
    print(f"prefix-cache hits per call (one engine): first {hits[0]}, later median {statistics.median(hits[1:])}; "
          f"identical to stock: {same}")


def streamer(model, tokenizer) -> None:
    chat = [{"role": "user", "content": CHAT_PROMPTS[6]}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)

    def run():
        s = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        worker = threading.Thread(target=model.generate, kwargs=dict(**inputs, max_new_tokens=64, min_new_tokens=64,
                                                                     do_sample=False, streamer=s))
        worker.start()
        text = "".join(s)
        worker.join()
        return text

    model.set_attn_implementation("sdpa")
    ref, t_stock = _timed(run)
    model.set_attn_implementation("hf_paged")
    run()  # the engine is built once per model: time the call a chat UI makes every turn
    out, t_ours = _timed(run)
    model.set_attn_implementation("sdpa")
    print(f"\n== TextIteratorStreamer, batch 1, 64 new tokens ==\nstock {t_stock:.2f} s, hf_paged {t_ours:.2f} s "
          f"({t_ours / t_stock:.3f}x); same text: {out == ref}")


def stop_strings(model, tokenizer) -> None:
    inputs = _batch(tokenizer, 0)
    gen = dict(max_new_tokens=48, do_sample=False, stop_strings=["\n", "."], tokenizer=tokenizer)
    model.set_attn_implementation("sdpa")
    ref, t_stock = _timed(lambda: model.generate(**inputs, **gen))
    model.set_attn_implementation("hf_paged")
    model.generate(**inputs, **gen)
    out, t_ours = _timed(lambda: model.generate(**inputs, **gen))
    model.set_attn_implementation("sdpa")
    print(f"\n== stop_strings ['\\n', '.'], batch 8, up to 48 new tokens ==\nstock {t_stock:.2f} s, hf_paged "
          f"{t_ours:.2f} s ({t_ours / t_stock:.3f}x); identical: {torch.equal(out, ref)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_default()
    reuse(model, tokenizer, args.calls)
    streamer(model, tokenizer)
    stop_strings(model, tokenizer)


if __name__ == "__main__":
    main()
