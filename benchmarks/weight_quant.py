"""Weight-only quantised SmolLM2 through hf_paged against stock, beside the same model in float32, in one run.

The quantised model is what a user gets from transformers' own quantizer on a CPU:
`from_pretrained(..., quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))` (torchao; per-row int8
weights of every decoder linear, the tied embedding / LM head left in float32, activations float32).
Both models are loaded side by side and every run alternates between them and between the methods.

Batch 1 (`--new-tokens`, default 96, from latency.py's chat prompt, greedy, medians of `--repeats`):
  * stock: `generate` with sdpa + DynamicCache;
  * static: `generate(cache_implementation="static")`, eager;
  * hf_paged: the drop-in `generate` (attn_implementation="hf_paged", served by the engine; decode steps
    eager; prefix caching off, so every repeat prefills as stock does);
  * with `--compile`, two more: static + `torch.compile` (Inductor on CPU via
    `CompileConfig._compile_all_devices`) and hf_paged with its decode steps compiled (latency.py's
    `compiled` variant, `HF_PAGED_CPU_GRAPHS=1`, where this tree has `hf_paged.worker.cpu_graphs`); each
    compiles in its warm-up, whose time is printed (minutes on 2 cores).
For each model it prints inter-token latency (median gap between consecutive forwards, or streamed
tokens for the static cache) and total time, hf_paged's ratios to stock and static, each method's
int8/fp32 ratio, the ITL against the weight-read floor (bytes actually stored per model / the read
bandwidth measured in the same run), and whether each method's greedy tokens equal stock's on that
model (the acceptance: identical for hf_paged on the int8 model). The int8 model's tokens against the
fp32 model's are informational (quantisation may change them).

64 requests (throughput.py's seeded workload, defaults scaled down to keep the run under 5 minutes:
prompts 20-300 tokens, outputs 16-64; `--max-prompt 600 --max-output 256` is throughput.py's own)
through `hf_paged.Engine` on each model, decode steps eager (`HF_PAGED_CPU_GRAPHS=0`: a background
compile would share the cores with the timed steps): output tokens/s and int8/fp32; `--static-bs 8` adds stock
static batches of 8 (throughput.py's `static_bs8`) on each model, with hf_paged's ratio to it and
greedy agreement.

    python benchmarks/weight_quant.py [--repeats 3] [--new-tokens 96] [--num-requests 64]
                                      [--max-prompt 300] [--max-output 64] [--static-bs 8] [--compile]
                                      [--threads N]
    python benchmarks/weight_quant.py --repeats 1 --new-tokens 8 --num-requests 4 --min-output 4 --max-output 8  # smoke

Timings on a shared machine are noisy: compare ratios from one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import latency  # noqa: E402  (benchmarks/latency.py: prompts, run_once, StreamClock, read_bandwidth)
import throughput  # noqa: E402  (benchmarks/throughput.py: the workload, static batches, the engine run)

import hf_paged  # noqa: E402,F401  (registers "hf_paged")
from hf_paged.defaults.models import load_default  # noqa: E402
from hf_paged.hf import linear as fast_linear  # noqa: E402

CPU_GRAPHS = "HF_PAGED_CPU_GRAPHS"  # hf_paged.worker.cpu_graphs: 0 = decode steps eager


def load_models() -> tuple[dict, object]:
    """SmolLM2 in float32, and quantised to int8 weight-only by transformers' torchao quantizer at load."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig
    except ImportError:
        sys.exit("benchmarks/weight_quant.py needs torchao: pip install -e '.[quant]'")
    from transformers import TorchAoConfig

    fp32, tokenizer = load_default(dtype=torch.float32)
    int8, _ = load_default(dtype=torch.float32, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    return {"float32": fp32, "int8": int8}, tokenizer


def stored_bytes(model) -> int:
    """Bytes the parameters occupy, each distinct storage once (the tied embedding / LM head counted once):
    a tensor-subclass weight (torchao's) by the plain tensors inside it (int8 values and scales), which is
    what a decode step reads. latency.weight_bytes would count its logical float32 size instead."""
    sizes = {}

    def add(t):
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            sizes[t.data_ptr()] = t.numel() * t.element_size()
        else:  # a traceable wrapper subclass: its inner tensors
            names, _ = t.__tensor_flatten__()
            for name in names:
                add(getattr(t, name))

    for p in model.parameters():
        add(p)
    return sum(sizes.values())


def run_static(model, ids, new_tokens: int, compile_config=None) -> dict:
    """Stock `generate` with a static cache (compiled where `compile_config` is given)."""
    model.set_attn_implementation("sdpa")
    inputs = torch.tensor([ids])
    clock = latency.StreamClock()  # stock calls its streamer outside any compiled region: it times compiled steps too
    kwargs = dict(cache_implementation="static", streamer=clock)
    if compile_config is not None:
        kwargs["compile_config"] = compile_config
    start = time.perf_counter()
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, **kwargs)
    total = time.perf_counter() - start
    ticks = clock.times[1:]  # the first put is the prompt
    gaps = [b - a for a, b in zip(ticks[:-1], ticks[1:])]
    return dict(total=total, ttft=ticks[0] - start, itl=statistics.median(gaps) if gaps else float("nan"),
                tokens=out[0, len(ids):].tolist())


