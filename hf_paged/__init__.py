"""hf_paged: a paged KV cache, prefix caching and paged attention for transformers.

After `import hf_paged`,

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_paged")
    model.generate(**inputs)          # uses a PagedCache automatically

is all a user changes.

`import hf_paged` itself imports neither torch nor transformers (the command line starts in a fraction
of a second). The "hf_paged" attention is registered, and the drop-in `generate` patch installed
(`register()`), at the first of: `import hf_paged` when transformers' models are already imported; the
moment `transformers.modeling_utils` is imported (a post-import hook, `import_hook.py`); the first use of
an export that needs torch (`hf_paged.Engine`, `hf_paged.PagedCache`, ...). The exports are resolved
on first access (PEP 562).

Sub-packages, in dependency order (each imports only those before it; `config` is a leaf they all
may use; `planner` and `defaults` stand apart; the fronts `serve` and `disagg` never import each
other):

    core -> attention -> hf -> structured -> worker -> spec_decode -> engine -> integrations -> {serve, disagg}
"""

import importlib
import importlib.util
import sys
import threading

from .import_hook import call_after_import

__version__ = "0.1.0"

# Export -> the module defining it (relative to the package), resolved on first access.
_EXPORTS = {
    "ATTN_IMPLEMENTATION": "attention",
    "paged_attention_forward": "attention",
    "PagedCacheConfig": "config",
    "NoFreeBlocksError": "core",
    "AsyncEngine": "engine",
    "Engine": "engine",
    "EngineClosedError": "engine",
    "RequestHandle": "engine",
    "RequestOutput": "engine",
    "StreamEvent": "engine",
    "PagedCache": "hf",
    "attach": "hf",
    "detach": "hf",
    "invalidate": "hf",
    "explain": "integrations.explain",
    "layer_skip_draft": "spec_decode",
    "SamplingParams": "sampling_params",
    "StructuredOutputs": "structured_outputs",
}
# Modules that import neither torch nor transformers: using their exports registers nothing.
_LIGHT = {"config", "core", "sampling_params", "structured_outputs"}
# Where registration becomes due: every transformers model class imports it before it can be built.
_TRIGGER = "transformers.modeling_utils"

_register_lock = threading.Lock()
_registering = threading.local()  # this thread is inside `register` (its imports reach `__getattr__`)


def register() -> None:
    """Register the "hf_paged" attention and mask functions with transformers and install the drop-in
    `generate` patch. Idempotent (a patch removed with `hf_paged.integrations.uninstall()` comes back);
    runs by itself when transformers' models are imported (see the module docstring)."""
    if getattr(_registering, "active", False):
        return
    with _register_lock:
        _registering.active = True
        try:
            _hook.remove()
            # import_module, not `from . import`: the hook may fire before the import system has bound a
            # just-executed sub-package as this package's attribute.
            attention = importlib.import_module(".attention", __name__)
            integrations = importlib.import_module(".integrations", __name__)
            attention.register()
            integrations.install()
        finally:
            _registering.active = False


def release(model) -> bool:
    """Free the KV pool and prefix cache that drop-in `model.generate` keeps for `model` across
    calls. Returns whether it held one."""
    from .integrations.batch_generate import release as _release

    return _release(model)


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is not None:
        value = getattr(importlib.import_module(f".{module_name}", __name__), name)
        if module_name.partition(".")[0] not in _LIGHT:
            register()  # whoever reaches for the engine or the cache gets the attention it serves
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # A sub-package read as an attribute after a bare `import hf_paged` (`hf_paged.integrations.uninstall()`),
        # as when `__init__` imported them all. Only imported: `from hf_paged import cli` must stay light, and
        # a sub-package that imports transformers' models registers through the hook.
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_hook = call_after_import(_TRIGGER, register, watched=("transformers", __name__))
if _TRIGGER in sys.modules:
    register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AsyncEngine",
    "Engine",
    "EngineClosedError",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "StreamEvent",
    "StructuredOutputs",
    "NoFreeBlocksError",
    "PagedCache",
    "PagedCacheConfig",
    "attach",
    "detach",
    "explain",
    "invalidate",
    "layer_skip_draft",
    "paged_attention_forward",
    "register",
    "release",
]
