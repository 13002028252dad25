"""Command-line start-up: how long `hf-paged --help` and `hf-paged kv-size` take, wall clock, in a fresh
interpreter each run, beside what a user pays anyway.

Commands, run alternately `--runs` times each (alternating spreads a busy machine's noise over all of
them), then the median of each and its ratio to `python -c pass`:

* `python -c pass`: the interpreter alone.
* `hf-paged --help` and `hf-paged kv-size <reference config>`: the light commands (issue 53 asks < 1 s;
  they import neither torch nor transformers).
* `import transformers; from transformers import AttentionInterface`: the stock import every
  transformers user pays, and what `import hf_paged` cost before it became lazy.

    python benchmarks/cli_startup.py [--runs 5] [--config llama-3-8b]

Each command runs as `python -m hf_paged.cli ...` with this interpreter (what the `hf-paged` script
does, without depending on where it is installed).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE_CONFIGS = ROOT / "hf_paged" / "planner" / "reference_configs"


def commands(config: str) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "python -c pass": [py, "-c", "pass"],
        "hf-paged --help": [py, "-m", "hf_paged.cli", "--help"],
        f"hf-paged kv-size {Path(config).name}": [py, "-m", "hf_paged.cli", "kv-size", config],
        "import transformers + AttentionInterface": [
            py, "-c", "import transformers; from transformers import AttentionInterface"],
    }


def time_once(cmd: list[str]) -> float:
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-1000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--config", default=str(REFERENCE_CONFIGS / "llama-3-8b.json"),
                        help="the config kv-size reads (default: the bundled llama-3-8b.json)")
    args = parser.parse_args()
    cmds = commands(args.config)
    for cmd in cmds.values():  # warm the page cache and the .pyc files: not what a second run pays
        time_once(cmd)
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(args.runs):
        for name, cmd in cmds.items():
            times[name].append(time_once(cmd))
    base = statistics.median(times["python -c pass"])
    width = max(map(len, cmds))
    print(f"{'command':<{width}}  median s   min s   max s   x python")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<{width}}  {median:8.3f}  {min(values):6.3f}  {max(values):6.3f}  {median / base:8.1f}")
    stock = statistics.median(times["import transformers + AttentionInterface"])
    for name in list(cmds)[1:3]:
        print(f"{name}: {statistics.median(times[name]) / stock:.2f}x the stock transformers import")


if __name__ == "__main__":
    main()
