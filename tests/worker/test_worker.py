"""The worker on its own: the sampler's logits processing against transformers' own processors,
and one packed forward of several sequences against stock forwards of each sequence alone."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged import PagedCache, PagedCacheConfig
from hf_paged.sampling_params import SamplingParams
from hf_paged.worker import Chunk, ModelRunner, SamplingState, processed_logits
from tiny_models import STOCK_ATTN, VOCAB, tiny_model

EOS = [2, 7]


def stock_processed(row, history, num_prompt, params: SamplingParams):
    """What transformers' `generate` turns the raw next-token logits into, for the same settings."""
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.min_new_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(num_prompt, params.min_new_tokens, EOS))
    if not params.is_greedy:
        processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
    return processors(torch.tensor([history]), row[None].clone())[0]


CASES = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(min_new_tokens=5),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.6, top_k=50, top_p=0.9, repetition_penalty=1.1, min_new_tokens=3),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-r{p.repetition_penalty}"
                         f"-min{p.min_new_tokens}")
@pytest.mark.parametrize("num_output", [0, 2, 8])
def test_processed_logits_match_transformers_processors(params, num_output):
    gen = torch.Generator().manual_seed(num_output)
    row = torch.randn(VOCAB, generator=gen) * 3
    history = torch.randint(0, VOCAB, (12 + num_output,), generator=gen).tolist()
    state = SamplingState(params=params, seed=0, token_ids=history, num_prompt_tokens=12,
                          end_token_ids=EOS)
    ours = processed_logits(row, state)
    ref = stock_processed(row, history, 12, params)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), "different tokens masked"
    finite = ~torch.isinf(ref)
    torch.testing.assert_close(ours[finite], ref[finite], atol=1e-6, rtol=1e-6)  # fp32 elementwise maths


def test_a_wrong_top_k_is_caught_by_the_same_comparison():
    params = SamplingParams(temperature=1.0, top_k=20)
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    state = SamplingState(params=SamplingParams(temperature=1.0, top_k=21), seed=0, token_ids=[3],
                          num_prompt_tokens=1, end_token_ids=EOS)
    assert not torch.equal(torch.isinf(processed_logits(row, state)), torch.isinf(stock_processed(row, [3], 1, params)))


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen2"])
def test_one_packed_forward_equals_each_sequence_alone(arch):
    """Three prompts of different lengths in one `[1, T]` forward (block size 4, so blocks are shared
    by nobody and tables are non-trivial); each one's last-position logits equal stock's."""
    model = tiny_model(arch, "hf_paged")
    stock = tiny_model(arch, STOCK_ATTN.get(arch, "sdpa"))
    cache = PagedCache(model.config, PagedCacheConfig(block_size=4, num_blocks=32))
    runner = ModelRunner(model, cache)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 13, 1)]
    chunks = []
    for prompt in prompts:
        seq = cache.kv.new_sequence()
        result = cache.manager.append_tokens(seq, prompt)
        chunks.append(Chunk(seq, 0, prompt, result.group_slots, 1))
    logits = runner.forward(chunks, [])
    assert logits.shape == (len(prompts), VOCAB)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = stock(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=1e-4)  # fp32, different kernels
