"""Request inputs, checked before anything is queued: prompts as token ids, sampling parameters
per prompt, and the model's end-of-sequence ids.

Every function raises `ValueError` / `TypeError` naming the bad value; none touches the scheduler
or the cache, so a rejected request leaves no trace.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

import torch

from ..text import refuse_lone_surrogates
from ..sampling_params import SamplingParams


def prompt_token_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """One prompt (a string, a 1-D tensor or a list of ids) as a non-empty list of in-vocabulary ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError("a string prompt needs a tokenizer: pass tokenizer= to the Engine, or token ids")
        refuse_lone_surrogates(prompt, "the prompt")  # no tokenizer encodes one (fast ones raise a TypeError)
        ids = tokenizer(prompt)["input_ids"]
    elif torch.is_tensor(prompt):
        if prompt.dim() != 1:
            raise ValueError(f"a tensor prompt must be 1-D token ids, got shape {tuple(prompt.shape)}")
        ids = prompt.tolist()
    elif isinstance(prompt, SequenceABC):
        ids = list(prompt)
    else:
        raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
    if bad:
        raise TypeError(f"prompt token ids must be ints, got {type(bad[0]).__name__} ({bad[0]!r})")
    oov = [t for t in ids if not 0 <= t < vocab_size]
    if oov:
        raise ValueError(f"prompt token ids {oov[:5]} are outside the model's vocabulary [0, {vocab_size})")
    return ids


def as_prompt_list(prompts) -> list:
    """One prompt or many, as a list of prompts."""
    if isinstance(prompts, (str, dict)) or torch.is_tensor(prompts):
        return [prompts]
    if isinstance(prompts, SequenceABC) and prompts and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompts
    ):
        return [list(prompts)]  # one prompt given as token ids
    if not isinstance(prompts, SequenceABC):
        raise TypeError(f"prompts must be a string, token ids, or a list of those; got {type(prompts).__name__}")
    return list(prompts)


def as_params_list(sampling_params, n: int) -> list:
    """One `SamplingParams` (or None) for all `n` prompts, or one per prompt."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; give one, or one per prompt")
    return params


def model_eos_token_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids: the generation config's, else the model config's, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return as_token_id_list(eos)


def as_token_id_list(ids) -> list[int]:
    """None, an int, a list/tuple or a tensor of ids, as a list of ints."""
    if ids is None:
        return []
    if torch.is_tensor(ids):
        ids = ids.tolist()
    return [int(e) for e in (ids if isinstance(ids, (list, tuple)) else [ids])]