def compile_config():
    from transformers import CompileConfig

    config = CompileConfig(mode="default")  # "reduce-overhead" means CUDA graphs
    config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    return config


def batch1(models: dict, ids: list[int], args, floors: dict) -> bool:
    methods = {"stock": lambda m, n: latency.run_once(m, ids, n, "sdpa"),
               "static": lambda m, n: run_static(m, ids, n)}
    if args.compile:
        config = compile_config()
        methods["static+compile"] = lambda m, n: run_static(m, ids, n, config)
    methods["hf_paged"] = lambda m, n: latency.run_once(m, ids, n, "hf_paged")
    if args.compile and importlib.util.find_spec("hf_paged.worker.cpu_graphs") is not None:
        methods["hf_paged compiled"] = lambda m, n: latency.run_once(m, ids, n, "compiled")
    for key, model in models.items():  # warm-up; the compiled variants compile here
        for method, fn in methods.items():
            start = time.perf_counter()
            try:  # a static cache's compiled code is specialised to its length: warm it at the timed one
                fn(model, args.new_tokens if method.startswith("static") else 4)
            except Exception as exc:  # noqa: BLE001 - a method that cannot run is reported, not fatal
                print(f"    {key} {method}: failed ({type(exc).__name__}: {str(exc)[:200]}); dropped")
                methods[method] = None
                continue
            if "compile" in method:
                print(f"    {key} {method}: first call (compiles) {time.perf_counter() - start:.1f} s")
        methods = {k: v for k, v in methods.items() if v is not None}
    runs = {(key, method): [] for key in models for method in methods}
    for _ in range(args.repeats):
        for key, model in models.items():
            for method, fn in methods.items():
                runs[key, method].append(fn(model, args.new_tokens))
    med = {cell: {k: statistics.median(r[k] for r in rs) for k in ("total", "itl")} for cell, rs in runs.items()}
    print(f"\n== batch 1: chat prompt ({len(ids)} tokens), {args.new_tokens} new tokens, greedy, medians of "
          f"{args.repeats}")
    print(f"{'':16}" + "".join(f"{f'{k} ITL ms':>18}{f'{k} total s':>18}" for k in models)
          + f"{'int8/fp32 ITL':>16}{'int8/fp32 total':>17}")
    for method in methods:
        cells = "".join(f"{med[k, method]['itl'] * 1e3:18.1f}{med[k, method]['total']:18.3f}" for k in models)
        ratio = [med["int8", method][x] / med["float32", method][x] for x in ("itl", "total")]
        print(f"{method:16}{cells}{ratio[0]:16.3f}{ratio[1]:17.3f}")
    ok = True
    for key in models:
        for paged in (m for m in methods if m.startswith("hf_paged")):
            ratios = "; ".join(f"{med[key, paged]['itl'] / med[key, m]['itl']:.3f}x / "
                               f"{med[key, paged]['total'] / med[key, m]['total']:.3f}x {m}"
                               for m in methods if not m.startswith("hf_paged"))
            print(f"    {key}: {paged} ITL / total against {ratios}")
        same = {m: all(r["tokens"] == runs[key, "stock"][0]["tokens"] for r in runs[key, m]) for m in methods}
        ok &= all(s for m, s in same.items() if m.startswith("hf_paged"))
        print(f"    {key}: ITL vs the weight-read floor ({floors[key] * 1e3:.1f} ms): "
              + ", ".join(f"{m} {med[key, m]['itl'] / floors[key]:.2f}x" for m in methods))
        print(f"    {key}: greedy tokens identical to stock's: "
              + ", ".join(f"{m} {'yes' if s else 'NO'}" for m, s in same.items() if m != "stock"))
    a, b = runs["float32", "stock"][0]["tokens"], runs["int8", "stock"][0]["tokens"]
    agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    print(f"    int8 vs float32 stock tokens (informational): first {agree} of {len(a)} agree")
    return ok


