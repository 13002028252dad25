"""lm-evaluation-harness's `hf` backend with `attn_implementation=hf_paged`: a local task (a JSON
dataset and YAML configs written by `examples/lm_eval_capitals.py`, offline) with a `generate_until`
and a `loglikelihood` (multiple-choice) metric scores exactly as with sdpa; the generate calls ran
on the engine; and `hf-paged lm-eval` runs lm-eval's own command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from example_modules import load_example

pytest.importorskip("lm_eval")
pytest.importorskip("gguf")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def example():
    return load_example("lm_eval_capitals")


@pytest.fixture(scope="module")
def task_dir(example, tmp_path_factory):
    return example.write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


LIMIT = 16  # documents per task: two generate batches of 8, 16 x 4 log-likelihoods


@pytest.fixture(scope="module")
def checkpoint():
    from hf_paged.defaults.models import ensure_default_checkpoint

    return ensure_default_checkpoint()


def test_scores_with_hf_paged_equal_sdpa(example, checkpoint, task_dir, engine_calls):
    stock = example.evaluate(checkpoint, task_dir, "sdpa", limit=LIMIT)
    assert engine_calls == []
    ours = example.evaluate(checkpoint, task_dir, "hf_paged", limit=LIMIT)
    assert len(engine_calls) == 2 and all(engine_calls)  # 16 generate_until requests, batches of 8
    assert example.scores(ours) == example.scores(stock)
    assert set(example.scores(stock)) == set(example.TASKS)
    gen_stock = [s["resps"] for s in stock["samples"]["hfp_capitals_gen"]]
    assert [s["resps"] for s in ours["samples"]["hfp_capitals_gen"]] == gen_stock
    assert any(r[0][0].strip() for r in gen_stock)  # something was generated
    assert len(ours["samples"]["hfp_capitals_mc"]) == len(stock["samples"]["hfp_capitals_mc"]) == LIMIT
    for a, b in zip(stock["samples"]["hfp_capitals_mc"], ours["samples"]["hfp_capitals_mc"]):
        assert len(a["resps"]) == len(b["resps"]) == 4
        for (la, _), (lb, _) in zip((r[0] for r in a["resps"]), (r[0] for r in b["resps"])):
            assert abs(la - lb) <= 1e-4 * max(1.0, abs(la))  # loglikelihoods: the dense path, fp32


def test_the_hf_paged_lm_eval_command_runs_lm_evals_cli(checkpoint, task_dir, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hf_paged.cli", "lm-eval", "--model", "hf", "--model_args",
           f"pretrained={checkpoint},attn_implementation=hf_paged,dtype=float32", "--tasks", "hfp_capitals_gen",
           "--include_path", str(task_dir), "--limit", "8", "--batch_size", "8", "--device", "cpu",
           "--output_path", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert len(results) == 1 and "hfp_capitals_gen" in results[0]["results"]
    assert "exact_match,none" in results[0]["results"]["hfp_capitals_gen"]
