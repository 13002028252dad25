"""Builds the proposer an `Engine` was configured with, validating the speculative knobs.

Owns the mapping from user-facing options (`draft_model=`, `speculative_method=`,
`num_speculative_tokens=`, the n-gram sizes) to one proposer; the engine only calls its
`propose` / `free`. A Gemma 4 assistant as `draft_model` (a drafter that reads the target's K/V) gives
a `SharedKVDrafterProposer`; any other draft model a `DraftModelProposer` with its own pool.
"""

from __future__ import annotations

import torch

from ..config import MAX_SPECULATIVE_TOKENS, PagedCacheConfig
from ..hf import check_model_supported
from ..hf.support import layer_specs_of
from .draft_model import DraftModelProposer
from .ngram import NgramProposer
from .shared_kv_drafter import SharedKVDrafterProposer, is_shared_kv_drafter

DEFAULT_NUM_SPECULATIVE_TOKENS = 5
SPECULATIVE_METHODS = ("draft_model", "ngram")


def make_proposer(*, draft_model: torch.nn.Module | None, method: str | None, num_tokens: int | None,
                  lookup_min: int, lookup_max: int, target_num_blocks: int, max_num_seqs: int,
                  block_size: int, kv_cache_config: PagedCacheConfig | None = None,
                  target_model: torch.nn.Module | None = None, target_kv=None):
    """Returns `(proposer or None, num_speculative_tokens)`. A draft model's own KV pool stores K/V as
    the target's does (`kv_cache_config`'s dtype, quantisation scheme and rotation). A Gemma 4
    assistant has no pool: it reads `target_kv` (the target's `KVOwner`) and `target_model`'s embeddings.

    Raises:
        ValueError: inconsistent or out-of-range options, naming the one at fault.
    """
    if draft_model is not None and method not in (None, "draft_model"):
        raise ValueError(f"draft_model was given but speculative_method={method!r}; use 'draft_model'")
    method = "draft_model" if draft_model is not None else method
    if method is None:
        if num_tokens:
            raise ValueError("num_speculative_tokens needs draft_model= or speculative_method='ngram'")
        return None, 0
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_method must be 'draft_model', 'ngram' or None, got {method!r}")
    num_tokens = DEFAULT_NUM_SPECULATIVE_TOKENS if num_tokens is None else num_tokens
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                         f"got {num_tokens!r}")
    if method == "ngram":
        return NgramProposer(lookup_min, lookup_max), num_tokens
    if draft_model is None:
        raise ValueError("speculative_method='draft_model' needs draft_model=")
    if _has_state(draft_model):
        raise ValueError(
            f"a draft model with recurrent layers (model_type={draft_model.config.model_type!r}: Mamba or linear "
            "attention) is not supported: its drafts cannot be rolled back token by token; use a draft model with "
            "attention layers only, or speculative_method='ngram'")
    if is_shared_kv_drafter(draft_model):
        if target_model is None or target_kv is None:
            raise ValueError(f"a Gemma 4 assistant ({type(draft_model).__name__}) drafts from its target's K/V: "
                             "make_proposer needs target_model= and target_kv=")
        return SharedKVDrafterProposer(draft_model, target_model, target_kv), num_tokens
    check_model_supported(draft_model.config)
    # As many tokens as the target's pool, plus room for each running request's drafts.
    blocks = target_num_blocks + max_num_seqs * -(-num_tokens // block_size)
    kv = kv_cache_config or PagedCacheConfig()
    return DraftModelProposer(draft_model, num_blocks=blocks, block_size=block_size, kv_cache_dtype=kv.kv_cache_dtype,
                              kv_quant_scheme=kv.kv_quant_scheme, kv_quant_rotation=kv.kv_quant_rotation,
                              enable_hybrid_kv=kv.enable_hybrid_kv), num_tokens


def _has_state(model: torch.nn.Module) -> bool:
    """Whether `model`'s layers keep a per-sequence state (`kv_spec.LayerSpec.state`)."""
    try:
        return any(spec.state is not None for spec in layer_specs_of(model.config))
    except ValueError:
        return False