def workload(models: dict, tokenizer, args) -> bool:
    ns = argparse.Namespace(num_requests=args.num_requests, min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                            min_output=args.min_output, max_output=args.max_output, seed=0,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            device="cpu")
    requests = throughput.build_workload(tokenizer, ns)
    useful = sum(r.n for r in requests)
    print(f"\n== {len(requests)} requests (prompts {args.min_prompt}-{args.max_prompt} tokens, outputs "
          f"{args.min_output}-{args.max_output}; {useful} output tokens), greedy")
    results = {}
    previous = os.environ.get(CPU_GRAPHS)
    os.environ[CPU_GRAPHS] = "0"  # eager decode steps (read where the engine is built; unknown to older trees)
    try:
        for key, model in models.items():
            hf_paged.release(model)  # the batch-1 drop-in engine's pool
            results[key, "hf_paged"] = throughput.run_hf_paged(model, requests, ns, sampling=False)
    finally:
        if previous is None:
            os.environ.pop(CPU_GRAPHS)
        else:
            os.environ[CPU_GRAPHS] = previous
    for key, model in models.items():
        for bs in args.static_bs:
            results[key, f"static_bs{bs}"] = throughput.run_static(model, requests, bs, tokenizer.pad_token_id,
                                                                  sampling=False)
    rate = {cell: useful / res.wall for cell, res in results.items()}
    methods = list(dict.fromkeys(m for _, m in results))
    print(f"{'':16}" + "".join(f"{f'{k} tok/s':>16}" for k in models) + f"{'int8/fp32':>12}")
    for method in methods:
        print(f"{method:16}" + "".join(f"{rate[k, method]:16.1f}" for k in models)
              + f"{rate['int8', method] / rate['float32', method]:12.3f}")
    ok = True
    for key in models:
        for bs in args.static_bs:
            stock = results[key, f"static_bs{bs}"]
            same = results[key, "hf_paged"].outputs == stock.outputs
            ok &= same
            print(f"    {key}: hf_paged {rate[key, 'hf_paged'] / rate[key, f'static_bs{bs}']:.2f}x static_bs{bs}; "
                  f"greedy outputs identical: {'yes' if same else 'NO'}")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96, help="batch-1 new tokens (0 skips batch 1)")
    parser.add_argument("--compile", action="store_true",
                        help="also stock static cache with torch.compile and hf_paged's compiled decode steps")
    parser.add_argument("--num-requests", type=int, default=64, help="workload requests (0 skips the workload)")
    parser.add_argument("--min-prompt", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=300)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--static-bs", default="", help="comma list of stock static batch sizes for the workload")
    args = parser.parse_args()
    args.static_bs = [int(b) for b in args.static_bs.split(",") if b]
    if not 1 <= args.min_prompt <= args.max_prompt or not 1 <= args.min_output <= args.max_output:
        parser.error("need 1 <= --min-prompt <= --max-prompt and 1 <= --min-output <= --max-output")
    if args.repeats < 1 or args.new_tokens < 0 or args.num_requests < 0 or any(b < 1 for b in args.static_bs):
        parser.error("--repeats and --static-bs must be positive, --new-tokens and --num-requests >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    models, tokenizer = load_models()
    for model in models.values():
        # Every repeat prefills its prompt, as stock does (no prefix-cache hits across repeats).
        model.hf_paged_cache_config = hf_paged.PagedCacheConfig(enable_prefix_caching=False)
    import torchao

    bandwidth = latency.read_bandwidth()
    sizes = {k: stored_bytes(m) for k, m in models.items()}
    floors = {k: n / bandwidth for k, n in sizes.items()}
    print(f"env: torch={torch.__version__} transformers={transformers.__version__} torchao={torchao.__version__} "
          f"python={platform.python_version()} threads={torch.get_num_threads()} cpus={os.cpu_count()} "
          f"fast_linear={fast_linear.is_available()}")
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; weights stored: "
          + ", ".join(f"{k} {sizes[k] / 1e6:.0f} MB (floor {floors[k] * 1e3:.1f} ms/token)" for k in models))
    ok = True
    if args.new_tokens:
        ok &= batch1(models, latency.prompts(tokenizer)["chat"], args, floors)
    if args.num_requests:
        ok &= workload(models, tokenizer, args)
    print(f"\n== {'PASS' if ok else 'FAIL'}: hf_paged's greedy tokens identical to stock's on each model "
          f"({time.perf_counter() - started:.0f} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
