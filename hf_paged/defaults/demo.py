"""The demo: SmolLM2-135M-Instruct answers a padded batch of chat prompts through hf_paged, and the
run checks itself against stock transformers (sdpa + DynamicCache)."""

from __future__ import annotations

import time

import torch

from .models import load_default
from .prompts import CHAT_PROMPTS, chat_inputs


def run_demo(max_new_tokens: int = 48, verify: bool = True) -> bool:
    """Generate with hf_paged, print replies and KV accounting; with `verify`, compare to stock.

    Returns:
        True when verification was skipped or the greedy tokens matched stock exactly.
    """
    model, tokenizer = load_default(attn_implementation="hf_paged")
    inputs = chat_inputs(tokenizer)
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
    start = time.perf_counter()
    out = model.generate(**inputs, **gen)
    elapsed = time.perf_counter() - start
    width = inputs["input_ids"].shape[1]
    for prompt, row in zip(CHAT_PROMPTS, out.sequences):
        reply = tokenizer.decode(row[width:], skip_special_tokens=True).strip().replace("\n", " ")
        print(f"\n> {prompt[:70]}{'...' if len(prompt) > 70 else ''}\n  {reply}")
    # generate ran the rows through the continuous-batching engine; its metrics stay on the model.
    stats = model.hf_paged_last_metrics
    print(f"\nhf_paged: {len(CHAT_PROMPTS)} prompts, {max_new_tokens} new tokens, {elapsed:.2f}s, "
          f"{stats['num_steps']} forward steps")
    print(f"KV at its peak: {stats['kv_peak_blocks']} blocks of {stats['kv_block_size']} tokens "
          f"= {stats['kv_peak_bytes'] / 2**20:.2f} MiB; prefix cache served "
          f"{stats['vllm:prefix_cache_hits']} of {stats['vllm:prefix_cache_queries']} prompt tokens")
    if not verify:
        return True
    model.set_attn_implementation("sdpa")
    ref = model.generate(**inputs, **gen)
    dense = sum(t.numel() * t.element_size() for layer in ref.cache.layers for t in (layer.keys, layer.values))
    same = torch.equal(ref.sequences, out.sequences)
    print(f"stock DynamicCache for the same batch: {dense / 2**20:.2f} MiB "
          f"(paged uses {stats['kv_peak_bytes'] / dense:.0%} of it at its peak)")
    print(f"greedy tokens identical to stock transformers (sdpa + DynamicCache): {same}")
    return same
