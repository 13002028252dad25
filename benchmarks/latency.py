"""Batch-1 latency: stock `generate` (sdpa + DynamicCache) against hf_paged's `generate`, in one run.

SmolLM2-135M-Instruct, greedy, batch 1. Cells: a short chat prompt and a 600-token prompt, each with
32, 256 and 1,024 new tokens (`min_new_tokens` = `max_new_tokens`, so both produce every token);
`--prompts 4096-token --new-tokens 256 --no-prefix-cache` is the long-context cell (issue 35: total
<= 0.9x stock; without `--no-prefix-cache` the repeats after the first find the prompt in hf_paged's
prefix cache, which stock has no counterpart of).
Runs are interleaved (stock, hf_paged, stock, hf_paged...) in this one process and each figure is a
median over `--repeats` runs. For each cell it prints:

  * time to first token (call start to the end of the first forward), the median inter-token
    latency (between consecutive forwards' ends; both sides are timed by the same forward hook) and
    the total wall time, with the hf_paged/stock ratio of each;
  * hf_paged's per-step breakdown from the engine's own timers: schedule, metadata (step inputs and
    `StepMetadata`), forward (the model call), sample and update (committing tokens), as ms per step
    and share of the step, and the share of a step spent outside the model's forward;
  * whether the greedy tokens are identical (asserted).

It also measures the machine's read bandwidth in the same run (median of `torch.sum` over a 1 GiB
fp32 tensor) and prints the physical floor of decoding (every weight read once per token: weight
bytes / bandwidth) beside the measured inter-token latencies. A batch-64 engine run prints the same
breakdown at 64 running sequences (time outside the model's forward), and `--kernels` times
`nn.Linear`'s stock kernel (MKL sgemm) against the one hf_paged's forwards use (`hf_paged.hf.linear`)
on the model's own weight shapes.

Acceptance (issue 13): total <= 0.95x stock in every cell, median ITL <= stock's, time outside the
forward <= 10% of a step at batch 1 and <= 3% at batch 64.

    python benchmarks/latency.py [--threads N] [--repeats 3] [--new-tokens 32,256,1024] [--kernels]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
import transformers

import hf_paged  # registers "hf_paged"
from hf_paged import Engine, SamplingParams
from hf_paged.defaults.models import load_default
from hf_paged.defaults.prompts import CHAT_PROMPTS, PASSAGE
from hf_paged.hf import linear as fast_linear

TARGET_TOTAL = 0.95  # hf_paged total / stock total, every cell
TARGET_OVERHEAD_BS1 = 0.10
TARGET_OVERHEAD_BS64 = 0.03
LONG_PROMPT_TOKENS = 600
LONGEST_PROMPT_TOKENS = 4096  # issue 35's cell: 4k prompt, 256 new tokens (--prompts 4096-token)
PARTS = ("schedule", "metadata", "forward", "sample", "update")


def read_bandwidth(repeats: int = 7) -> float:
    """Bytes/s that `torch.sum` streams from a 1 GiB fp32 tensor (median), on torch's threads."""
    data = torch.ones(1 << 28)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return data.numel() * 4 / statistics.median(times)


