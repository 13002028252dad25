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

K/V dtypes (after each decode shape's table, `--kv-dtypes`): the same shuffled pool stored as fp32,
bf16, fp16 (a model of that dtype: queries and K/V in it), int8 and fp8_e4m3 (fp8_e5m2 on request;
quantised with dynamic per-token scales, fp32 queries), each read by the native kernel (`kernel`) and
by the torch path, which gathers and dequantises into a workspace (`torch`: what these dtypes ran on
before the kernel read them). Bytes = payload + scales, read once; "x fp32" = the kernel's time over
the fp32 kernel's in the same run, "torch/kernel" = the torch path's time over the kernel's for that
dtype; "max |diff|" is the kernel against the torch path on the same tensors (bf16/fp16: their rounding).

    python benchmarks/attention.py [--rounds 3] [--reps 5] [--threads N] [--quick] [--json PATH]
                                   [--kv-dtypes float32,bfloat16,float16,int8,fp8_e4m3] [--dtypes-only]
                                   [--shapes decode-64x4096,...] [--plain-pages]

Pools are allocated as the engine allocates its K/V pools (`hf_paged.hf.pool_memory`: 2 MiB pages where
Linux offers them); `--plain-pages` leaves them on the allocator's 4 KiB pages.

The line `VERDICT decode 64x4096` compares `cpu` with the issue's target: >= 50% of copy bandwidth;
`VERDICT int8 decode 64x4096` the int8 kernel's time with <= 0.5x the fp32 kernel's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_paged.attention import cpu_kernel, flex_paged, kv_quant, torch_paged
from hf_paged.config import kv_cache_dtype
from hf_paged.hf import pool_memory

HQ, HKV, D, BLOCK = 9, 3, 64, 16
SCALE = D ** -0.5
TARGET_DECODE_COPY_BW = 0.50  # decode at 64 x 4k, of the copy bandwidth
TARGET_INT8_VS_FP32 = 0.50  # the int8 kernel's time over the fp32 kernel's, decode at 64 x 4k
KV_DTYPES = "float32,bfloat16,float16,int8,fp8_e4m3"


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


PLAIN_PAGES = False  # --plain-pages: the pools on whatever pages torch's allocator gives


def pooled(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` copied into memory allocated as the engine allocates its K/V pools (`hf.pool_memory`:
    huge pages where Linux offers them), or left as it is with --plain-pages."""
    if PLAIN_PAGES:
        return tensor
    return pool_memory.zeros(tuple(tensor.shape), tensor.dtype, tensor.device).copy_(tensor)


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
        self.k, self.v, self.contig_k, self.contig_v = (pooled(t) for t in (self.k, self.v, self.contig_k,
                                                                          self.contig_v))
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


class DtypePool:
    """`case`'s shuffled pool stored as `name`: a bf16 / fp16 model's own cache (queries of its dtype),
    or a quantised cache with dynamic per-token scales under fp32 queries."""

    def __init__(self, case: Case, name: str):
        spec = kv_cache_dtype(name)
        self.name, self.case, self.scales = name, case, None
        if spec.is_quantized:
            quant = kv_quant.KVQuant.of(spec, "dynamic")
            (self.k, key_scales), (self.v, value_scales) = (self._quantize(c, quant) for c in (case.k, case.v))
            self.k, self.v = pooled(self.k), pooled(self.v)
            self.scales = kv_quant.KVScales(pooled(key_scales), pooled(value_scales), quant)
            self.query = case.query
        else:
            dtype = getattr(torch, spec.storage)
            self.k, self.v, self.query = pooled(case.k.to(dtype)), pooled(case.v.to(dtype)), case.query.to(dtype)
        scale_bytes = 0 if self.scales is None else 2 * self.scales.key[:1, :1].numel() * 4
        self.kv_bytes = case.num_seqs * case.ctx * (HKV * 2 * D * self.k.element_size() + scale_bytes)

    @staticmethod
    def _quantize(cache: torch.Tensor, quant) -> tuple[torch.Tensor, torch.Tensor]:
        payload, scales = kv_quant.quantize(cache.view(-1, HKV, D), quant)
        return payload.view(cache.shape), scales.view(*cache.shape[:2], *scales.shape[1:])

    def paged(self, native: bool):
        """One layer's call on the kernel (`native`) or the torch path, its plan (and workspace) its own."""
        case = self.case
        plan = torch_paged.AttentionPlan(case.tables, case.seq_lens, case.cu, case.q_len, case.ctx, BLOCK,
                                         workspace=torch_paged.Workspace(), native=native)

        def run():
            return torch_paged.paged_attention(self.query, self.k, self.v, case.tables, case.seq_lens, case.cu,
                                               case.q_len, case.ctx, SCALE, plan=plan, scales=self.scales)
        return run


def dtype_rows(case: Case, names: list[str], args, bw: float) -> list[dict]:
    """The K/V dtype table of one decode shape: each dtype's kernel and torch path, alternated."""
    pools = {name: DtypePool(case, name) for name in names}
    methods = {}
    for name, pool in pools.items():
        methods[f"kernel {name}"] = pool.paged(True)
        methods[f"torch {name}"] = pool.paged(False)
    errors = {name: (methods[f"kernel {name}"]().float() - methods[f"torch {name}"]().float()).abs().max().item()
              for name in names}
    times = {name: [] for name in methods}
    for r in range(args.rounds):
        for name in (list(methods) if r % 2 == 0 else list(reversed(methods))):
            times[name].append(timed(methods[name], args.reps))
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    base = ms.get("kernel float32")
    print(f"  K/V dtypes ({case.num_seqs} x {case.ctx}):")
    print(f"  {'kv dtype':9s} {'query':9s} {'K/V MB':>7s} {'kernel ms':>9s} {'x fp32':>7s} {'GB/s':>7s} "
          f"{'% copy bw':>9s} {'torch ms':>9s} {'GB/s':>7s} {'torch/kernel':>12s} {'max |diff|':>10s}")
    rows = []
    for name, pool in pools.items():
        kernel, gather = ms[f"kernel {name}"], ms[f"torch {name}"]
        row = dict(kind="decode-dtype", num_seqs=case.num_seqs, ctx=case.ctx, kv_dtype=name,
                   query_dtype=str(pool.query.dtype).removeprefix("torch."), kv_mb=pool.kv_bytes / 1e6,
                   kernel_ms=kernel, vs_fp32_kernel=None if base is None else kernel / base,
                   kernel_gbps=pool.kv_bytes / kernel / 1e6, copy_fraction=pool.kv_bytes / (kernel / 1e3) / bw,
                   torch_ms=gather, torch_gbps=pool.kv_bytes / gather / 1e6, torch_vs_kernel=gather / kernel,
                   max_abs_diff=errors[name])
        rows.append(row)
        ratio = "" if base is None else f"{row['vs_fp32_kernel']:.2f}"
        print(f"  {name:9s} {row['query_dtype']:9s} {row['kv_mb']:7.1f} {kernel:9.3f} {ratio:>7s} "
              f"{row['kernel_gbps']:7.1f} {row['copy_fraction']:9.0%} {gather:9.3f} {row['torch_gbps']:7.1f} "
              f"{row['torch_vs_kernel']:12.2f} {row['max_abs_diff']:10.1e}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="the small shapes only (a smoke run)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plain-pages", action="store_true",
                        help="pools on the allocator's own pages, not the engine's huge-page pools (hf.pool_memory)")
    parser.add_argument("--no-flex", action="store_true", help="skip the flex backend (its compiles take seconds)")
    parser.add_argument("--kv-dtypes", default=KV_DTYPES,
                        help=f"K/V dtypes of each decode shape's dtype table (default {KV_DTYPES}; '' for none)")
    parser.add_argument("--dtypes-only", action="store_true", help="the decode shapes' K/V dtype tables only")
    parser.add_argument("--shapes", default=None,
                        help="only these shapes, e.g. decode-64x4096,prefill-1x512 (default: all)")
    args = parser.parse_args()
    global PLAIN_PAGES
    PLAIN_PAGES = args.plain_pages
    kv_dtypes = [name for name in args.kv_dtypes.split(",") if name]
    for name in kv_dtypes:
        kv_cache_dtype(name)  # a ValueError naming the vocabulary
    if args.threads:
        torch.set_num_threads(args.threads)
    native = cpu_kernel.load() is not None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU kernel: "
          f"{'built' if native else 'unavailable: ' + str(cpu_kernel.load_error())}")
    shapes = [("decode", s, ctx, 1) for s in (1, 16, 64) for ctx in (512, 4096)]
    shapes += [("prefill", 1, ctx, ctx) for ctx in (512, 4096)]
    if args.quick:
        shapes = [sh for sh in shapes if sh[2] == 512 and sh[1] <= 16]
    if args.dtypes_only:
        shapes = [sh for sh in shapes if sh[0] == "decode"]
    if args.shapes:  # any decode-SxC / prefill-SxC, not only the default ones
        shapes = []
        for name in args.shapes.split(","):
            kind, _, size = name.partition("-")
            seqs, _, ctx = size.partition("x")
            if kind not in ("decode", "prefill") or not seqs.isdigit() or not ctx.isdigit():
                parser.error(f"--shapes takes decode-SxC or prefill-SxC entries, got {name!r}")
            shapes.append((kind, int(seqs), int(ctx), 1 if kind == "decode" else int(ctx)))
    rows = []
    for kind, num_seqs, ctx, q_len in shapes:
        case = Case(num_seqs, ctx, q_len, seed=num_seqs * 7 + ctx)
        if args.dtypes_only:
            bw = statistics.median(copy_bandwidth() for _ in range(3))
            print(f"\n{kind} {num_seqs} x {ctx} (q_len {q_len}): copy bandwidth {bw / 1e9:.1f} GB/s")
            rows += dtype_rows(case, kv_dtypes, args, bw) if native else []
            continue
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
        if native and kind == "decode" and kv_dtypes:
            rows += dtype_rows(case, kv_dtypes, args, bw)
    verdict = None
    target = [r for r in rows if r.get("method") == "cpu" and r["kind"] == "decode" and r["num_seqs"] == 64
              and r["ctx"] == 4096]
    if target:
        frac = target[0]["copy_fraction"]
        verdict = frac >= TARGET_DECODE_COPY_BW
        print(f"\nVERDICT decode 64x4096: cpu at {frac:.0%} of copy bandwidth (target >= "
              f"{TARGET_DECODE_COPY_BW:.0%}): {'PASS' if verdict else 'FAIL'}")
    int8 = [r for r in rows if r["kind"] == "decode-dtype" and r["kv_dtype"] == "int8" and r["num_seqs"] == 64
            and r["ctx"] == 4096 and r["vs_fp32_kernel"] is not None]
    int8_verdict = None
    if int8:
        ratio = int8[0]["vs_fp32_kernel"]
        int8_verdict = ratio <= TARGET_INT8_VS_FP32
        print(f"VERDICT int8 decode 64x4096: the int8 kernel at {ratio:.2f}x the fp32 kernel's time (target <= "
              f"{TARGET_INT8_VS_FP32:.2f}x): {'PASS' if int8_verdict else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "verdict_decode_64x4096": verdict, "verdict_int8_64x4096": int8_verdict}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
