"""KV memory, measured: a padded batch stores only real tokens, in whole blocks."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from tiny_models import cache_of, left_padded_batch, tiny_model

LENGTHS = [3, 17, 40, 100, 64]
NEW_TOKENS = 8


def dynamic_cache_bytes(cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_padded_batch_kv_bytes(block_size):
    input_ids, attention_mask = left_padded_batch(LENGTHS)
    model = tiny_model("llama")
    stock = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
    model.set_attn_implementation("hf_paged")
    model.hf_paged_use_engine = False  # this measures generate's PagedCache (the engine returns no cache)
    model.hf_paged_cache_config = hf_paged.PagedCacheConfig(block_size=block_size)
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, stock.sequences)
    stats = cache_of(out).stats()
    stored = [n + NEW_TOKENS - 1 for n in LENGTHS]  # the last sampled token has no K/V yet
    assert stats["num_tokens"] == sum(stored)
    real_bytes = stats["num_tokens"] * stats["bytes_per_token"]
    # Waste is below one block per sequence, so bytes <= (1 + block_size / len) x real bytes.
    assert stats["kv_bytes"] <= (1 + block_size / min(stored)) * real_bytes
    assert stats["kv_bytes"] - real_bytes <= len(LENGTHS) * (block_size - 1) * stats["bytes_per_token"]
    dense = dynamic_cache_bytes(cache_of(stock))
    assert dense == len(LENGTHS) * (max(LENGTHS) + NEW_TOKENS - 1) * stats["bytes_per_token"]
    assert stats["kv_bytes"] < dense
