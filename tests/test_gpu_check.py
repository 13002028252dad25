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


def _summary(tmp_path, failures: int, rcs=(0, 0, 0, 0, 0)):
    work, results, out = tmp_path / "work", tmp_path / "results", tmp_path / "out"
    for folder in (work, results, out):
        folder.mkdir(parents=True)
    stages = ["tune", "kernels", "pytest-core", "pytest-matrix", "throughput"]
    lines = [f"{n} {rc} {i + 1}" + (" earlier" if n in ("tune", "kernels") else "")
             for i, (n, rc) in enumerate(zip(stages, rcs))]
    (work / "stages").write_text("\n".join(lines) + "\n")
    fail = '<failure message="assert 1 == 2">trace</failure>' if failures else ""
    (results / "pytest-core.xml").write_text(JUNIT.format(f=failures, fail=fail))
    (results / "pytest-matrix.xml").write_text(JUNIT.format(f=0, fail=""))
    (results / "kernels.json").write_text(json.dumps({"verdicts": {"decode_pass": True, "prefill_pass": False}}))
    (results / "throughput.json").write_text(json.dumps({"verdicts": {"greedy/hf_paged": {"vs_generate_batch": 2.0}},
                                                         "dtype": "torch.bfloat16"}))
    (results / "tuned_configs.json").write_text(json.dumps({"version": 1, "entries": [{"kernel": "paged_decode"}]}))
    (out / "env.log").write_text("python 3.12\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_summary.py"), str(work), str(results), str(out),
                           "default"], capture_output=True, text=True, timeout=60)
    return done.returncode, json.loads(done.stdout)


def test_summary_reports_every_stage_and_fails_on_a_failed_test_or_stage(tmp_path):
    rc, summary = _summary(tmp_path / "ok", failures=0)
    assert rc == 0
    assert summary["stages"]["kernels"] == {"rc": 0, "seconds": 2, "timed_out": False, "earlier_call": True}
    assert summary["stages"]["throughput"]["earlier_call"] is False
    assert summary["total_seconds"] == 15
    core = summary["pytest"]["pytest-core"]
    assert core["passed"] == 2 and core["skipped"] == 1 and core["skip_reasons"] == {"needs a CUDA GPU": 1}
    assert summary["kernels"]["verdicts"]["prefill_pass"] is False
    assert summary["throughput"]["verdicts"]["greedy/hf_paged"]["vs_generate_batch"] == 2.0
    assert summary["tuned_configs"] == [{"kernel": "paged_decode"}]

    rc, summary = _summary(tmp_path / "failed", failures=1)
    assert rc == 1
    assert summary["pytest"]["pytest-core"]["failed"] == [{"test": "tests.a::test_bad", "failure": "assert 1 == 2"}]
    rc, summary = _summary(tmp_path / "timeout", failures=0, rcs=(0, 124, 0, 0, 0))
    assert rc == 1 and summary["stages"]["kernels"]["timed_out"]


def _generated(rows: list[list[int]], logits: list[list[list[float]]]):
    return SimpleNamespace(sequences=torch.tensor(rows), logits=[torch.tensor(step) for step in logits])


def test_bf16_parity_accepts_only_flips_explained_by_a_near_tie():
    from tests.attention.test_gpu_kernels import _assert_greedy_equal_up_to_near_ties

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
    assert set(summary["stages"]) == {"tune", "kernels", "pytest-core", "pytest-matrix", "throughput"}
    assert all(s["rc"] == 0 and not s["earlier_call"] for s in summary["stages"].values()), summary["stages"]
    core, matrix = summary["pytest"]["pytest-core"], summary["pytest"]["pytest-matrix"]
    assert core["tests"] >= 10 and matrix["tests"] > 100  # every CUDA test collected, each skipped
    for tests in (core, matrix):
        assert tests["skipped"] == tests["tests"], tests
        assert all("CUDA" in reason for reason in tests["skip_reasons"]), tests["skip_reasons"]
    assert summary["kernels"]["device"].startswith("cpu (dry run") and len(summary["kernels"]["decode"]) == 4
    assert summary["throughput"]["skipped"] == "no CUDA GPU"
    assert sorted(p.name for p in out.iterdir()) == sorted(  # the device tool brings back at most 8 files
        ["env.log", "tune.log", "kernels.log", "pytest-core.log", "pytest-matrix.log", "throughput.log",
         "summary.json", "tuned_configs.json"])
