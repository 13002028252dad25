"""Running a fresh Python offline for a test: every name lookup and connection beyond loopback is logged
to a file and refused (`offline_guard/sitecustomize.py`), HF_HUB_OFFLINE and USE_HUB_KERNELS unset, so
what the installed transformers does by default is what the test sees."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

GUARD = pathlib.Path(__file__).resolve().parent / "offline_guard"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def offline_env(log: pathlib.Path) -> dict:
    """The environment's variables for an offline run that logs its attempts to `log`."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                            "USE_HUB_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(GUARD), env.get("PYTHONPATH")]))
    env["HF_PAGED_NETWORK_LOG"] = str(log)
    return env


def run_offline(code: str, log: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=offline_env(log),
                          capture_output=True, text=True, timeout=600)
