"""Attention alone, on the CPU: each hf_paged backend over a paged pool, beside stock SDPA over a
contiguous cache of the same shape, in GB/s of K/V read and as a multiple of the copy-bandwidth floor.

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, fp32, blocks of 16 tokens):

* decode: 1 / 16 / 64 sequences x 512 / 4096 tokens of context, one query each;
* prefill: one sequence of 512 / 4096 tokens, all of them queries (causal).

Methods:

* `cpu`: the "cpu" backend (the default here): the native kernel (`hf_paged.attention.cpu_kernel`)
  for decode, the torch path for prefill; K/V in a shuffled pool (every sequence's blocks scattered,
  as after a server has run a while).
* `torch`: the torch path alone (`HF_PAGED_BACKEND=torch`), the same shuffled pool: it gathers each
  sequence's blocks into a workspace and runs SDPA per length bucket.
* `torch_contig`: the torch path with each sequence's blocks consecutive in the pool (what a fresh
  pool hands out; a single sequence is then read as a view, with no gather).
* `flex`: the "flex" backend (`HF_PAGED_BACKEND=flex`): FlexAttention compiled by Inductor over the
  same shuffled pool (block mask over the pool's blocks); its first call per shape (the compile) is
  printed apart and not in its timing.
* `stock_sdpa`: transformers' own `sdpa_attention_forward` (what stock `generate` runs) over K/V as
  contiguous `[batch, Hkv, L, D]` tensors: the dense batch, no paging, no padding.

Each timing is the median over `--rounds` rounds, methods alternated within a round, of the median of
`--reps` calls of one layer's attention, the step's plan made beforehand (a step makes one plan and
all its layers share it; the plan's own cost per step is printed beside). K/V bytes = sequences x context x Hkv x (D + Dv) x 4, read once. The floor is those
bytes at the copy bandwidth, measured in the same run as (read + write) bytes / time of a 512 MiB copy
(median of 5, taken between rounds), the figure `throughput.py --ceiling` uses. "x floor" = time /
floor time; "% copy bw" = achieved GB/s / copy bandwidth. Prefill is compute-bound, so its rows also
give GFLOP/s (4 * L^2 / 2 * Hq * D for the causal half).

    python benchmarks/attention.py [--rounds 3] [--reps 5] [--threads N] [--quick] [--json PATH]

The line `VERDICT decode 64x4096` compares `cpu` with the issue's target: >= 50% of copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_paged.attention import cpu_kernel, flex_paged, torch_paged

HQ, HKV, D, BLOCK = 9, 3, 64, 16
SCALE = D ** -0.5
TARGET_DECODE_COPY_BW = 0.50  # decode at 64 x 4k, of the copy bandwidth


def copy_bandwidth() -> float:
    src = torch.ones(512 * 2**20 // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times)


def timed(fn, reps: int) -> float:
    fn()  # warm-up: plans, workspaces, the kernel's first touch
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Case:
    """One shape: a shuffled pool and a consecutive one holding the same K/V, and the dense copy."""

    def __init__(self, num_seqs: int, ctx: int, q_len: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.num_seqs, self.ctx, self.q_len = num_seqs, ctx, q_len
        blocks_per_seq = -(-ctx // BLOCK)
        num_blocks = num_seqs * blocks_per_seq
        self.query = torch.randn(num_seqs * q_len, HQ, D, generator=gen)
        keys = torch.randn(num_seqs, blocks_per_seq * BLOCK, HKV, D, generator=gen)
        values = torch.randn(num_seqs, blocks_per_seq * BLOCK, HKV, D, generator=gen)
        # consecutive: sequence s owns blocks [s * n, (s + 1) * n)
        self.contig_tables = torch.arange(num_blocks, dtype=torch.int32).view(num_seqs, blocks_per_seq)
        self.contig_k = keys.view(num_blocks, BLOCK, HKV, D).clone()
        self.contig_v = values.view(num_blocks, BLOCK, HKV, D).clone()
        # shuffled: the same blocks at random places
        perm = torch.randperm(num_blocks, generator=gen)
        self.tables = perm.view(num_seqs, blocks_per_seq).to(torch.int32)
        self.k = torch.empty_like(self.contig_k)
        self.v = torch.empty_like(self.contig_v)
        self.k[perm] = self.contig_k
        self.v[perm] = self.contig_v
        self.seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32)
        self.cu = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
        # stock: [batch, Hkv, L, D] contiguous, queries [batch, Hq, q_len, D]
        self.dense_k = keys[:, :ctx].transpose(1, 2).contiguous()
        self.dense_v = values[:, :ctx].transpose(1, 2).contiguous()
        self.dense_q = self.query.view(num_seqs, q_len, HQ, D).transpose(1, 2).contiguous()
        self.workspace = torch_paged.Workspace()
        self.kv_bytes = num_seqs * ctx * HKV * 2 * D * 4
        self.flops = 4 * num_seqs * HQ * D * (q_len * ctx - (q_len * (q_len - 1)) // 2)

    def paged(self, native: bool, contiguous: bool):
        """One layer's attention call, with the step's plan made beforehand: a model step makes one plan
        and every layer shares it (its cost per step is `plan_seconds`)."""
        tables = self.contig_tables if contiguous else self.tables
        k, v = (self.contig_k, self.contig_v) if contiguous else (self.k, self.v)
        plan = self.plan(native, contiguous)

        def run():
            return torch_paged.paged_attention(self.query, k, v, tables, self.seq_lens, self.cu, self.q_len,
                                               self.ctx, SCALE, plan=plan)
        return run

    def plan(self, native: bool, contiguous: bool) -> torch_paged.AttentionPlan:
        tables = self.contig_tables if contiguous else self.tables
        return torch_paged.AttentionPlan(tables, self.seq_lens, self.cu, self.q_len, self.ctx, BLOCK,
                                         workspace=self.workspace, native=native)

    def flex_plan(self) -> flex_paged.FlexPlan:
        plan = flex_paged.FlexPlan(self.tables, self.seq_lens, self.cu, BLOCK, self.k.shape[0])
        for call in plan.calls:  # the block masks, which the first layer would build
            call.mask(None, plan.block_pos)
        return plan

    def flex(self):
        plan = self.flex_plan()

        def run():
            return flex_paged.paged_attention(self.query, self.k, self.v, plan, SCALE)
        return run

    def stock(self):
        module = SimpleNamespace(is_causal=True, num_key_value_groups=HQ // HKV, training=False)

        def run():
            return sdpa_attention_forward(module, self.dense_q, self.dense_k, self.dense_v, None, scaling=SCALE)[0]
        return run

    def check(self, out: torch.Tensor) -> float:
        ref = self.stock()()  # [batch, q_len, Hq, D]
        return (out.view(self.num_seqs, self.q_len, HQ, D) - ref).abs().max().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="the small shapes only (a smoke run)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-flex", action="store_true", help="skip the flex backend (its compiles take seconds)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    native = cpu_kernel.load() is not None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU kernel: "
          f"{'built' if native else 'unavailable: ' + str(cpu_kernel.load_error())}")
    shapes = [("decode", s, ctx, 1) for s in (1, 16, 64) for ctx in (512, 4096)]
    shapes += [("prefill", 1, ctx, ctx) for ctx in (512, 4096)]
    if args.quick:
        shapes = [sh for sh in shapes if sh[2] == 512 and sh[1] <= 16]
    rows = []
    for kind, num_seqs, ctx, q_len in shapes:
        case = Case(num_seqs, ctx, q_len, seed=num_seqs * 7 + ctx)
        methods = {"torch": case.paged(False, False), "torch_contig": case.paged(False, True),
                   "stock_sdpa": case.stock()}
        if native:
            methods = {"cpu": case.paged(True, False), **methods}
        if not args.no_flex:
            methods = {**methods, "flex": case.flex()}
            start = time.perf_counter()
            methods["flex"]()
            print(f"\n(flex: first call for {kind} {num_seqs} x {ctx}, compile included: "
                  f"{time.perf_counter() - start:.1f} s)")
        errors = {name: case.check(fn()) for name, fn in methods.items() if name != "stock_sdpa"}
        times = {name: [] for name in methods}
        bandwidths = []
        for r in range(args.rounds):
            order = list(methods) if r % 2 == 0 else list(reversed(methods))
            for name in order:
                times[name].append(timed(methods[name], args.reps))
            bandwidths.append(copy_bandwidth())
        bw = statistics.median(bandwidths)
        floor = case.kv_bytes / bw
        stock = statistics.median(times["stock_sdpa"])
        plan_ms = {name: timed(lambda: case.plan(name == "cpu", name == "torch_contig"), args.reps) * 1e3
                   for name in methods if name not in ("stock_sdpa", "flex")}
        if "flex" in methods:
            plan_ms["flex"] = timed(case.flex_plan, args.reps) * 1e3
        print(f"\n{kind} {num_seqs} x {ctx} (q_len {q_len}): K/V {case.kv_bytes / 1e6:.1f} MB, copy bandwidth "
              f"{bw / 1e9:.1f} GB/s, floor {floor * 1e3:.3f} ms; plan per step (all layers): "
              + ", ".join(f"{name} {ms:.3f} ms" for name, ms in plan_ms.items()))
        print(f"  {'method':13s} {'ms':>9s} {'GB/s':>7s} {'x floor':>8s} {'% copy bw':>9s} {'GFLOP/s':>8s} "
              f"{'stock/this':>10s} {'max |diff|':>10s}")
        for name in methods:
            t = statistics.median(times[name])
            row = dict(kind=kind, num_seqs=num_seqs, ctx=ctx, q_len=q_len, method=name, ms=t * 1e3,
                       gbps=case.kv_bytes / t / 1e9, x_floor=t / floor, copy_fraction=case.kv_bytes / t / bw,
                       gflops=case.flops / t / 1e9, vs_stock=stock / t, copy_gbps=bw / 1e9,
                       max_abs_diff=errors.get(name, 0.0))
            rows.append(row)
            print(f"  {name:13s} {row['ms']:9.3f} {row['gbps']:7.1f} {row['x_floor']:8.2f} "
                  f"{row['copy_fraction']:9.0%} {row['gflops']:8.1f} {row['vs_stock']:10.2f} "
                  f"{row['max_abs_diff']:10.1e}")
    verdict = None
    target = [r for r in rows if r["method"] == "cpu" and r["kind"] == "decode" and r["num_seqs"] == 64
              and r["ctx"] == 4096]
    if target:
        frac = target[0]["copy_fraction"]
        verdict = frac >= TARGET_DECODE_COPY_BW
        print(f"\nVERDICT decode 64x4096: cpu at {frac:.0%} of copy bandwidth (target >= "
              f"{TARGET_DECODE_COPY_BW:.0%}): {'PASS' if verdict else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "verdict_decode_64x4096": verdict}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
