"""End to end on CPU: a tiny model generates through the Triton kernels (forced, under Triton's
interpreter) and matches stock transformers token for token."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import hf_paged
from hf_paged.attention import dispatch
from tiny_models import cache_of, left_padded_batch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the Triton kernels under the interpreter (no CUDA)")
# fp32 end to end; the kernels accumulate in fp32 with another summation order than sdpa.
LOGITS_ATOL = 1e-4


def _model(cls, config_cls, **extra):
    torch.manual_seed(0)
    config = config_cls(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, pad_token_id=0, **extra)
    return cls(config).eval()


@pytest.mark.parametrize("name", ["llama", "qwen2_sliding"])
def test_generate_with_triton_kernels_matches_stock(name, monkeypatch):
    if name == "llama":
        model = _model(LlamaForCausalLM, LlamaConfig)
    else:
        model = _model(Qwen2ForCausalLM, Qwen2Config, use_sliding_window=True, sliding_window=6,
                       max_window_layers=0, layer_types=["sliding_attention", "sliding_attention"])
    input_ids, attention_mask = left_padded_batch([5, 23, 17], seed=1)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    ref = model.generate(input_ids, attention_mask=attention_mask, **kwargs)

    used = []
    for name_ in ("paged_decode", "flash_prefill"):
        module = __import__(f"hf_paged.attention.triton.{'decode' if 'decode' in name_ else 'prefill'}",
                            fromlist=[name_])
        original = getattr(module, name_)
        monkeypatch.setattr(module, name_, lambda *a, _o=original, _n=name_, **k: used.append(_n) or _o(*a, **k))
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    model.set_attn_implementation("hf_paged")
    model.hf_paged_use_engine = False  # the stock generate path over a PagedCache
    model.hf_paged_cache_config = hf_paged.PagedCacheConfig(block_size=16)
    out = model.generate(input_ids, attention_mask=attention_mask, **kwargs)

    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(b, a, atol=LOGITS_ATOL, rtol=0)
    # Prefill (q_len 23 > 16) went through flash_prefill, decode steps through paged_decode.
    layers = model.config.num_hidden_layers
    assert used.count("flash_prefill") == layers and used.count("paged_decode") == layers * 5
    assert dispatch.backend(torch.device("cpu")) == "triton"
    assert cache_of(out).stats()["num_tokens"] == 45 + 3 * 5


def test_hybrid_sliding_model_with_triton_kernels_matches_stock(monkeypatch):
    """Sliding and full layers keep their own block tables (the sliding one releases what leaves
    the window): the kernels read each layer's group tables, drop-in and in the engine's packed,
    chunked steps, over sequences longer than 3x the window."""
    model = _model(Qwen2ForCausalLM, Qwen2Config, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                   layer_types=["full_attention", "sliding_attention"])
    input_ids, attention_mask = left_padded_batch([5, 23, 19], seed=2)
    kwargs = dict(max_new_tokens=14, min_new_tokens=14, do_sample=False, return_dict_in_generate=True)
    ref = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    model.set_attn_implementation("hf_paged")
    model.hf_paged_use_engine = False
    model.hf_paged_cache_config = hf_paged.PagedCacheConfig(block_size=4)
    out = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    cache = cache_of(out)
    assert len(cache.layout.groups) == 2 and all(seq.num_released[1] > 0 for seq in cache.seqs)

    prompts = [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
    engine = hf_paged.Engine(model, block_size=4, max_num_batched_tokens=9)
    outs = engine.generate(prompts, hf_paged.SamplingParams(max_new_tokens=14, min_new_tokens=14))
    width = input_ids.shape[1]
    assert [o.token_ids for o in outs] == ref.sequences[:, width:].tolist()
