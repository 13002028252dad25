"""KV memory of a padded batch of mixed lengths: PagedCache against DynamicCache, same batch, same run.

For block sizes 1, 16 and 32 it prints the real tokens stored, the bytes the used blocks take, the
bound `(1 + block_size / min_len)` x real bytes, the pool's reserved bytes, and DynamicCache's bytes
(which hold every padding column too).

    python benchmarks/kv_memory.py [--new-tokens 16]
"""

from __future__ import annotations

import argparse

import torch

import hf_paged
from hf_paged.defaults.models import load_default
from hf_paged.defaults.prompts import chat_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    model, tokenizer = load_default()
    inputs = chat_inputs(tokenizer)
    lengths = inputs["attention_mask"].sum(1).tolist()
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
               return_dict_in_generate=True)
    stock = model.generate(**inputs, **gen)
    cache_key = "cache" if hasattr(stock, "cache") else "past_key_values"
    dense = sum(t.numel() * t.element_size() for layer in getattr(stock, cache_key).layers
                for t in (layer.keys, layer.values))
    stored = [n + args.new_tokens - 1 for n in lengths]
    print(f"batch of {len(lengths)} prompts, lengths {lengths} (padded to {inputs['input_ids'].shape[1]}), "
          f"{args.new_tokens} new tokens")
    print(f"DynamicCache: {dense / 2**20:.2f} MiB")
    print("(prefix caching shares the chat template's common system prompt across rows, so 'used' can be "
          "below 'real')")
    print(f"{'prefix':>7}{'block_size':>11}{'tokens':>8}{'used MiB':>10}{'used/real':>11}{'bound':>8}{'reserved MiB':>14}"
          f"{'used/Dynamic':>14}{'identical':>11}")
    model.set_attn_implementation("hf_paged")
    for prefix_caching, block_size in [(p, b) for p in (False, True) for b in (1, 16, 32)]:
        model.hf_paged_cache_config = hf_paged.PagedCacheConfig(block_size=block_size,
                                                                enable_prefix_caching=prefix_caching)
        out = model.generate(**inputs, **gen)
        stats = getattr(out, cache_key).stats()
        real = stats["num_tokens"] * stats["bytes_per_token"]
        assert stats["num_tokens"] == sum(stored)
        print(f"{'on' if prefix_caching else 'off':>7}{block_size:>11}{stats['num_tokens']:>8}{stats['kv_bytes'] / 2**20:>10.2f}"
              f"{stats['kv_bytes'] / real:>11.3f}{1 + block_size / min(stored):>8.3f}"
              f"{stats['kv_bytes_reserved'] / 2**20:>14.2f}{stats['kv_bytes'] / dense:>14.3f}"
              f"{str(torch.equal(out.sequences, stock.sequences)):>11}")


if __name__ == "__main__":
    main()