def distinct_bytes(tensors) -> int:
    """Bytes of the distinct tensors (a tied embedding counted once)."""
    unique = {t.data_ptr(): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def weight_bytes(model) -> int:
    """Bytes of the distinct parameters: what one decode step reads."""
    return distinct_bytes(model.parameters())


class ForwardClock:
    """Timestamps of the end of every forward of `model` (stock and engine forwards alike)."""

    def __init__(self, model):
        self.times: list[float] = []
        self.handle = model.register_forward_hook(lambda *args: self.times.append(time.perf_counter()))

    def close(self):
        self.handle.remove()


def run_once(model, ids, new_tokens: int, attn: str) -> dict:
    model.set_attn_implementation(attn)
    inputs = torch.tensor([ids])
    clock = ForwardClock(model)
    try:
        start = time.perf_counter()
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
        total = time.perf_counter() - start
    finally:
        clock.close()
    ticks = clock.times
    gaps = [b - a for a, b in zip(ticks[:-1], ticks[1:])]
    result = dict(total=total, ttft=ticks[0] - start, itl=statistics.median(gaps) if gaps else float("nan"),
                  tokens=out[0, len(ids):].tolist())
    if attn == "hf_paged":
        m = getattr(model, "hf_paged_last_metrics", None)
        if m is None or len(ticks) != m["num_steps"]:
            raise RuntimeError("hf_paged's generate did not run through the engine")
        result["profile"] = m
    return result


def breakdown(m: dict) -> dict:
    """Seconds per step of each part of an engine step (see `Engine.step_profile`)."""
    steps = max(m["num_steps"], 1)
    parts = dict(schedule=m["schedule_seconds"], metadata=m["metadata_seconds"], forward=m["model_seconds"],
                 sample=m["sampler_seconds"])
    parts["update"] = max(m["step_seconds"] - m["schedule_seconds"] - m["forward_seconds"] - m["sampler_seconds"], 0.0)
    return {k: v / steps for k, v in parts.items()}


def print_breakdown(label: str, per_step: dict) -> float:
    step = sum(per_step.values())
    cells = "  ".join(f"{k} {v * 1e3:.2f} ms ({v / step:.1%})" for k, v in per_step.items())
    outside = 1 - per_step["forward"] / step
    print(f"    {label}: step {step * 1e3:.2f} ms = {cells}; outside the forward {outside:.1%}")
    return outside


def prompts(tokenizer) -> dict[str, list[int]]:
    def chat(text):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_dict=False)

    def passage(num_tokens: int) -> list[int]:
        """A summarising request of exactly `num_tokens` tokens: the chat frame around the passage,
        repeated as needed and cut."""
        repeats = 4
        while len(long_ids := chat(f"Summarise this text.\n\n{PASSAGE * repeats}")) < num_tokens:
            repeats *= 2
        head = chat("Summarise this text.\n\n")[:-5]  # keep the chat frame, cut the passage
        tail = long_ids[-5:]
        return head + long_ids[len(head):len(head) + num_tokens - len(head) - len(tail)] + tail

    return {"chat": chat(CHAT_PROMPTS[0]), "600-token": passage(LONG_PROMPT_TOKENS),
            "4096-token": passage(LONGEST_PROMPT_TOKENS)}


def kernels(model, repeats: int) -> None:
    """Stock `F.linear` against hf_paged's linear kernel on every distinct linear shape of the model,
    cycling through all layers' real weights (cold in cache, as in decoding)."""
    if not fast_linear.is_available():
        print("\n== kernels: hf_paged's linear kernel is not available on this build")
        return
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weights = [m.weight for m in linears]
    nbytes = distinct_bytes(weights)
    print(f"\n== kernels: all {len(linears)} linears of the model ({nbytes / 1e6:.0f} MB of weights), medians of {repeats}")
    print(f"{'rows':>6}{'stock F.linear ms':>19}{'hf_paged ms':>13}{'ratio':>8}{'stock GB/s':>12}{'hf_paged GB/s':>15}")
    kernel = fast_linear.linear_kernel()
    with torch.inference_mode():
        for rows in (1, 6, 64, 256):
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            res = []
            for fn in (lambda x, w: F.linear(x, w), lambda x, w: kernel(x, w)):
                def sweep():
                    for w in weights:
                        fn(xs[w.shape[1]], w)
                sweep()
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    sweep()
                    times.append(time.perf_counter() - start)
                res.append(statistics.median(times))
            print(f"{rows:6d}{res[0] * 1e3:19.1f}{res[1] * 1e3:13.1f}{res[1] / res[0]:8.2f}"
                  f"{nbytes / res[0] / 1e9:12.1f}{nbytes / res[1] / 1e9:15.1f}")


