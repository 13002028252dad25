"""A prefill chunk over a cached prefix on a fragmented pool, on the CPU: today's gather against
reading the pool in place, beside stock SDPA over a contiguous cache of the same keys.

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, blocks of 16 tokens), fp32 and
bf16 (queries and K/V in it): one sequence whose first P tokens are cached and whose q_len new
tokens (already written to the pool, as `store_kv` does before attention) attend to the prefix and,
causally, to themselves.

Pool layouts (the sequence's blocks in the pool):

* `R1`, `R4`, `R16`: in runs of R consecutive blocks, the runs at random places (R1 = shuffled, as
  after a server has run a while);
* `prefix`: the cached prefix on one run and the new tokens' blocks on another (what prefix caching
  leaves: the prefix was prefilled on consecutive blocks, the new chunk comes from the free list).

Methods:

* `gather`: the torch path (`torch_paged.paged_attention`, `native=False`, the step's plan and
  workspace made beforehand): every block index_selected into a workspace, then one masked SDPA.
  (In the "cpu" backend a chunk of q_len <= 16 goes to the native kernel instead.)
* `in_place`: SDPA (`aten._scaled_dot_product_flash_attention_for_cpu`, which returns the rows'
  log-sum-exp) over each run of consecutive blocks as a strided view of the pool, no copy; runs of
  the prefix non-causal, the part of a run holding new tokens causal at its diagonal; the partial
  outputs merged by their log-sum-exp in fp32.
* `gather_lse`: the same gather (index_select into a buffer), then `in_place`'s split over the
  gathered keys as one run: the prefix non-causal, the new tokens causal, merged by log-sum-exp. It
  tells what `in_place` saves by not copying from what it saves by not masking.
* `stock_sdpa`: transformers' `sdpa_attention_forward` (what stock `generate` runs) over contiguous
  `[1, Hkv, P + q_len, D]` K/V with the bool mask stock builds (a prefix + causal block).

Each timing is the median over `--rounds` rounds, methods alternated within a round, of the median of
`--reps` calls of one layer's attention. "gather/ip" > 1 means reading in place is faster than
today's gather ("gather/g_lse" likewise for `gather_lse`); "x stock" = time / stock_sdpa's time. Times in ms.
"max |diff|" is the largest of the four methods' against an fp64 reference.

Why short runs lose in place: each run's partial output ([Hq, q_len, D], merged afterwards) is
larger than the run's K/V ([2, Hkv, R * block_size, D]) unless R > q_len * Hq / (2 * Hkv *
block_size) blocks (12 at q_len 128), and each run costs an SDPA call; the gather's copy is a few
percent of a prefill chunk's time.

    python benchmarks/prefill_cached.py [--rounds 3] [--reps 5] [--threads N] [--quick] [--json PATH]
                                        [--dtypes float32,bfloat16] [--q-lens 16,128,512]
                                        [--prefixes 512,2048,4096] [--layouts R1,R4,R16,prefix]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from attention import copy_bandwidth, timed  # benchmarks/ is on sys.path when a script here runs
from hf_paged.attention import torch_paged

HQ, HKV, D, BLOCK = 9, 3, 64, 16
SCALE = D ** -0.5
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def runs_of(blocks: list[int]) -> list[tuple[int, int]]:
    """(first block id, number of blocks) of each run of consecutive block ids, in table order."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def attend_in_place(query: torch.Tensor,  # [q_len, Hq, D]
                    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
                    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
                    runs: list[tuple[int, int]], seq_len: int, scale: float) -> torch.Tensor:  # [q_len, Hq, D]
    """One sequence's attention read in place: SDPA per run of consecutive blocks (a view of the pool),
    the partials merged by log-sum-exp. Keys before the first query's position are seen by every
    query; the new tokens' part of a run is causal at its diagonal (top-left, rows from its start)."""
    q_len, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    prefix = seq_len - q_len
    q = query.transpose(0, 1)[None]  # [1, Hq, q_len, D]
    out = torch.zeros(1, num_q_heads, q_len, value_cache.shape[-1], dtype=torch.float32)
    lse = torch.full((1, num_q_heads, q_len), float("-inf"))
    pos = 0
    for first, num in runs:
        end = min(pos + num * block_size, seq_len)
        k = key_cache[first:first + num].view(1, -1, num_kv_heads, head_dim)
        v = value_cache[first:first + num].view(1, -1, num_kv_heads, value_cache.shape[-1])
        for a, b, causal in ((pos, min(end, prefix), False), (max(pos, prefix), end, True)):
            if a >= b:
                continue
            row = a - prefix if causal else 0  # a causal part starting at new token r: rows r.. see it
            o, l = _flash(q[:, :, row:], k[:, a - pos:b - pos].transpose(1, 2), v[:, a - pos:b - pos].transpose(1, 2),
                          is_causal=causal, scale=scale)
            merged = torch.logaddexp(lse[:, :, row:], l)
            out[:, :, row:] = out[:, :, row:] * (lse[:, :, row:] - merged).exp()[..., None] \
                + o.float() * (l - merged).exp()[..., None]
            lse[:, :, row:] = merged
        pos = end
    return out[0].transpose(0, 1).to(query.dtype)


