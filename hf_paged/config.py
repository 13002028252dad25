"""User-facing knobs and the limits several layers must agree on, each defined once here.

This module is a leaf: it imports nothing from hf_paged (and no torch), so every sub-package, the
torch-free `core` included, can import it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Tokens per KV block unless configured otherwise (the cache, the engine, the draft pool, the CLIs).
DEFAULT_BLOCK_SIZE = 16
# Up to this many queries per sequence (decode, or a speculative verify step of k + 1 tokens) the
# attention takes its decode path: the Triton split-KV decode kernel, or the torch path's bucketed
# padded calls. Longer query runs (prefill chunks) take the prefill path.
MAX_DECODE_QUERY_LEN = 16
# k drafts are verified at k + 1 positions, which must stay on the decode path.
MAX_SPECULATIVE_TOKENS = MAX_DECODE_QUERY_LEN - 1

# "auto" stores K/V in the model's dtype; the others force a storage dtype.
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
# Quantized storage arrives with the quantized-KV work; named here so the error can say so.
PLANNED_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(frozen=True)
class PagedCacheConfig:
    """How a `PagedCache` lays out and sizes its block pool.

    Args:
        block_size: tokens per KV block. Waste is at most `block_size - 1` tokens per sequence.
        num_blocks: a fixed pool of this many blocks that never grows. Mutually exclusive with
            `max_kv_bytes`. When neither is set, the pool grows on demand without a ceiling.
        max_kv_bytes: a memory budget (bytes, all layers, K and V); the pool grows on demand up
            to it.
        kv_cache_dtype: storage dtype of K/V: "auto" (the model's), "float32", "float16" or
            "bfloat16".
        enable_prefix_caching: share full blocks whose token prefix (hash chain) is identical.
        cache_salt: mixed into every block hash so that caches which must not share K/V (other
            adapters, tenants) never do.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    max_kv_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    cache_salt: str | None = None

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.num_blocks is not None and (
            isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 1
        ):
            raise ValueError(f"num_blocks must be a positive integer or None, got {self.num_blocks!r}")
        if self.max_kv_bytes is not None and (not isinstance(self.max_kv_bytes, int) or self.max_kv_bytes < 1):
            raise ValueError(f"max_kv_bytes must be a positive integer or None, got {self.max_kv_bytes!r}")
        if self.num_blocks is not None and self.max_kv_bytes is not None:
            raise ValueError("set either num_blocks (a fixed pool) or max_kv_bytes (a growth budget), not both")
        if self.kv_cache_dtype in PLANNED_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} (quantized KV) is not supported yet; "
                f"use one of {SUPPORTED_KV_CACHE_DTYPES}"
            )
        if self.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; expected one of {SUPPORTED_KV_CACHE_DTYPES}"
            )


def check_pool_fits(num_blocks: int | None, block_size: int, max_length: int | None) -> None:
    """Raise ValueError if a fixed pool of `num_blocks` can never hold one sequence of `max_length`."""
    if num_blocks is not None and max_length is not None and num_blocks * block_size < max_length:
        raise ValueError(
            f"num_blocks={num_blocks} with block_size={block_size} holds {num_blocks * block_size} "
            f"tokens, too few for one sequence of max_length={max_length}"
        )
