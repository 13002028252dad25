"""Folds gpu_check.sh's stage results into one JSON summary (printed): each stage's exit code and
seconds (and whether an earlier call on the same machine ran it), the pytest counts of both pytest
stages with every failure's message, the kernel and throughput verdicts. Exits 1 when a stage or a
test failed, else 0.

    python scripts/gpu_summary.py WORK_DIR RESULTS_DIR OUT_DIR MODEL
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def pytest_counts(path: Path) -> dict:
    if not path.exists():
        return {"missing": f"no {path.name} (the stage did not run, or was killed before writing it)"}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        return {"missing": f"{path.name} is not valid XML: {exc}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed, skip_reasons = [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                failed.append({"test": name, tag: (node.get("message") or "")[:500]})
        node = case.find("skipped")
        if node is not None:
            reason = (node.get("message") or "")[:200]
            skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed[:40], "skip_reasons": skip_reasons}


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"missing": f"{path.name}: {exc}"}


def main() -> int:
    work, results, out, model = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    stages = {}
    for line in (work / "stages").read_text().splitlines():
        name, rc, seconds, *earlier = line.split()
        stages[name] = {"rc": int(rc), "seconds": int(seconds), "timed_out": int(rc) in (124, 130, 137),
                        "earlier_call": bool(earlier)}
    throughput = load(results / "throughput.json")
    tests = {name: pytest_counts(results / f"{name}.xml") for name in ("pytest-core", "pytest-matrix") if name in stages}
    summary = {
        "stages": stages,
        "total_seconds": sum(s["seconds"] for s in stages.values()),
        "model": model,
        "env": (out / "env.log").read_text().splitlines() if (out / "env.log").exists() else None,
        "pytest": tests,
        "kernels": load(results / "kernels.json") if "kernels" in stages else None,
        "throughput": {k: throughput[k] for k in ("verdicts", "methods", "device_name", "model", "dtype",
                                                   "useful_tokens", "gemm_peak_flops", "skipped", "missing", "partial")
                       if k in throughput} if "throughput" in stages else None,
        "tuned_configs": load(results / "tuned_configs.json").get("entries"),
    }
    print(json.dumps(summary, indent=1, default=str))
    bad = any(s["rc"] != 0 for s in stages.values()) or any(
        t.get("failures") or t.get("errors") or "missing" in t for t in tests.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
