"""Answering `model.generate` calls from outside: the pipeline integration feeds a whole dataset to
the engine and then answers each of stock's per-batch `generate` calls from its results.

`generate.py`'s wrap of `GenerationMixin.generate` asks `current_answer()` first; `pipeline.py` sets
the answer with `intercept_generate`. Both import this module and not each other.
"""

from __future__ import annotations

import contextlib
import contextvars

# Inside `intercept_generate`: the function answering `generate` calls.
_answer: contextvars.ContextVar = contextvars.ContextVar("hf_paged_generate_intercept", default=None)


def current_answer():
    """The function answering `generate` calls in this thread or task, or None."""
    return _answer.get()


@contextlib.contextmanager
def intercept_generate(answer):
    """Within the block (this thread or task), a `model.generate(inputs, generation_config, *args,
    **kwargs)` call of any model (a wrapper such as PEFT's calls its base model's) returns
    `answer(model, inputs, generation_config, args, kwargs)` instead of generating; an answer of
    `NotImplemented` lets the call generate as usual (the pipeline integration uses it)."""
    token = _answer.set(answer)
    try:
        yield
    finally:
        _answer.reset(token)
