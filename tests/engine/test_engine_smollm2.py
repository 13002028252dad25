"""Continuous batching on the real SmolLM2-135M-Instruct: 16 prompts of 20-600 tokens, each greedy output
token-identical to stock `generate` on that prompt alone, with a large pool, a pool small enough to
force many preemptions, and chunked prefill under a small token budget."""

from __future__ import annotations

import pytest
import torch

from hf_paged import Engine, SamplingParams
from hf_paged.defaults.models import load_default
from hf_paged.defaults.prompts import mixed_length_prompts

pytestmark = pytest.mark.slow

NUM_PROMPTS = 16
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def setup():
    model, tokenizer = load_default(dtype=torch.float32, attn_implementation="sdpa")
    prompts = mixed_length_prompts(tokenizer, NUM_PROMPTS, 20, 600, seed=1)
    lengths = [len(p) for p in prompts]
    assert min(lengths) < 60 and max(lengths) > 500  # really mixed
    stock = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        stock.append(out[0, len(p):].tolist())
    return model, tokenizer, prompts, stock


def _run(setup, **engine_kwargs):
    model, tokenizer, prompts, stock = setup
    engine = Engine(model, tokenizer, **engine_kwargs)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    mismatched = [i for i, (o, s) in enumerate(zip(outputs, stock)) if o.token_ids != s]
    assert not mismatched, f"prompts {mismatched} differ from stock generate"
    pool = engine.cache.pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    pool.check_invariants()
    return engine, outputs


def test_large_pool(setup):
    engine, outputs = _run(setup, max_num_seqs=16, max_num_batched_tokens=4096)
    metrics = engine.metrics()
    assert metrics["vllm:num_preemptions"] == 0
    assert metrics["vllm:prefix_cache_hits"] > 0  # the shared system prompt
    assert all(o.text is not None and o.finish_reason in ("stop", "length") for o in outputs)
    assert metrics["vllm:request_success"] == NUM_PROMPTS


def test_tiny_pool_preempts_many_times(setup):
    # 48 blocks of 16 (768 tokens): the longest request (~576 tokens) fits alone. A 256-token budget
    # admits requests one chunk at a time, so running prompts outgrow the pool and get preempted.
    engine, outputs = _run(setup, max_num_seqs=16, max_num_batched_tokens=256, num_blocks=48)
    assert engine.metrics()["vllm:num_preemptions"] >= 5
    assert sum(o.metrics.num_preemptions for o in outputs) == engine.metrics()["vllm:num_preemptions"]


def test_chunked_prefill(setup):
    engine, _ = _run(setup, max_num_seqs=16, max_num_batched_tokens=64)
    iteration_tokens = engine._metrics.iteration_tokens
    assert max(iteration_tokens) <= 64
    assert len(iteration_tokens) > sum(len(p) for p in setup[2]) / 64  # prompts really were chunked


def test_demo_matches_stock(capsys):
    from hf_paged.defaults.demo import run_demo

    assert run_demo(max_new_tokens=8)
    assert "greedy tokens identical to stock transformers (sdpa + DynamicCache): True" in capsys.readouterr().out
