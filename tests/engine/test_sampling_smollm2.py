"""Sampling on the real SmolLM2-135M-Instruct (49,152 tokens): n samples with the throughput
benchmark's settings, each token's processed logprobs equal to transformers' processors applied to
stock's teacher-forced logits of the same sequence."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged import Engine, SamplingParams
from hf_paged.defaults.models import load_default

pytestmark = pytest.mark.slow


def test_sampled_logprobs_equal_stock_processed_distribution():
    model, tokenizer = load_default(dtype=torch.float32, attn_implementation="sdpa")
    stock_logits = lambda ids: model(torch.tensor([ids])).logits[0].float()  # noqa: E731
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                           add_generation_prompt=True, return_dict=False)
    settings = dict(temperature=0.8, top_p=0.95, top_k=50, repetition_penalty=1.1)
    params = SamplingParams(max_new_tokens=12, n=3, seed=0, logprobs=3, ignore_eos=True, **settings)
    engine = Engine(model, tokenizer)
    out = engine.generate(prompt, params)[0]
    assert len(out.outputs) == 3 and len({tuple(s.token_ids) for s in out.outputs}) > 1
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.1), TemperatureLogitsWarper(0.8),
                                      TopKLogitsWarper(50), TopPLogitsWarper(0.95)])
    for sample in out.outputs:
        seq = prompt + sample.token_ids
        with torch.no_grad():
            logits = stock_logits(seq)
        for t, entry in enumerate(sample.logprobs):
            history = torch.tensor([seq[: len(prompt) + t]])
            dist = processors(history, logits[len(prompt) + t - 1][None].clone())[0].log_softmax(-1)
            assert torch.isfinite(dist[entry.token_id])  # the token was one the processors keep
            assert entry.logprob == pytest.approx(dist[entry.token_id].item(), abs=1e-4)  # fp32, other kernels
