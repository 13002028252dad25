"""Folds gpu_check.sh's stage results into one JSON summary (printed): each stage's exit code and
seconds, the pytest counts with every failure's message, the kernel and throughput verdicts.
Exits 1 when a stage failed or a test failed, else 0.

    python scripts/gpu_summary.py WORK_DIR OUT_DIR MODEL
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def pytest_counts(path: Path) -> dict:
    if not path.exists():
        return {"missing": "no junit xml (the stage did not finish)"}
    root = ET.parse(path).getroot()
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
    work, out, model = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    stages = {}
    for line in (work / "stages").read_text().splitlines():
        name, rc, seconds = line.split()
        stages[name] = {"rc": int(rc), "seconds": int(seconds), "timed_out": int(rc) in (124, 137)}
    throughput = load(work / "throughput.json")
    summary = {
        "stages": stages,
        "total_seconds": sum(s["seconds"] for s in stages.values()),
        "model": model,
        "env": (out / "env.log").read_text().splitlines() if (out / "env.log").exists() else None,
        "pytest": pytest_counts(work / "pytest.xml"),
        "kernels": load(work / "kernels.json"),
        "throughput": {k: throughput[k] for k in ("verdicts", "methods", "device_name", "model", "dtype",
                                                   "useful_tokens", "gemm_peak_flops", "skipped", "missing", "partial")
                       if k in throughput},
        "tuned_configs": (out / "tuned_configs.json").exists(),
    }
    print(json.dumps(summary, indent=1, default=str))
    bad = any(s["rc"] != 0 for s in stages.values()) or summary["pytest"].get("failures") or \
        summary["pytest"].get("errors") or "missing" in summary["pytest"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
