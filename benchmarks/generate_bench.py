"""Stock `generate` (sdpa + DynamicCache) against hf_paged `generate`, in the same run.

Scenarios (SmolLM2-135M-Instruct, greedy):
  * bs=1, 1024 new tokens (long decode: per-step overhead and cache growth)
  * a left-padded batch of 8 chat prompts of mixed length, 128 new tokens

For each it prints the median wall time over `--repeats`, tokens/s, the peak KV bytes of each cache
(DynamicCache: its tensors at the end, which is its maximum; PagedCache: blocks in use and the whole
pool), the paged/stock ratios, and whether the generated tokens are identical.

    python benchmarks/generate_bench.py [--repeats 3] [--new-tokens 1024] [--batch-new-tokens 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import hf_paged  # noqa: F401  (registers "hf_paged")
from hf_paged.defaults.models import load_default
from hf_paged.defaults.prompts import CHAT_PROMPTS, chat_inputs


def dynamic_cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def run(model, inputs, new_tokens: int, attn: str, repeats: int):
    model.set_attn_implementation(attn)
    times, out = [], None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             return_dict_in_generate=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    cache = out.cache
    if attn == "hf_paged" and cache is None:  # served by the engine: its KV figures stay on the model
        m = model.hf_paged_last_metrics
        kv = {"kv_bytes": m["kv_peak_bytes"], "kv_reserved": m["kv_num_blocks"] * m["kv_bytes_per_block"],
              "tokens": None}
    elif attn == "hf_paged":
        stats = cache.stats()
        kv = {"kv_bytes": stats["kv_bytes"], "kv_reserved": stats["kv_bytes_reserved"], "tokens": stats["num_tokens"]}
    else:
        nbytes = dynamic_cache_bytes(cache)
        kv = {"kv_bytes": nbytes, "kv_reserved": nbytes, "tokens": None}
    return statistics.median(times), out.sequences, kv


def scenario(name, model, inputs, new_tokens, repeats):
    batch = inputs["input_ids"].shape[0]
    run(model, inputs, 2, "sdpa", 1)  # warm-up both paths
    run(model, inputs, 2, "hf_paged", 1)
    t_stock, seq_stock, kv_stock = run(model, inputs, new_tokens, "sdpa", repeats)
    t_paged, seq_paged, kv_paged = run(model, inputs, new_tokens, "hf_paged", repeats)
    real = int(inputs["attention_mask"].sum()) + batch * (new_tokens - 1)
    print(f"\n== {name}: batch={batch}, prompt tokens={int(inputs['attention_mask'].sum())} "
          f"(padded width {inputs['input_ids'].shape[1]}), new tokens={new_tokens}, repeats={repeats}")
    print(f"{'':28}{'stock (sdpa+Dynamic)':>22}{'hf_paged':>14}{'paged/stock':>13}")
    print(f"{'median wall time (s)':28}{t_stock:22.3f}{t_paged:14.3f}{t_paged / t_stock:13.3f}")
    tps_s, tps_p = batch * new_tokens / t_stock, batch * new_tokens / t_paged
    print(f"{'tokens/s':28}{tps_s:22.1f}{tps_p:14.1f}{tps_p / tps_s:13.3f}")
    print(f"{'KV bytes in use (MiB)':28}{kv_stock['kv_bytes'] / 2**20:22.2f}{kv_paged['kv_bytes'] / 2**20:14.2f}"
          f"{kv_paged['kv_bytes'] / kv_stock['kv_bytes']:13.3f}")
    print(f"{'KV bytes reserved (MiB)':28}{kv_stock['kv_reserved'] / 2**20:22.2f}"
          f"{kv_paged['kv_reserved'] / 2**20:14.2f}{kv_paged['kv_reserved'] / kv_stock['kv_reserved']:13.3f}")
    if kv_paged["tokens"] is not None:
        print(f"{'real tokens stored':28}{real:22d}{kv_paged['tokens']:14d}")
    else:
        print(f"{'KV in use':28}{'at the end':>22}{'at its peak':>14}  (the engine frees each row as it ends)")
    print(f"greedy tokens identical: {torch.equal(seq_stock, seq_paged)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--batch-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tokenizer = load_default(dtype=dtype, device=device)
    print(f"device={device} dtype={dtype} torch={torch.__version__} threads={torch.get_num_threads()}")
    single = chat_inputs(tokenizer, [CHAT_PROMPTS[3]]).to(device)
    scenario("bs=1 long decode", model, single, args.new_tokens, args.repeats)
    batch = chat_inputs(tokenizer).to(device)
    scenario("padded batch of 8", model, batch, args.batch_new_tokens, args.repeats)


if __name__ == "__main__":
    main()
