"""hf_paged's throughput at two commits, in one sitting: `benchmarks/throughput.py` (greedy, hf_paged
only, the default 64-request workload) alternately on a base commit and on this checkout, then the
median tokens/s of each and their ratio. For a change that must not slow the engine (a re-cut).

    python benchmarks/compare_commits.py --base HEAD~1 [--rounds 3] [--num-requests 64] [--threads N]

The base is checked out with `git worktree` into a temporary folder (removed afterwards) and run with
the same interpreter. Each run imports its own tree's `hf_paged`: `PYTHONPATH` alone is not enough,
since an editable install (`make setup`'s) maps `hf_paged` to this checkout through an import hook
that is asked before any path; the launcher below drops that hook, puts the tree first on the path
and checks which package it imported before it runs the tree's `benchmarks/throughput.py`. The order alternates per round
(base first, then this checkout first, ...), so a slow drift of the machine favours neither. Run it
with nothing else running: the figures are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# Runs `script` (argv[2]) with `tree`'s (argv[1]) hf_paged, whatever is installed; the rest is its argv.
LAUNCHER = """
import runpy, sys
from pathlib import Path
tree, script = Path(sys.argv[1]).resolve(), sys.argv[2]
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path.insert(0, str(tree))
import hf_paged
imported = Path(hf_paged.__file__).resolve()
if tree not in imported.parents:
    sys.exit(f"compare_commits: imported {imported}, not {tree}'s hf_paged")
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def run_once(tree: Path, args, out: Path) -> float:
    cmd = [sys.executable, "-c", LAUNCHER, str(tree), str(tree / "benchmarks" / "throughput.py"), "--modes", "greedy",
           "--skip", "static_bs8,static_bs32,generate_batch", "--num-requests", str(args.num_requests),
           "--json", str(out)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["methods"]["greedy/hf_paged"]["tokens_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare with (e.g. HEAD~1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), base_rev], cwd=ROOT, check=True)
        try:
            figures: dict[str, list[float]] = {"base": [], "this": []}
            for r in range(args.rounds):
                order = [("base", base_tree), ("this", ROOT)]
                for label, tree in order if r % 2 == 0 else order[::-1]:
                    tps = run_once(tree, args, Path(tmp) / f"{label}-{r}.json")
                    figures[label].append(tps)
                    print(f"round {r + 1} {label:>4} ({base_rev if label == 'base' else 'checkout'}): "
                          f"{tps:.1f} output tok/s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)
    base, this = statistics.median(figures["base"]), statistics.median(figures["this"])
    print(f"\nmedian tok/s: base {base_rev} {base:.1f}, this checkout {this:.1f}; ratio {this / base:.3f} "
          f"(runs: base {', '.join(f'{x:.1f}' for x in figures['base'])}; "
          f"this {', '.join(f'{x:.1f}' for x in figures['this'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
