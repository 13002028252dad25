"""Prefill/decode interference: colocated (one `Engine`) against disaggregated (`DisaggregatedEngine`,
1 prefill + 1 decode worker), at the same total torch threads, in one run; then a roofline model of
the same split on the sizing tool's GPU presets.

Workload: `--decodes` short chat prompts decoding `--new-tokens` tokens each (EOS ignored) start
together; while they run, `--long` prompts of about `--long-tokens` tokens arrive every
`--interval` seconds, each wanting `--long-new` tokens. Measured: the inter-token latency of the
decodes (p50, p99, max) and the long prompts' time to first token (from their arrival).

On a colocated engine a long prompt's prefill chunks (up to `--chunk` tokens per step) share steps
with the decodes, so those steps take as long as the chunk; disaggregated, the decodes run on their
own worker and only the K/V transfer touches them. On 2 CPU cores each worker has one thread
(colocated: one engine with both): compute is the bottleneck everywhere, which is the case where
interference is worst, and the disaggregated prefill has half the threads.

    python benchmarks/disagg.py [--decodes 6] [--new-tokens 96] [--long 4] [--long-tokens 1200]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import threading
import time

import torch

from hf_paged import Engine, SamplingParams
from hf_paged.defaults.models import load_default, load_default_tokenizer
from hf_paged.defaults.prompts import CHAT_PROMPTS, mixed_length_prompts
from hf_paged.planner.sizing import GPU_PRESETS, ModelShape, decode_point, kv_bytes_per_token, load_config
from hf_paged.disagg import DisaggregatedEngine


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _workload(tokenizer, args):
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}],
                                           add_generation_prompt=True, tokenize=True) for i in range(args.decodes)]
    chats = [c["input_ids"] if hasattr(c, "keys") else c for c in chats]
    longs = mixed_length_prompts(tokenizer, args.long, args.long_tokens, args.long_tokens + 50, seed=7)
    return chats, longs


def _measure(stream_fn, chats, longs, args) -> dict:
    """Run the decodes and the arriving long prompts through `stream_fn(prompts, params)` (an iterator
    of StreamEvents); returns the decodes' inter-token gaps and the long prompts' TTFTs."""
    decode_params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    long_params = SamplingParams(max_new_tokens=args.long_new, ignore_eos=True)
    gaps: list[float] = []
    ttfts: list[float] = []
    tokens = {"decode": 0}

    def decodes():
        last: dict[int, float] = {}
        for event in stream_fn(chats, decode_params):
            now = time.perf_counter()
            if event.token_id is None:
                continue
            if event.index in last:
                gaps.append(now - last[event.index])
            last[event.index] = now
            tokens["decode"] += 1

    def one_long(prompt):
        arrived = time.perf_counter()
        for event in stream_fn([prompt], long_params):
            if event.token_id is not None:
                ttfts.append(time.perf_counter() - arrived)
                break

    began = time.perf_counter()
    runner = threading.Thread(target=decodes)
    runner.start()
    arrivals = []
    for prompt in longs:
        time.sleep(args.interval)
        t = threading.Thread(target=lambda p=prompt: [None for _ in [one_long(p)]])
        t.start()
        arrivals.append(t)
    runner.join()
    for t in arrivals:
        t.join()
    return {"gaps": gaps, "ttfts": ttfts, "seconds": time.perf_counter() - began, "tokens": tokens["decode"]}


def _colocated(chats, longs, args, threads: int) -> dict:
    torch.set_num_threads(threads)
    model, tokenizer = load_default(attn_implementation="hf_paged")
    engine = Engine(model, tokenizer, block_size=16, max_num_batched_tokens=args.chunk, show_progress=False)
    engine.generate([chats[0]], SamplingParams(max_new_tokens=2))  # warm-up
    engine.reset_prefix_cache()
    engine.start()  # its loop serves every thread's `stream` call
    try:
        return _measure(engine.stream, chats, longs, args)
    finally:
        engine.stop(drain=False)


def _disaggregated(chats, longs, args, threads: int) -> dict:
    factory = functools.partial(load_default, attn_implementation="hf_paged")
    kwargs = {"max_num_batched_tokens": args.chunk}
    with DisaggregatedEngine(factory, num_prefill=1, num_decode=1, num_threads=max(1, threads // 2),
                             engine_kwargs=kwargs) as engine:
        engine.generate([chats[0]], SamplingParams(max_new_tokens=2))  # warm-up
        result = _measure(engine.stream, chats, longs, args)
        m = engine.metrics()
        result["kv_bytes"] = m["kv_bytes_transferred"]
        result["kv_seconds"] = m["kv_transfer_seconds"]
        return result


def _report(name: str, r: dict) -> None:
    g, t = r["gaps"], r["ttfts"]
    print(f"{name:16}{_pct(g, .5) * 1e3:>10.1f}{_pct(g, .99) * 1e3:>10.1f}{max(g) * 1e3:>10.1f}"
          f"{statistics.median(t):>12.2f}{max(t):>10.2f}{r['tokens'] / r['seconds']:>14.1f}")


def _gpu_model(args) -> None:
    """What the split gives on GPUs, from the roofline (not measured): a colocated step that carries a
    prefill chunk lasts about the chunk's compute time plus the decode's; disaggregated, decode steps
    carry no chunk, and the prompt pays its K/V transfer once."""
    print("\n== roofline model, not a measurement: llama-3-8b in bf16, 32 decoding sequences at 2,048 tokens "
          f"of context, prompts of 4,096 tokens in chunks of {args.chunk}, K/V over a 50 GB/s link ==")
    shape = ModelShape.from_config(load_config("llama-3-8b"))
    print(f"{'GPU':16}{'decode ms':>11}{'chunk ms':>10}{'ITL p99 colocated':>19}{'ITL disagg':>12}"
          f"{'TTFT colocated':>16}{'TTFT disagg':>13}")
    for key, gpu in GPU_PRESETS.items():
        decode = decode_point(shape, gpu, 32, 2048).step_time_s
        chunk = 2 * shape.num_active_params * args.chunk / (gpu.tflops * 1e12)
        chunks = -(-4096 // args.chunk)
        prefill = chunks * chunk
        transfer = 4096 * kv_bytes_per_token(shape) / 50e9
        print(f"{gpu.name:16}{decode * 1e3:>11.2f}{chunk * 1e3:>10.2f}{(decode + chunk) * 1e3:>17.2f}ms"
              f"{decode * 1e3:>10.2f}ms{(prefill + chunks * decode) * 1e3:>14.1f}ms{(prefill + transfer) * 1e3:>11.1f}ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=1200)
    parser.add_argument("--long-new", type=int, default=4)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens of every engine")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="total torch threads")
    args = parser.parse_args()
    chats, longs = _workload(load_default_tokenizer(), args)
    print(f"== SmolLM2-135M-Instruct, CPU, {args.threads} threads in all: {args.decodes} decodes x {args.new_tokens} "
          f"tokens; {args.long} prompts of ~{args.long_tokens} tokens arriving every {args.interval} s; chunk "
          f"{args.chunk} ==")
    colocated = _colocated(chats, longs, args, args.threads)
    disagg = _disaggregated(chats, longs, args, args.threads)
    print(f"{'':16}{'ITL p50':>10}{'ITL p99':>10}{'ITL max':>10}{'TTFT med s':>12}{'TTFT max':>10}{'decode tok/s':>14}")
    _report("colocated", colocated)
    _report("disaggregated", disagg)
    print(f"ratios disaggregated / colocated: ITL p50 {_pct(disagg['gaps'], .5) / _pct(colocated['gaps'], .5):.3f}x, "
          f"ITL p99 {_pct(disagg['gaps'], .99) / _pct(colocated['gaps'], .99):.3f}x, TTFT median "
          f"{statistics.median(disagg['ttfts']) / statistics.median(colocated['ttfts']):.3f}x; K/V moved "
          f"{disagg['kv_bytes'] / 1e6:.1f} MB in {disagg['kv_seconds']:.3f} s")
    _gpu_model(args)


if __name__ == "__main__":
    main()
