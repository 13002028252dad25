"""hf_paged: a paged KV cache, prefix caching and paged attention for transformers.

Importing the package registers the "hf_paged" attention implementation, so

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_paged")
    model.generate(**inputs)          # uses a PagedCache automatically

is all a user changes.
"""

from .attention import ATTN_IMPLEMENTATION, paged_attention_forward
from .attention import register as _register_attention
from .block_pool import NoFreeBlocksError
from .cache import PagedCache
from .config import PagedCacheConfig
from .engine import Engine, RequestOutput, StreamEvent
from .hooks import attach, detach
from .sampling import SamplingParams
from .speculative import layer_skip_draft

__version__ = "0.1.0"


def register() -> None:
    """Register the "hf_paged" attention and mask functions and install the generate patch.
    Idempotent; runs on import."""
    from . import patches

    _register_attention()
    patches.install()


register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "Engine",
    "RequestOutput",
    "SamplingParams",
    "StreamEvent",
    "NoFreeBlocksError",
    "PagedCache",
    "PagedCacheConfig",
    "attach",
    "detach",
    "layer_skip_draft",
    "paged_attention_forward",
    "register",
]
