"""scripts/gpu_check.sh, the GPU issue's one-command device check, exercised where there is no GPU: its
summary folds stage results and test failures into one verdict, the bf16 parity rule accepts only
flips that a near-tie explains, and `--dry-run` runs every stage's CPU form to a summary (the CUDA
tests skipped with their reason, the kernel benchmark under the interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="{f}"
skipped="1" tests="3"><testcase classname="tests.a" name="test_ok"/><testcase classname="tests.a" name="test_skip">
<skipped message="needs a CUDA GPU"/></testcase><testcase classname="tests.a" name="test_bad">{fail}</testcase>
</testsuite></testsuites>"""


def _summary(tmp_path, failures: int, rcs=(0, 0, 0, 0)):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir(parents=True)
    out.mkdir(parents=True)
    stages = ["tune", "pytest", "kernels", "throughput"]
    (work / "stages").write_text("".join(f"{n} {rc} {i + 1}\n" for i, (n, rc) in enumerate(zip(stages, rcs))))
    fail = '<failure message="assert 1 == 2">trace</failure>' if failures else ""
    (work / "pytest.xml").write_text(JUNIT.format(f=failures, fail=fail))
    (work / "kernels.json").write_text(json.dumps({"verdicts": {"decode_pass": True, "prefill_pass": False}}))
    (work / "throughput.json").write_text(json.dumps({"verdicts": {"greedy/hf_paged": {"vs_generate_batch": 2.0}},
                                                      "dtype": "torch.bfloat16"}))
    (out / "env.log").write_text("python 3.12\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(work), str(out), "default"],
                          capture_output=True, text=True, timeout=60)
    return done.returncode, json.loads(done.stdout)


def test_summary_reports_every_stage_and_fails_on_a_failed_test_or_stage(tmp_path):
    rc, summary = _summary(tmp_path / "ok", failures=0)
    assert rc == 0
    assert summary["stages"]["kernels"] == {"rc": 0, "seconds": 3, "timed_out": False}
    assert summary["total_seconds"] == 10
    assert summary["pytest"]["passed"] == 2 and summary["pytest"]["skipped"] == 1
    assert summary["pytest"]["skip_reasons"] == {"needs a CUDA GPU": 1}
    assert summary["kernels"]["verdicts"]["prefill_pass"] is False
    assert summary["throughput"]["verdicts"]["greedy/hf_paged"]["vs_generate_batch"] == 2.0

    rc, summary = _summary(tmp_path / "failed", failures=1)
    assert rc == 1 and summary["pytest"]["failed"] == [{"test": "tests.a::test_bad", "failure": "assert 1 == 2"}]
    rc, summary = _summary(tmp_path / "timeout", failures=0, rcs=(0, 0, 124, 0))
    assert rc == 1 and summary["stages"]["kernels"]["timed_out"]


def _generated(rows: list[list[int]], logits: list[list[list[float]]]):
    return SimpleNamespace(sequences=torch.tensor(rows), logits=[torch.tensor(step) for step in logits])


def test_bf16_parity_accepts_only_flips_explained_by_a_near_tie():
    from attention.test_gpu_kernels import _assert_greedy_equal_up_to_near_ties

    # prompt width 1, two generated steps, vocab 3; stock's step-1 logits for row 1: token 2 at 5.0,
    # token 1 at 4.8 (a near-tie) and token 0 at 1.0
    step0 = [[0.0, 9.0, 0.0], [0.0, 9.0, 0.0]]
    step1 = [[0.0, 0.0, 9.0], [1.0, 4.8, 5.0]]
    ref = _generated([[7, 1, 2], [7, 1, 2]], [step0, step1])
    _assert_greedy_equal_up_to_near_ties(_generated([[7, 1, 2], [7, 1, 1]], []), ref, 1, gap=0.5)
    with pytest.raises(AssertionError, match="logit gap of 4.000"):
        _assert_greedy_equal_up_to_near_ties(_generated([[7, 1, 2], [7, 1, 0]], []), ref, 1, gap=0.5)
    with pytest.raises(AssertionError, match="rows equal"):  # two near-tie flips out of two rows
        _assert_greedy_equal_up_to_near_ties(_generated([[7, 1, 1], [7, 1, 1]], []),
                                             _generated([[7, 1, 2], [7, 1, 2]], [step0, [[1.0, 4.8, 5.0]] * 2]), 1,
                                             gap=0.5)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU form; a GPU runs the real thing")
def test_dry_run_runs_every_stage_to_a_summary(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    summary = json.loads((out / "summary.json").read_text())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert set(summary["stages"]) == {"tune", "pytest", "kernels", "throughput"}
    assert all(s["rc"] == 0 for s in summary["stages"].values()), summary["stages"]
    tests = summary["pytest"]
    assert tests["tests"] > 100 and tests["skipped"] == tests["tests"], tests  # every CUDA test, each skipped
    assert all("CUDA" in reason or "cuda" in reason for reason in tests["skip_reasons"]), tests["skip_reasons"]
    assert summary["kernels"]["device"].startswith("cpu (dry run") and len(summary["kernels"]["decode"]) == 4
    assert summary["throughput"]["skipped"] == "no CUDA GPU"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["env.log", "tune.log", "pytest.log", "kernels.log", "throughput.log", "summary.json", "tuned_configs.json"])
