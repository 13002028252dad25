"""A post-import hook: run a callback once a given module has been imported, without importing it.

`import hf_paged` must stay light (no torch, no transformers: `hf-paged --help` starts in well under a
second), yet `attn_implementation="hf_paged"` must work as soon as the user touches transformers' models.
`call_after_import("transformers.modeling_utils", register)` bridges the two: a `sys.meta_path` finder
that wraps the loaders of the watched packages' modules and, once the target has executed, runs the
callback when the outermost watched import in progress finishes. Waiting for that moment matters: at the
instant the target finishes, the module that imported it (a `transformers.pipelines` module, an hf_paged
module) may still be half-initialized, and a callback importing it would fail with a circular import.

A leaf: it imports nothing of hf_paged (the callback is handed in).
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable


class PostImportHook:
    """A `sys.meta_path` finder that calls `callback` once, after `target` is imported, then removes itself.

    Args:
        target: the module whose import triggers the callback ("transformers.modeling_utils").
        callback: called with no arguments; an exception it raises becomes a warning (the user's import
            goes on).
        watched: top-level packages whose imports are counted: the callback waits until none of them is
            mid-import in this thread.
    """

    def __init__(self, target: str, callback: Callable[[], None], watched: tuple[str, ...]):
        self.target = target
        self.callback = callback
        self.watched = watched
        self._local = threading.local()  # per thread: how many watched imports are executing
        self._lock = threading.Lock()
        self._pending = False  # the target has executed; the callback has not run yet
        self._done = False

    def install(self) -> None:
        """Put the finder first on `sys.meta_path` (idempotent)."""
        with self._lock:
            if not self._done and self not in sys.meta_path:
                sys.meta_path.insert(0, self)

    def remove(self) -> None:
        """Take the finder off `sys.meta_path`; the callback will not run from it any more."""
        with self._lock:
            self._done = True
            if self in sys.meta_path:
                sys.meta_path.remove(self)

    # The finder protocol: delegate to the finders after this one, then wrap the loader found.
    def find_spec(self, fullname: str, path=None, target=None):
        if self._done or fullname.partition(".")[0] not in self.watched:
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module") or isinstance(loader, _CountingLoader):
            return spec
        spec.loader = _CountingLoader(self, loader)
        return spec

    def invalidate_caches(self) -> None:
        pass

    def began(self) -> None:
        """A watched module starts executing (its loader calls this)."""
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def finished(self, name: str, executed: bool) -> None:
        """A watched module finished executing; `executed`: without raising. Runs the callback when due."""
        self._local.depth -= 1
        if executed and name == self.target:
            self._pending = True
        if self._local.depth or not self._pending:
            return
        with self._lock:
            if self._done:
                return
            self._done = True  # before the callback: whatever it imports is not watched any more
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        try:
            self.callback()
        except Exception as exc:  # noqa: BLE001 - the user's import must not fail because of ours
            warnings.warn(f"hf_paged: the hook after importing {self.target} failed: {type(exc).__name__}: {exc}",
                          RuntimeWarning, stacklevel=2)


class _CountingLoader:
    """Wraps a module's loader: counts the import as in progress while the module executes."""

    def __init__(self, hook: PostImportHook, loader):
        self._hook = hook
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._hook.began()
        executed = False
        try:
            self._loader.exec_module(module)
            executed = True
        finally:
            # The module keeps its own loader (inspect, importlib.resources and reload read it).
            module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None and module.__spec__.loader is self:
                module.__spec__.loader = self._loader
            self._hook.finished(module.__name__, executed)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def call_after_import(target: str, callback: Callable[[], None], watched: tuple[str, ...]) -> PostImportHook:
    """Run `callback` once `target` has been imported (see `PostImportHook`); the hook, installed.

    The caller handles the case where `target` is already in `sys.modules` (the hook then never fires).
    """
    hook = PostImportHook(target, callback, watched)
    hook.install()
    return hook
