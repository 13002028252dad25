"""Fine-tuning with evaluation by generation (`examples/finetune_eval.py`): with
attn_implementation="hf_paged" the training losses, the evaluation generations and their scores
equal sdpa's at every evaluation, and the evaluations' generate calls run on the engine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_eval.py"

pytestmark = pytest.mark.slow


def _example():
    spec = importlib.util.spec_from_file_location("finetune_eval", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_losses_and_evaluation_generations_equal_sdpa(tmp_path, engine_calls):
    pytest.importorskip("gguf")
    example = _example()
    stock = example.run("sdpa", steps=4, eval_every=2, output_dir=str(tmp_path / "sdpa"))
    assert engine_calls == []
    ours = example.run("hf_paged", steps=4, eval_every=2, output_dir=str(tmp_path / "paged"))
    assert engine_calls == [True, True]  # both evaluations' generate calls ran on the engine
    assert len(stock["losses"]) == 4 and len(stock["generations"]) == 2
    assert ours["generations"] == stock["generations"] and ours["scores"] == stock["scores"]
    for a, b in zip(stock["losses"] + stock["eval_losses"], ours["losses"] + ours["eval_losses"]):
        assert abs(a - b) <= 1e-6
    assert stock["generations"][0] != stock["generations"][1] or stock["losses"][0] != stock["losses"][-1]
