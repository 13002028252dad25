"""Fine-tuning with evaluation by generation (`examples/finetune_eval.py`), by a callback and by
`Seq2SeqTrainer(predict_with_generate=True)`: with attn_implementation="hf_paged" the training
losses, the evaluation generations and their scores equal sdpa's at every evaluation, and the
evaluations' generate calls run on the engine."""

from __future__ import annotations

import pytest
from example_modules import load_example

pytestmark = pytest.mark.slow


def _example():
    return load_example("finetune_eval")


def test_training_losses_and_evaluation_generations_equal_sdpa(tmp_path, engine_calls):
    pytest.importorskip("gguf")
    example = _example()
    stock = example.run("sdpa", steps=2, eval_every=1, output_dir=str(tmp_path / "sdpa"))
    assert engine_calls == []
    ours = example.run("hf_paged", steps=2, eval_every=1, output_dir=str(tmp_path / "paged"))
    assert engine_calls == [True, True]  # both evaluations' generate calls ran on the engine
    assert len(stock["losses"]) == 2 and len(stock["generations"]) == 2
    assert ours["generations"] == stock["generations"] and ours["scores"] == stock["scores"]
    assert len(ours["losses"]) == len(stock["losses"]) and len(ours["eval_losses"]) == len(stock["eval_losses"])
    for a, b in zip(stock["losses"] + stock["eval_losses"], ours["losses"] + ours["eval_losses"]):
        assert abs(a - b) <= 1e-6
    assert stock["generations"][0] != stock["generations"][1] or stock["losses"][0] != stock["losses"][-1]


def test_seq2seq_trainer_predict_with_generate_equals_sdpa(tmp_path, engine_calls):
    """Seq2SeqTrainer hands `model.generate` its whole batch (`labels` and `synced_gpus=False` too):
    the engine still serves it."""
    pytest.importorskip("gguf")
    example = _example()
    stock = example.run("sdpa", steps=2, eval_every=1, output_dir=str(tmp_path / "sdpa"), style="seq2seq")
    assert engine_calls == []
    ours = example.run("hf_paged", steps=2, eval_every=1, output_dir=str(tmp_path / "paged"), style="seq2seq")
    assert engine_calls == [True, True]
    assert len(stock["generations"]) == 2 and len(stock["scores"]) == 2
    assert ours["generations"] == stock["generations"] and ours["scores"] == stock["scores"]
    assert len(ours["losses"]) == len(stock["losses"]) and len(ours["eval_losses"]) == len(stock["eval_losses"])
    for a, b in zip(stock["losses"] + stock["eval_losses"], ours["losses"] + ours["eval_losses"]):
        assert abs(a - b) <= 1e-6
    assert any(g for gens in stock["generations"] for g in gens)  # something was generated and compared
