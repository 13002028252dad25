"""hf_paged: a paged KV cache, prefix caching and paged attention for transformers.

Importing the package registers the "hf_paged" attention implementation, so

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_paged")
    model.generate(**inputs)          # uses a PagedCache automatically

is all a user changes.

Sub-packages, in dependency order (each imports only those before it; `config` is a leaf they all
may use; `planner` and `defaults` stand apart; the fronts `serve` and `disagg` never import each
other):

    core -> attention -> hf -> structured -> worker -> spec_decode -> engine -> integrations -> {serve, disagg}
"""

from .attention import ATTN_IMPLEMENTATION, paged_attention_forward
from .attention import register as _register_attention
from .config import PagedCacheConfig
from .core import NoFreeBlocksError
from .engine import AsyncEngine, Engine, EngineClosedError, RequestHandle, RequestOutput, StreamEvent
from .hf import PagedCache, attach, detach, invalidate
from .spec_decode import layer_skip_draft
from .sampling_params import SamplingParams
from .structured_outputs import StructuredOutputs

__version__ = "0.1.0"


def release(model) -> bool:
    """Free the KV pool and prefix cache that drop-in `model.generate` keeps for `model` across
    calls. Returns whether it held one."""
    from .integrations.batch_generate import release as _release

    return _release(model)


def register() -> None:
    """Register the "hf_paged" attention and mask functions and install the generate patch.
    Idempotent; runs on import."""
    from . import integrations

    _register_attention()
    integrations.install()


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
    "invalidate",
    "layer_skip_draft",
    "paged_attention_forward",
    "register",
    "release",
]
