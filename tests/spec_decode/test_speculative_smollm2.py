"""Lossless speculative decoding on the real SmolLM2-135M-Instruct: 10 prompts at batch 10, each
proposer and k in {1, 3, 5}, token-identical to stock greedy `generate` on each prompt alone;
including a draft that is always right (every draft accepted: the bonus-token path) and one that is
always wrong (none accepted)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_paged import Engine, SamplingParams
from hf_paged.defaults.models import load_default
from hf_paged.defaults.prompts import PASSAGE, mixed_length_prompts
from hf_paged.spec_decode import layer_skip_draft

pytestmark = pytest.mark.slow

NEW = 16


@pytest.fixture(scope="module")
def setup():
    model, tokenizer = load_default(dtype=torch.float32, attn_implementation="sdpa")
    chat = mixed_length_prompts(tokenizer, 6, 20, 200, seed=1)
    # Prompt-lookup-friendly: asked to repeat or edit a given text, the answer copies from the prompt.
    edits = [f"Repeat this sentence exactly: {PASSAGE[i * 80:(i + 1) * 80]}" for i in range(4)]
    lookup = [tokenizer.apply_chat_template([{"role": "user", "content": e}], add_generation_prompt=True)
              for e in edits]
    lookup = [ids if isinstance(ids, list) else ids["input_ids"] for ids in lookup]
    prompts = chat + lookup
    stock = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
        stock.append(out[0, len(p):].tolist())
    model.set_attn_implementation("hf_paged")
    return model, prompts, stock


def _check(setup, **engine_kwargs):
    model, prompts, stock = setup
    engine = Engine(model, max_num_seqs=10, **engine_kwargs)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
    bad = [i for i, (o, s) in enumerate(zip(outs, stock)) if o.token_ids != s]
    assert not bad, f"prompts {bad} differ from stock greedy"
    for pool in [engine.cache.pool] + ([engine.proposer.cache.pool] if hasattr(engine.proposer, "cache") else []):
        assert pool.num_free_blocks == pool.num_blocks
    return engine.metrics()


@pytest.mark.parametrize("k", [1, 5])  # the smallest draft and a long one
def test_prompt_lookup(setup, k):
    m = _check(setup, speculative_method="ngram", num_speculative_tokens=k)
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("k", [1, 5])  # the smallest draft and a long one
def test_layer_skip_draft(setup, k):
    m = _check(setup, draft_model=layer_skip_draft(setup[0], 12), num_speculative_tokens=k)
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0


def test_draft_always_right_takes_the_bonus_path(setup):
    m = _check(setup, draft_model=setup[0], num_speculative_tokens=3)
    assert m["alpha"] == 1.0
    assert m["tokens_per_target_forward"] > 3.0  # k + 1 = 4 except where a request runs out of room


def test_draft_always_wrong_accepts_nothing(setup):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=setup[0].config.vocab_size, hidden_size=32, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192)
    random_draft = AutoModelForCausalLM.from_config(config).eval()
    m = _check(setup, draft_model=random_draft, num_speculative_tokens=3)
    assert m["alpha"] < 0.05