def layout(num_blocks: int, kind: str, num_prefix_blocks: int, gen: torch.Generator) -> tuple[list[int], int]:
    """The sequence's block table and the pool's size: runs of R blocks at random slots of a pool twice
    the size, or (`prefix`) the prefix's blocks on one run and the rest on another, apart."""
    if kind == "prefix":
        rest = num_blocks - num_prefix_blocks
        return list(range(rest + 3, rest + 3 + num_prefix_blocks)) + list(range(rest)), num_blocks + 3
    run = int(kind.removeprefix("R"))
    num_runs = -(-num_blocks // run)
    slots = torch.randperm(2 * num_runs, generator=gen)[:num_runs].tolist()
    table = [s * run + i for s in slots for i in range(run)][:num_blocks]
    return table, 2 * num_runs * run


class Case:
    """One shape on one layout: the pool, the dense copy of the same K/V, the plan, the fp64 reference."""

    def __init__(self, prefix: int, q_len: int, kind: str, dtype: torch.dtype, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.prefix, self.q_len, self.kind, self.dtype = prefix, q_len, kind, dtype
        self.seq_len = prefix + q_len
        num_blocks = -(-self.seq_len // BLOCK)
        self.table, pool_blocks = layout(num_blocks, kind, -(-prefix // BLOCK), gen)
        self.runs = runs_of(self.table)
        keys = torch.randn(num_blocks * BLOCK, HKV, D, generator=gen)
        values = torch.randn(num_blocks * BLOCK, HKV, D, generator=gen)
        self.query = torch.randn(q_len, HQ, D, generator=gen).to(dtype)
        self.k = torch.randn(pool_blocks, BLOCK, HKV, D, generator=gen).to(dtype)  # other sequences' K/V
        self.v = torch.randn(pool_blocks, BLOCK, HKV, D, generator=gen).to(dtype)
        index = torch.tensor(self.table)
        self.k[index] = keys.view(num_blocks, BLOCK, HKV, D).to(dtype)
        self.v[index] = values.view(num_blocks, BLOCK, HKV, D).to(dtype)
        self.block_tables = index.to(torch.int32)[None]
        self.seq_lens = torch.tensor([self.seq_len], dtype=torch.int32)
        self.cu = torch.tensor([0, q_len], dtype=torch.int32)
        self.plan = torch_paged.AttentionPlan(self.block_tables, self.seq_lens, self.cu, q_len, self.seq_len, BLOCK,
                                              workspace=torch_paged.Workspace(), native=False)
        # stock: [1, Hkv, L, D] contiguous, queries [1, Hq, q_len, D], the mask stock builds (True = attend)
        self.dense_k = keys[:self.seq_len].to(dtype).transpose(0, 1)[None].contiguous()
        self.dense_v = values[:self.seq_len].to(dtype).transpose(0, 1)[None].contiguous()
        self.dense_q = self.query.transpose(0, 1)[None].contiguous()
        self.mask = torch.ones(q_len, self.seq_len, dtype=torch.bool).tril(prefix)[None, None]
        self.flops = 4 * HQ * D * (q_len * prefix + q_len * (q_len + 1) // 2)
        self.kv_bytes = self.seq_len * HKV * 2 * D * self.k.element_size()

    def gather(self):
        def run():
            return torch_paged.paged_attention(self.query, self.k, self.v, self.block_tables, self.seq_lens, self.cu,
                                               self.q_len, self.seq_len, SCALE, plan=self.plan, native=False)
        return run

    def in_place(self):
        def run():
            return attend_in_place(self.query, self.k, self.v, self.runs, self.seq_len, SCALE)
        return run

    def gather_lse(self):
        index = torch.tensor(self.table)
        buffers = [torch.empty(len(self.table), *self.k.shape[1:], dtype=self.dtype) for _ in range(2)]

        def run():
            k = torch.index_select(self.k, 0, index, out=buffers[0])
            v = torch.index_select(self.v, 0, index, out=buffers[1])
            return attend_in_place(self.query, k, v, [(0, len(self.table))], self.seq_len, SCALE)
        return run

    def stock(self):
        module = SimpleNamespace(is_causal=True, num_key_value_groups=HQ // HKV, training=False)

        def run():
            return sdpa_attention_forward(module, self.dense_q, self.dense_k, self.dense_v, self.mask,
                                          scaling=SCALE)[0][0]  # [q_len, Hq, D]
        return run

    def error(self, out: torch.Tensor) -> float:
        q, k, v = (t.double() for t in (self.dense_q, self.dense_k, self.dense_v))
        k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~self.mask, float("-inf"))
        ref = (scores.softmax(-1) @ v)[0].transpose(0, 1)  # [q_len, Hq, D]
        return (out.double() - ref).abs().max().item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="fp32, q_len 128, prefix 2048 only (a smoke run)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--q-lens", default="16,128,512")
    parser.add_argument("--prefixes", default="512,2048,4096")
    parser.add_argument("--layouts", default="R1,R4,R16,prefix")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    q_lens = [int(n) for n in args.q_lens.split(",")]
    prefixes = [int(n) for n in args.prefixes.split(",")]
    layouts = args.layouts.split(",")
    for kind in layouts:
        if kind != "prefix" and not (kind.startswith("R") and kind[1:].isdigit() and int(kind[1:]) > 0):
            raise ValueError(f"--layouts: {kind!r} is neither 'prefix' nor 'R<blocks per run>'")
    if args.quick:
        dtypes, q_lens, prefixes = [torch.float32], [128], [2048]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; copy bandwidth "
          f"{copy_bandwidth() / 1e9:.1f} GB/s")
    print(f"{'dtype':8s} {'P':>5s} {'q':>4s} {'layout':7s} {'runs':>4s} {'gather':>8s} {'in_place':>8s} "
          f"{'g_lse':>8s} {'stock':>8s} {'gather/ip':>9s} {'gather/g_lse':>12s} {'g x stock':>9s} "
          f"{'ip x stock':>10s} {'max |diff|':>10s}")
    rows = []
    for dtype in dtypes:
        for prefix in prefixes:
            for q_len in q_lens:
                for kind in layouts:
                    case = Case(prefix, q_len, kind, dtype, seed=prefix * 7 + q_len)
                    methods = {"gather": case.gather(), "in_place": case.in_place(), "gather_lse": case.gather_lse(),
                               "stock_sdpa": case.stock()}
                    errors = {name: case.error(fn()) for name, fn in methods.items()}
                    times = {name: [] for name in methods}
                    for r in range(args.rounds):
                        for name in (list(methods) if r % 2 == 0 else list(reversed(methods))):
                            times[name].append(timed(methods[name], args.reps))
                    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
                    row = dict(dtype=str(dtype).removeprefix("torch."), prefix=prefix, q_len=q_len, layout=kind,
                               num_runs=len(case.runs), ms=ms, errors=errors,
                               gather_vs_in_place=ms["gather"] / ms["in_place"],
                               gather_vs_gather_lse=ms["gather"] / ms["gather_lse"],
                               gather_vs_stock=ms["gather"] / ms["stock_sdpa"],
                               in_place_vs_stock=ms["in_place"] / ms["stock_sdpa"])
                    rows.append(row)
                    print(f"{row['dtype']:8s} {prefix:5d} {q_len:4d} {kind:7s} {len(case.runs):4d} "
                          f"{ms['gather']:8.2f} {ms['in_place']:8.2f} {ms['gather_lse']:8.2f} "
                          f"{ms['stock_sdpa']:8.2f} {row['gather_vs_in_place']:9.2f} "
                          f"{row['gather_vs_gather_lse']:12.2f} {row['gather_vs_stock']:9.2f} "
                          f"{row['in_place_vs_stock']:10.2f} {max(errors.values()):10.1e}", flush=True)
    for name in ("in_place", "gather_lse"):
        ratios = [r[f"gather_vs_{name}"] for r in rows]
        print(f"{name} faster than gather by > 10% in {sum(x > 1.1 for x in ratios)} of {len(rows)} cases, slower by "
              f"> 10% in {sum(x < 1 / 1.1 for x in ratios)}; gather/{name} median {statistics.median(ratios):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
