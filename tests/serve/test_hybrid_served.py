"""`hf-paged serve` on a model with recurrent layers (a tiny Qwen 3.5: gated delta-rule layers around full
attention, SmolLM2's tokenizer): the real openai client gets stock transformers' greedy text, streamed and
not, and a second prompt sharing a long prefix with the first is served from the prefix cache (its
attention blocks and the recurrent state checkpointed at that block boundary) with the same answer."""

from __future__ import annotations

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")

from served import Served  # noqa: E402

SYSTEM = ("You are a careful assistant. Answer in one short sentence, name your sources, and never guess. " * 3)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    from hf_paged.defaults.models import load_default_tokenizer

    tok = load_default_tokenizer()
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention"],
        max_position_embeddings=512, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked: greedy text that is not one repeated token
    path = tmp_path_factory.mktemp("hybrid")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _stock_text(model_dir, prompt: str, new_tokens: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_a_hybrid_model_is_served_as_stock_answers_and_a_shared_prefix_comes_from_the_cache(hybrid_dir):
    prompts = [SYSTEM + "What is the capital of France?", SYSTEM + "Who wrote Hamlet?"]
    expected = [_stock_text(hybrid_dir, p, 10) for p in prompts]
    server = Served(hybrid_dir, "--max-model-len", "512")
    try:
        client = server.client()
        first = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=10, temperature=0,
                                          extra_body={"min_tokens": 10})
        assert first.choices[0].text == expected[0]
        streamed = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=10, temperature=0,
                                             stream=True, extra_body={"min_tokens": 10})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected[1]
        metrics = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
        hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits")]
        assert hits and float(hits[0].split()[-1]) >= 48, hits  # the shared system prompt's full blocks
    finally:
        assert server.stop() == 0
