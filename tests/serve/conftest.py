"""A servable model folder: a tiny random Llama with SmolLM2's tokenizer, saved as users serve one."""

import pytest
import torch


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_paged.defaults.models import load_default_tokenizer

    tok = load_default_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked: greedy text that is not one repeated token
    path = tmp_path_factory.mktemp("served")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def served_default():
    """`hf-paged serve default` (SmolLM2-135M-Instruct, served as "tiny", context 2048, at most 96 tokens an
    answer), started once for the tests that need a real model's answers (structured outputs, tools)."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("openai")
    from served import Served

    s = Served("default", "--max-model-len", "2048", "--max-tokens", "96")
    yield s
    assert s.stop() == 0
