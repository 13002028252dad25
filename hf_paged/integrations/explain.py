"""`hf_paged.explain`: which path a `model.generate(...)` call would take, and why, without running it.

    >>> print(hf_paged.explain(model, **inputs, max_new_tokens=64, output_scores=True, streamer=streamer))
    Stock transformers generate serves this call, over a PagedCache: a streamer with output_scores or output_logits.

The drop-in `generate` (`generate.py`) serves a call by one of four paths, in this order:

* `"stock"`: stock transformers generate without a PagedCache. The model's attention is not
  "hf_paged" (hf_paged is not involved), the patch is not installed, or the call keeps a dense cache
  (one it passes, `use_cache=False`, an encoder-decoder's).
* `"stock+static_cache"`: the call asks for a static (compileable) cache; it runs transformers'
  sdpa (or eager) attention with that cache, paging off for the call.
* `"engine"`: hf_paged's continuous-batching `Engine` serves it (`batch_generate`).
* `"stock+paged_cache"`: stock generate, its K/V in a `PagedCache`, for a call the engine does not
  reproduce exactly (the reason is what `generate` logs at INFO, once per model).

The engine question is `routing.route`, the function `generate` itself asks, over the same merged
generation config: nothing runs, no forward and no engine.
"""

from __future__ import annotations

import dataclasses

from ..attention import ATTN_IMPLEMENTATION
from ..hf import PagedCache
from ..hf.support import attention_refusal, cached_kv_refusal, check_decoder_supported, cross_attention_refusal
from .routing import POSITIONAL_ARGUMENTS, EngineCall, Fallback, passed_cache, route

ENGINE = "engine"
STOCK_PAGED_CACHE = "stock+paged_cache"
STOCK_STATIC_CACHE = "stock+static_cache"
STOCK = "stock"
PATHS = (ENGINE, STOCK_PAGED_CACHE, STOCK_STATIC_CACHE, STOCK)

