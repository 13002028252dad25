"""Small, version-guarded, reversible hooks into transformers. Each patch checks the installed version
against the range it was written and tested for, and refuses (with one warning) outside it."""

from .generate import SUPPORTED_TRANSFORMERS, install, is_installed, uninstall

__all__ = ["SUPPORTED_TRANSFORMERS", "install", "is_installed", "uninstall"]
