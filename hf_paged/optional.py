"""Optional packages, imported on first use with an error that names the extra providing them."""

from __future__ import annotations

import importlib

# package -> the hf_paged extra that installs it (pyproject.toml's optional-dependencies)
EXTRAS = {"datasets": "data", "trl": "train", "peft": "train", "lm_eval": "eval", "matplotlib": "plot",
          "fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve", "PIL": "serve",
          "xgrammar": "structured"}


def require(module: str, extra: str | None = None, what: str | None = None):
    """Import `module`, or raise ImportError saying which `pip install 'hf_paged[extra]'` provides it.

    Args:
        module: the import name ("datasets", "trl", "lm_eval").
        extra: the extra that provides it (default: `EXTRAS[module]`).
        what: the feature that needs it, for the message (default: the module's name).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = extra or EXTRAS.get(module.split(".")[0], "test")
        raise ImportError(f"{what or module} needs the `{module.split('.')[0]}` package: "
                          f"pip install 'hf_paged[{extra}]'") from exc