_HEADS = {
    ENGINE: "hf_paged's Engine serves this call",
    STOCK_PAGED_CACHE: "Stock transformers generate serves this call, over a PagedCache",
    STOCK_STATIC_CACHE: "Stock transformers generate serves this call with a static cache and transformers' own "
                        "attention",
    STOCK: "Stock transformers generate serves this call without a PagedCache",
}


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Which path a `generate` call takes (`explain`).

    Attributes:
        path: one of `PATHS`: "engine", "stock+paged_cache", "stock+static_cache" or "stock".
        reason: why. For a call the engine declines, the reason `generate` logs.
        note: what else bears on it (a later fallback the engine may still make, how to use hf_paged
            with a model that does not), or None.
    """

    path: str
    reason: str
    note: str | None = None

    def __str__(self) -> str:
        text = f"{_HEADS[self.path]}: {self.reason.rstrip('.')}."
        if self.note:
            text += f" {self.note[0].upper()}{self.note[1:].rstrip('.')}."
        return text


def explain(model, inputs=None, generation_config=None, *args, **kwargs) -> Explanation:
    """Which path `model.generate(inputs, generation_config, *args, **kwargs)` would take, and why.

    Takes exactly what `generate` takes; runs nothing (no forward, no engine) and logs nothing.

    Args:
        model: a transformers model, loaded with `attn_implementation="hf_paged"` or not.
        inputs, generation_config, *args, **kwargs: the `generate` call's arguments.

    Returns:
        An `Explanation`; `str()` of it reads as one or two sentences.
    """
    from .generate import is_installed, wants_compileable_cache

    if not is_installed():
        return Explanation(STOCK, "the drop-in patch is not installed (transformers outside the tested range, or "
                                  "internals it relies on changed)")
    attention = getattr(model.config, "_attn_implementation", None)
    if attention != ATTN_IMPLEMENTATION:
        return Explanation(STOCK, f"the model's attention is {attention!r}, not {ATTN_IMPLEMENTATION!r}, so hf_paged "
                                  "is not involved", _load_note(model))
    if wants_compileable_cache(model, generation_config, kwargs):
        return Explanation(STOCK_STATIC_CACHE, "the call asks for a static (compileable) cache, which paged attention "
                                               "cannot read, so paging is off for this call (sdpa attention, or eager "
                                               "where the model has no sdpa)")
    decision = Fallback(POSITIONAL_ARGUMENTS) if args else route(model, inputs, generation_config, kwargs)
    if isinstance(decision, EngineCall):
        return Explanation(ENGINE, _engine_reason(decision), _engine_note(decision))
    path, note = _stock_cache(model, kwargs.get("generation_config", generation_config), kwargs)
    return Explanation(path, decision.reason, note)


def _engine_reason(call: EngineCall) -> str:
    params, gc = call.params, call.gc
    mode = f"sampling {params.n} sequences per prompt" if params.n > 1 else "sampling" if gc.do_sample else "greedy"
    extras = [what for what, present in (
        ("fed step by step to its streamer or stopping criteria", call.is_stepwise),
        ("its logits processors in lockstep", call.processors is not None),
        ("with images", call.image_data is not None),
        ("continuing the cache passed in", call.passed is not None),
        ("returning a cache", call.retain and call.passed is None),
        ("with scores or logits", params.output_scores or params.output_logits),
        ("speculative (assistant model or prompt lookup)", bool(call.spec_kwargs())),
    ) if present]
    rows = f"{len(call.rows)} row{'s' if len(call.rows) != 1 else ''}"
    return (f"nothing in it needs stock generate ({rows}, {mode}, up to {params.max_new_tokens} new tokens"
            + "".join(f", {e}" for e in extras) + ")")


def _engine_note(call: EngineCall) -> str | None:
    """The fallbacks the engine may still make once it has run (`batch_generate`)."""
    if call.params.no_repeat_ngram_size >= 2 and any(len(r) < call.width for r in call.rows):
        return ("if a padded row's padding ids occur among its tokens, stock generate serves the call after the "
                "run (its n-gram processor would see the padding)")
    if call.image_data is not None:
        return "if its images cannot be split per row, stock generate serves it"
    return None


def _stock_cache(model, generation_config, kwargs: dict) -> tuple[str, str | None]:
    """The path of a call stock generate serves on an "hf_paged" model: over a PagedCache (the patch
    swaps one in for the default cache), or dense, and why."""
    if getattr(model.config, "is_encoder_decoder", False):
        return STOCK, "an encoder-decoder keeps transformers' own cache, and attention takes the dense path"
    passed = passed_cache(kwargs)
    if isinstance(passed, PagedCache):
        return STOCK_PAGED_CACHE, None
    if passed is not None:
        return STOCK, f"the {type(passed).__name__} it passes is kept, and attention takes the dense path"
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    if kwargs.get("use_cache", getattr(config, "use_cache", True)) is False:
        return STOCK, "without a cache, attention takes the dense path"
    return STOCK_PAGED_CACHE, None


def _load_note(model) -> str | None:
    """What loading `model` with the "hf_paged" attention would do: the load check's refusal, if any
    (`load_check`), else how to use hf_paged."""
    cls, config = type(model), model.config
    try:
        if not cls.can_generate():
            return None
        reason = (attention_refusal(cls, config) or cross_attention_refusal(config, include_decoder_flag=False)
                  or cached_kv_refusal(cls, config))
        if reason is None and not getattr(config, "is_encoder_decoder", False):
            check_decoder_supported(config, include_decoder_flag=False)
    except ValueError as exc:
        reason = str(exc)
    except Exception:  # noqa: BLE001 - a model these questions cannot read: say nothing about it
        return None
    if reason:
        return f"loading it with attn_implementation={ATTN_IMPLEMENTATION!r} is refused: {reason}"
    return f"load it with attn_implementation={ATTN_IMPLEMENTATION!r} to use hf_paged"
