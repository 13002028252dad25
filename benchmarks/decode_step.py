"""One decode step over long equal-length rows: hf_paged's engine against stock `generate`'s dense batch.

SmolLM2-135M-Instruct, fp32, greedy. For each cell (`--batches` x `--contexts`, default 8/16/32 rows x
1,024/4,096 tokens) every row holds `context` tokens of K/V and decodes `--steps` tokens. Both sides
start from the same K/V, so nothing is prefilled (a 32 x 4k prefill would take minutes on a CPU and
is not what is measured): random K/V values, one random buffer per row, are

* stock: put into a `DynamicCache` ([rows, Hkv, context, D] per layer, the layout `generate` builds)
  and `model.generate(ids, cache=that)` with sdpa continues from it: one dense batch, no padding,
  SDPA over contiguous K/V (grown by `torch.cat` each step, as stock does);
* hf_paged: imported into the engine's paged pool (`Engine.import_kv`, as disaggregated decoding
  does) and each request given its sequence as `kv_prefix`; the "cpu" backend (the native kernel)
  reads the blocks in place.

The prompt ids are random and distinct per row (no prefix-cache sharing). A step's time is the median
gap between consecutive forward ends (one forward hook, the same on both sides), over the decode
steps after the first; the cell's figure is the median over `--repeats` runs, sides alternated. The
greedy tokens of the two sides are compared (they read the same K/V; informational).

Target (issue 35): hf_paged's step <= 0.9x stock's in every cell.

    python benchmarks/decode_step.py [--batches 8,16,32] [--contexts 1024,4096] [--steps 12] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from transformers import DynamicCache

import hf_paged
from hf_paged import Engine, SamplingParams
from hf_paged.defaults.models import load_default

TARGET = 0.90


class ForwardClock:
    """Ends of the model's forwards (a forward hook), and the gaps between consecutive ones."""

    def __init__(self, model):
        self.ends: list[float] = []
        self.handle = model.register_forward_hook(lambda *_: self.ends.append(time.perf_counter()))

    def step_time(self) -> float:
        gaps = [b - a for a, b in zip(self.ends[1:], self.ends[2:])]  # skip the first forward (1 token per row)
        return statistics.median(gaps)

    def close(self):
        self.handle.remove()


def row_kv(seed: int, row: int, context: int, per_token: int) -> torch.Tensor:
    """Row `row`'s K/V in the transfer layout (per layer, K then V, each [tokens, Hkv, D]), made again
    from its seed when needed, so that a 32 x 4k cell (6 GB per copy) holds one copy at a time."""
    gen = torch.Generator().manual_seed(seed * 1000 + row)
    return torch.randn(context * per_token, generator=gen)


def stock_cache(model, seed: int, rows: int, context: int, per_token: int) -> DynamicCache:
    """The rows' K/V as a DynamicCache: [rows, Hkv, context, D] per layer."""
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    size = context * heads * dim
    keys = [torch.empty(rows, heads, context, dim) for _ in range(cfg.num_hidden_layers)]
    values = [torch.empty(rows, heads, context, dim) for _ in range(cfg.num_hidden_layers)]
    for row in range(rows):
        buf = row_kv(seed, row, context, per_token)
        for layer in range(cfg.num_hidden_layers):
            keys[layer][row] = buf[2 * layer * size:(2 * layer + 1) * size].view(context, heads, dim).transpose(0, 1)
            values[layer][row] = buf[(2 * layer + 1) * size:(2 * layer + 2) * size].view(context, heads, dim).transpose(0, 1)
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        cache.update(keys[layer], values[layer], layer)
    return cache


def run_stock(model, ids: torch.Tensor, seed: int, context: int, per_token: int, steps: int):
    cache = stock_cache(model, seed, ids.shape[0], context, per_token)
    clock = ForwardClock(model)
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, pad_token_id=0)
    finally:
        clock.close()
    del cache
    return clock.step_time(), out[:, ids.shape[1]:].tolist()


def run_engine(engine: Engine, model, ids: torch.Tensor, seed: int, context: int, per_token: int, steps: int):
    prefixes = [engine.import_kv(row[:-1], row_kv(seed, i, context, per_token)) for i, row in enumerate(ids.tolist())]
    clock = ForwardClock(model)
    try:
        outs = engine.generate(ids.tolist(), SamplingParams(max_new_tokens=steps, min_new_tokens=steps),
                               kv_prefixes=prefixes)
    finally:
        clock.close()
    engine.free_kv(prefixes)
    return clock.step_time(), [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,16,32")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_default()
    model.eval()
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    longest = max(contexts) + args.steps + 8
    engine = Engine(model, max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches)),
                    max_model_len=longest, num_blocks=max(batches) * -(-longest // 16) + 64)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))  # every layer's blocks exist from here on
    per_token = engine.kv.kv_numel_per_token()  # per layer K then V: 30 x 2 x 3 x 64
    from hf_paged.attention import dispatch
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, hf_paged backend "
          f"{dispatch.backend(torch.device('cpu'))}; {args.steps} decode steps per run, medians of {args.repeats}")
    print(f"{'rows':>5s} {'context':>8s} {'stock ms/step':>14s} {'hf_paged ms/step':>17s} {'ratio':>6s} "
          f"{'same tokens':>11s}")
    verdicts = []
    gen = torch.Generator().manual_seed(0)
    for rows in batches:
        for context in contexts:
            ids = torch.randint(3, model.config.vocab_size, (rows, context + 1), generator=gen)
            seed = rows * 100_000 + context
            stock_t, ours_t, same = [], [], None
            with torch.inference_mode():
                for r in range(args.repeats):
                    sides = ("stock", "ours") if r % 2 == 0 else ("ours", "stock")
                    for side in sides:
                        gc.collect()
                        if side == "stock":
                            model.set_attn_implementation("sdpa")
                            t, stock_tokens = run_stock(model, ids, seed, context, per_token, args.steps)
                            stock_t.append(t)
                        else:
                            model.set_attn_implementation("hf_paged")
                            t, our_tokens = run_engine(engine, model, ids, seed, context, per_token, args.steps)
                            ours_t.append(t)
                same = sum(a == b for a, b in zip(stock_tokens, our_tokens))
            s, o = statistics.median(stock_t), statistics.median(ours_t)
            verdicts.append(o / s <= TARGET)
            print(f"{rows:5d} {context:8d} {s * 1e3:14.1f} {o * 1e3:17.1f} {o / s:6.2f} {same:>6d}/{rows}",
                  flush=True)
    engine.shutdown()
    hf_paged.release(model)
    print(f"\nVERDICT decode step <= {TARGET}x stock in every cell: {'PASS' if all(verdicts) else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
