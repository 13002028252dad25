"""`generate` for models loaded with `attn_implementation="hf_paged"`.

Four small wraps, all undone by `uninstall()`:

* `GenerationMixin.generate`: a plain batched call (greedy or sampling, `num_return_sequences`,
  `output_scores` / `output_logits`, a streamer; no beams, attentions or custom processors) runs
  through the continuous-batching `Engine` (`integrations.batch_generate`), returning what stock
  returns. A call for a static (compileable) cache runs stock generate with transformers' sdpa for
  that call (warned once). Any other call goes on to stock generate unchanged.
* `TextGenerationPipeline.get_iterator`: batches of a pipeline over such a model are queued in the
  engine ahead of its consumer, for continuous batching across batches (`integrations.pipeline`).
* `ContinuousMixin.generate_batch` (transformers' continuous-batching API, which TRL's GRPO can use):
  answered by the model's engine (`integrations.generate_batch`).
* `GenerationMixin._prepare_cache_for_generation` (private; transformers has no registry for cache
  classes): after it ran, a default `DynamicCache` is swapped for a `PagedCache`, and any
  `PagedCache` in play is attached (`hf_paged.hf.attach`).

The only module that patches transformers: checked against the installed version and the internals it
relies on (`hf_paged.transformers_api`), reversible.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref

import torch
from transformers import DynamicCache
from transformers.generation.utils import GenerationMixin

from ..config import PagedCacheConfig
from ..hf import PagedCache, attach
from ..hf import rope as hf_rope
from ..transformers_api import (ALLOW_UNTESTED_ENV, SUPPORTED_TRANSFORMERS, installed_version, is_supported_version,
                               untested_allowed)
from ..transformers_api import problems as api_problems
from .intercept import current_answer
from .returned_cache import ReturnedCache

logger = logging.getLogger(__name__)

_TARGET = "_prepare_cache_for_generation"
_original = None
_original_generate = None


def is_installed() -> bool:
    return _original is not None


def install() -> bool:
    """Wrap `_prepare_cache_for_generation` (and install the other wraps). Idempotent; returns whether
    the patch is active. Not installed, with one warning, on a transformers outside the supported range
    (unless `HF_PAGED_ALLOW_UNTESTED_TRANSFORMERS=1`) or whose internals no longer match
    `transformers_api.PRIVATE_API`: stock generate then serves every call."""
    global _original
    if _original is not None:
        return True
    low, high = SUPPORTED_TRANSFORMERS
    if not is_supported_version() and not untested_allowed():
        warnings.warn(
            f"hf_paged: transformers {installed_version()} is outside the tested range [{low}, {high}); "
            "generate will not pick a PagedCache automatically (pass cache=PagedCache(...) explicitly, or set "
            f"{ALLOW_UNTESTED_ENV}=1 to try the drop-in patch on it)",
            stacklevel=2,
        )
        return False
    if not is_supported_version():
        warnings.warn(f"hf_paged: transformers {installed_version()} is outside the tested range [{low}, {high}); "
                      f"{ALLOW_UNTESTED_ENV} is set, so the drop-in patch is installed anyway", stacklevel=2)
    broken = api_problems()
    if broken:
        warnings.warn(
            "hf_paged: the drop-in patch is not installed (stock generate serves every call): transformers' "
            "internals it relies on changed:\n  " + "\n  ".join(broken),
            stacklevel=2,
        )
        return False
    original = getattr(GenerationMixin, _TARGET)
    _original = original
    _install_generate()
    from . import generate_batch, load_check, pipeline

    pipeline.install()
    generate_batch.install()
    load_check.install()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        key = _cache_key(model_kwargs)
        cache = model_kwargs.get(key)
        if self.config._attn_implementation == "hf_paged" and type(cache) is DynamicCache and not getattr(
            cache, "_is_user_defined", False
        ):
            cache_config = getattr(self, "hf_paged_cache_config", None) or PagedCacheConfig()
            cache = PagedCache(self.config, cache_config)
            model_kwargs[key] = cache
        elif self.config._attn_implementation == "hf_paged" and getattr(cache, "is_compileable", False):
            raise ValueError(  # `generate` routes these calls to sdpa first: only a direct caller gets here
                f"attn_implementation='hf_paged' does not support compileable caches ({type(cache).__name__}, "
                f"cache_implementation={generation_config.cache_implementation!r}); use the default cache, or "
                "attn_implementation='sdpa' for static caches and torch.compile"
            )
        elif self.config._attn_implementation == "hf_paged" and cache is not None and not isinstance(cache, PagedCache):
            _warn_once(
                self,
                f"hf_paged: generate is using {type(cache).__name__} (cache_implementation="
                f"{generation_config.cache_implementation!r}), not a PagedCache; attention takes the dense path"
            )
        if isinstance(cache, PagedCache):
            attach(self)
            _check_fits(cache, generation_config)
        return result

    setattr(GenerationMixin, _TARGET, _prepare_cache_for_generation)
    return True


def _cache_key(model_kwargs: dict) -> str:
    """transformers 5.24 renamed `past_key_values` to `cache`; generate uses one or the other."""
    return "past_key_values" if "past_key_values" in model_kwargs else "cache"


def _install_generate() -> None:
    global _original_generate
    original_generate = GenerationMixin.generate
    _original_generate = original_generate

    @functools.wraps(original_generate)
    def generate(self, inputs=None, generation_config=None, *args, **kwargs):
        answer = current_answer()
        if answer is not None:
            result = answer(self, inputs, generation_config, args, kwargs)
            if result is not NotImplemented:
                return result
        if self.config._attn_implementation == "hf_paged" and wants_compileable_cache(self, generation_config, kwargs):
            return _generate_without_paging(self, original_generate, inputs, generation_config, *args, **kwargs)
        if self.config._attn_implementation == "hf_paged" and not args:
            from .batch_generate import try_engine_generate

            result = try_engine_generate(self, inputs, generation_config, kwargs)
            if result is not None:
                return result
        elif self.config._attn_implementation == "hf_paged":
            from .routing import POSITIONAL_ARGUMENTS, log_fallback

            log_fallback(self, POSITIONAL_ARGUMENTS)
        from ..spec_decode.shared_kv_drafter import is_shared_kv_drafter
        from .batch_generate import passed_cache

        if self.config._attn_implementation == "hf_paged" and passed_cache(kwargs) is None and \
                is_shared_kv_drafter(kwargs.get("assistant_model")):
            # Stock's Gemma 4 assistant reads the target's K/V as dense tensors (`shared_kv_states`), which a
            # PagedCache's layers do not return: stock's assisted path runs with transformers' attention.
            return _generate_without_paging(self, original_generate, inputs, generation_config, *args,
                                            reason="a Gemma 4 assistant_model outside the engine", **kwargs)
        if isinstance(passed_cache(kwargs), ReturnedCache):
            passed_cache(kwargs).to_dense()  # stock generate continues from what stock would have returned
        if self.config._attn_implementation == "hf_paged":
            length_rope = hf_rope.install(self)
            if length_rope is not None and not length_rope.recompute:
                # each row rotated for its own length, as stock rotates it run alone (a model that
                # recomputes at the threshold drops the whole batch's cache there: stock's batch rule)
                with hf_rope.per_row():
                    return original_generate(self, inputs, generation_config, *args, **kwargs)
        return original_generate(self, inputs, generation_config, *args, **kwargs)

    GenerationMixin.generate = generate


def wants_compileable_cache(model, generation_config, kwargs: dict) -> bool:
    """Whether this call asks for a static (compileable) cache: a `cache_implementation` such as
    "static", a compile config, or a cache object with `is_compileable` passed in."""
    for key in ("cache", "past_key_values"):
        if getattr(kwargs.get(key), "is_compileable", False):
            return True
    implementation = kwargs.get("cache_implementation")
    if implementation is None:
        gc = generation_config if generation_config is not None else getattr(model, "generation_config", None)
        implementation = getattr(gc, "cache_implementation", None)
    return implementation is not None and implementation not in ("dynamic", "dynamic_full", "paged")


def _generate_without_paging(model, original_generate, *args, reason: str = "a static (compileable) cache",
                             **kwargs):
    """Run stock generate for a static cache (and the `torch.compile` it enables) with transformers'
    own attention, sdpa (eager where the model has no sdpa), warned once: the paged kernels cannot
    read a fixed-shape cache (nor hand a Gemma 4 assistant dense K/V: `reason`). The model's attention
    is "hf_paged" again afterwards. While this call runs, other threads using the same model object
    see that attention too."""
    fallback = "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"
    _warn_once(model, f"hf_paged: {reason} turns paging off for this generate call; it runs "
               f"transformers' {fallback} attention")
    model.set_attn_implementation(fallback)
    try:
        return original_generate(model, *args, **kwargs)
    finally:
        model.set_attn_implementation("hf_paged")


def uninstall() -> None:
    """Restore transformers' original methods."""
    global _original, _original_generate
    if _original is not None:
        setattr(GenerationMixin, _TARGET, _original)
        _original = None
    if _original_generate is not None:
        GenerationMixin.generate = _original_generate
        _original_generate = None
    from . import generate_batch, load_check, pipeline

    pipeline.uninstall()
    generate_batch.uninstall()
    load_check.uninstall()


def _check_fits(cache: PagedCache, generation_config) -> None:
    """Fail before the first forward if one sequence of `max_length` can never fit a fixed pool (every
    KV group's table counted: a sliding-window or chunked model needs more blocks per token than one table)."""
    num_blocks, max_length = cache.cache_config.num_blocks, generation_config.max_length
    if num_blocks is not None and max_length is not None and cache.manager.max_blocks_for(max_length) > num_blocks:
        raise ValueError(
            f"num_blocks={num_blocks} cannot hold one sequence of max_length={max_length}: its "
            f"{len(cache.layout.groups)} KV group(s) need {cache.manager.max_blocks_for(max_length)} blocks of "
            f"{cache.block_size} tokens"
        )


# Per model, the warnings it has given: each once per model (a second model of the same kind warns
# again; the first never repeats itself).
_warned: "weakref.WeakKeyDictionary[torch.nn.Module, set[str]]" = weakref.WeakKeyDictionary()


def _warn_once(model, message: str) -> None:
    given = _warned.setdefault(model, set())
    if message not in given:
        given.add(message)
        warnings.warn(message, stacklevel=3)
