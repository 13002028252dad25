"""Glue between hf_paged and the code people already run: transformers' `generate`.

* `generate.py`: the version-guarded, reversible patch of `GenerationMixin` (install/uninstall).
* `load_check.py`: the load-time refusal (in the same reversible patch) of a model whose attention
  does not go through transformers' attention interface.
* `batch_generate.py`: a plain batched `model.generate(...)` served by the `Engine`, returning
  exactly what stock returns, or None to fall back to stock.

The top of the dependency chain: it may use every other sub-package, and none imports it.
"""

from .generate import SUPPORTED_TRANSFORMERS, install, is_installed, is_supported_version, uninstall

__all__ = ["SUPPORTED_TRANSFORMERS", "install", "is_installed", "is_supported_version", "uninstall"]
