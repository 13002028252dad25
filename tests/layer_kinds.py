"""What the tests of the newer layer kinds share (issue 54: Llama 4's chunked attention, Gemma 3n/4's
layers reusing another layer's K/V, a Gemma 4 assistant drafting from its target's K/V): the tiny
Gemma text config, prompt rows, left-padded batches and stock's greedy tokens per prompt alone."""

from __future__ import annotations

import torch

from tiny_models import VOCAB

# A tiny Gemma 3n / Gemma 4 text model: sliding (window 8) and full layers alternating over 6 layers, the
# last 2 reusing the K/V of layers 2 and 3.
GEMMA_WINDOW = 8
GEMMA_TEXT = dict(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, hidden_size_per_layer_input=8,
                  intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, sliding_window=GEMMA_WINDOW, layer_types=["sliding_attention", "full_attention"] * 3,
                  num_kv_shared_layers=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
# Gemma 4's per-layer K/V shapes on its full layers: 1 KV head of 64, keys doubling as values.
GEMMA4_FULL_LAYERS = dict(global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True)


def random_rows(lengths, seed: int = 0, prefix=()) -> list[list[int]]:
    """Prompts of the given lengths (ids 3 .. VOCAB-1), each after `prefix`."""
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def left_padded(rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of `rows` left-padded with id 0."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row):], mask[r, width - len(row):] = torch.tensor(row), 1
    return ids, mask


def greedy_alone(stock, prompts, new_tokens: int) -> list[list[int]]:
    """Stock's greedy `new_tokens` for each prompt run alone."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = stock.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens)
        outs.append(out[0, len(p):].tolist())
    return outs


def engine_scenario(stock, paged, block_size: int, new_tokens: int, others=(7, 61)) -> dict:
    """The issue's engine check: prefill in chunks of 16 tokens, a pool 4 blocks above the longest
    request's need (requests preempt one another), n-gram speculation (k = 3), and a prompt sharing a
    48-token prefix with an earlier one (and prompts of `others` tokens); asserts every request's greedy
    tokens are stock's alone and
    that nothing leaks. Returns the figures: tokens the second request was served from the cache,
    preemptions, drafts and accepted drafts."""
    from hf_paged import Engine, SamplingParams
    from hf_paged.hf import PagedCache

    shared = random_rows([48], seed=2)[0]
    prompts = random_rows([5, 30], seed=3, prefix=shared) + random_rows(list(others), seed=4)
    expected = greedy_alone(stock, prompts, new_tokens)
    longest = max(map(len, prompts)) + new_tokens
    tight = PagedCache(paged.config, block_size=block_size).manager.max_blocks_for(longest, 16) + 4
    engine = Engine(paged, block_size=block_size, num_blocks=tight, max_num_batched_tokens=16,
                    speculative_method="ngram", num_speculative_tokens=3)
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    outs = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
    assert [o.token_ids for o in outs] == expected
    assert max(engine._metrics.iteration_tokens) <= 16
    pool = engine.cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    metrics = engine.metrics()
    return {"num_blocks": tight, "cached_tokens": outs[1].metrics.num_cached_tokens,
            "preemptions": metrics["vllm:num_preemptions"], "drafts": metrics["vllm:spec_decode_num_draft_tokens"],
            "accepted": metrics["vllm:spec_decode_num_accepted_tokens"]}


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: "w<id>" is id <id> (pad w0, bos w1, eos w2), for
    pipelines over the tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w1", eos_token="w2", pad_token="w0",
                                   unk_token="w3", padding_side="left")