def batch64(model, tokenizer, new_tokens: int) -> float:
    texts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] + " " * (i // len(CHAT_PROMPTS)) for i in range(64)]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         return_dict=False) for t in texts]
    engine = Engine(model, tokenizer, max_num_seqs=64, show_progress=False)
    engine.generate(ids[:2], SamplingParams(max_new_tokens=2))
    engine.reset_metrics()
    engine.generate(ids, SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens))
    m = engine.metrics()
    print(f"\n== batch 64: 64 chat requests x {new_tokens} new tokens through one Engine, {m['num_steps']} steps")
    return print_breakdown("hf_paged", breakdown(m))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", default="32,256,1024")
    parser.add_argument("--prompts", default="chat,600-token")
    parser.add_argument("--batch64-new-tokens", type=int, default=64, help="0 skips the batch-64 run")
    parser.add_argument("--kernels", action="store_true", help="also time the linear kernels")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="hf_paged's engine without prefix caching: every repeat prefills the whole prompt, "
                             "as stock does (otherwise repeats after the first reuse the cached prompt)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_default(dtype=torch.float32, attn_implementation="hf_paged")
    model.eval()
    bandwidth = read_bandwidth()
    wbytes = weight_bytes(model)
    floor = wbytes / bandwidth
    print(f"env: torch={torch.__version__} transformers={transformers.__version__} python={platform.python_version()} "
          f"threads={torch.get_num_threads()} cpus={os.cpu_count()} fast_linear={fast_linear.is_available()} "
          f"repeats={args.repeats}")
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; weights {wbytes / 1e6:.0f} MB; decode floor "
          f"{floor * 1e3:.1f} ms/token (every weight read once per token)")
    if args.kernels:
        kernels(model, args.repeats)
    if args.no_prefix_cache:
        model.hf_paged_cache_config = hf_paged.PagedCacheConfig(enable_prefix_caching=False)
    cells = [(p, int(n)) for p in args.prompts.split(",") for n in args.new_tokens.split(",")]
    all_ids = prompts(tokenizer)
    for attn in ("sdpa", "hf_paged"):  # warm-up both paths
        run_once(model, all_ids["chat"], 4, attn)
    verdicts, overheads = [], []
    for name, new_tokens in cells:
        ids = all_ids[name]
        runs = {"sdpa": [], "hf_paged": []}
        for _ in range(args.repeats):
            for attn in runs:
                runs[attn].append(run_once(model, ids, new_tokens, attn))
        med = {attn: {k: statistics.median(r[k] for r in rs) for k in ("total", "ttft", "itl")}
               for attn, rs in runs.items()}
        same = all(r["tokens"] == runs["sdpa"][0]["tokens"] for rs in runs.values() for r in rs)
        ratio = {k: med["hf_paged"][k] / med["sdpa"][k] for k in ("total", "ttft", "itl")}
        ok = ratio["total"] <= TARGET_TOTAL and ratio["itl"] <= 1.0
        verdicts.append(ok)
        print(f"\n== {name} prompt ({len(ids)} tokens), {new_tokens} new tokens, medians of {args.repeats}")
        print(f"{'':26}{'stock':>10}{'hf_paged':>10}{'ratio':>8}")
        for key, label in (("ttft", "time to first token (ms)"), ("itl", "inter-token latency (ms)"),
                           ("total", "total (s)")):
            scale = 1 if key == "total" else 1e3
            fmt = ".3f" if key == "total" else ".1f"
            print(f"{label:26}{med['sdpa'][key] * scale:10{fmt}}{med['hf_paged'][key] * scale:10{fmt}}"
                  f"{ratio[key]:8.3f}")
        print(f"    ITL vs the floor ({floor * 1e3:.1f} ms): stock {med['sdpa']['itl'] / floor:.2f}x, "
              f"hf_paged {med['hf_paged']['itl'] / floor:.2f}x")
        per_step = {k: statistics.median(breakdown(r["profile"])[k] for r in runs["hf_paged"]) for k in PARTS}
        overheads.append(print_breakdown("hf_paged per step", per_step))
        print(f"    greedy tokens identical: {same}; total {ratio['total']:.3f} "
              f"({'PASS' if ratio['total'] <= TARGET_TOTAL else 'MISS'} <= {TARGET_TOTAL}), ITL {ratio['itl']:.3f} "
              f"({'PASS' if ratio['itl'] <= 1.0 else 'MISS'} <= 1.0)")
        assert same, f"{name}/{new_tokens}: hf_paged's greedy tokens differ from stock's"
    bs64 = batch64(model, tokenizer, args.batch64_new_tokens) if args.batch64_new_tokens else None
    print("\n== summary")
    print(f"cells meeting total <= {TARGET_TOTAL}x and ITL <= 1.0x: {sum(verdicts)}/{len(verdicts)}")
    worst = max(overheads)
    print(f"outside the forward at batch 1: worst cell {worst:.1%} "
          f"({'PASS' if worst <= TARGET_OVERHEAD_BS1 else 'MISS'} <= {TARGET_OVERHEAD_BS1:.0%})")
    if bs64 is not None:
        print(f"outside the forward at batch 64: {bs64:.1%} "
              f"({'PASS' if bs64 <= TARGET_OVERHEAD_BS64 else 'MISS'} <= {TARGET_OVERHEAD_BS64:.0%})")


if __name__ == "__main__":
    main()
