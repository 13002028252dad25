"""A merged transformers `GenerationConfig` -> the engine's `SamplingParams`, field by field.

`model.generate(...)` applies defaults the caller never typed: the model's `generation_config`,
then transformers' global defaults (`top_k=50`, `temperature=1.0`, `max_length=20`...), then the
call's keyword arguments. `merged_generation_config` runs transformers' own merge (and, given the
prompts, stock's length preparation: a default `max_length` means 20 *new* tokens, `min_new_tokens`
takes precedence over `min_length`), so the engine sees exactly what stock would use.
`sampling_params_from` then maps every field: a field the engine honours is translated, a field that
only has an effect when set must hold its neutral value, and anything else (an unknown field, a
processor the engine does not have, a value stock would reject) makes it return the reason it cannot
serve the call, so `generate` falls back to stock transformers instead of sampling from a different
distribution (or raising a different error).

Honoured beyond greedy / temperature / top-k / top-p / repetition penalty / min and max lengths:

* `min_p` (a warper: applied only with `do_sample`, as stock does), `no_repeat_ngram_size`,
  `bad_words_ids` (a lone end-of-sequence id is never banned, as in stock),
* `sequence_bias` whose every key is one token (-> `SamplingParams.logit_bias`; a multi-token key
  falls back: its bias depends on the sequence so far),
* `num_return_sequences` with `do_sample` (-> `SamplingParams.n`; stock itself rejects it for greedy
  decoding and for assisted generation, so those calls go to stock and raise its error),
* `output_scores` / `output_logits` with `return_dict_in_generate` (the engine keeps the processed /
  raw row of every generated token; `batch_generate` completes the steps stock computes for rows
  that had already finished).
"""

from __future__ import annotations

import copy
import math

import torch
from transformers import GenerationConfig

from ..config import MAX_SPECULATIVE_TOKENS
from ..engine.inputs import as_token_id_list
from ..sampling_params import SAMPLING_EPS, SamplingParams

# Fields mapped onto SamplingParams / the engine's call (see `sampling_params_from`).
HONOURED = frozenset({
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "min_p", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "eos_token_id",
    "pad_token_id", "num_beams", "num_return_sequences", "use_cache", "return_dict_in_generate", "output_scores",
    "output_logits", "prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens",
})
# Fields that change the output only away from these values; the engine serves only these values.
NEUTRAL: dict[str, tuple] = {
    "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "top_h": (None,), "encoder_no_repeat_ngram_size": (None, 0),
    "renormalize_logits": (None, False), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "token_healing": (None, False), "guidance_scale": (None, 1.0),
    "watermarking_config": (None,), "output_attentions": (None, False),
    "output_hidden_states": (None, False),
    "encoder_repetition_penalty": (None, 1.0), "low_memory": (None,), "penalty_alpha": (None,),
    "dola_layers": (None,), "diversity_penalty": (None, 0.0), "num_beam_groups": (None, 1), "constraints": (None,),
    "force_words_ids": (None,), "cache_implementation": (None, "dynamic"), "prefill_chunk_size": (None,),
    "continuous_batching_config": (None,), "use_mtp": (None, False), "speculation_type": (None,),
    "assistant_early_exit": (None,), "is_assistant": (None, False),
}
# Fields without an effect on a decoder-only, single-beam, greedy or sampling generation.
IGNORED = frozenset({
    "early_stopping", "length_penalty", "bos_token_id", "decoder_start_token_id", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "assistant_ensemble_weight",
    "cache_config", "max_cache_len", "compile_config", "disable_compile", "transformers_version",
    "_from_model_config", "generation_kwargs",
    # Served by stock's own criteria, called step by step on the engine's rows (`batch_generate`).
    "stop_strings", "max_time",
})


def merged_generation_config(model, generation_config: GenerationConfig | None, kwargs: dict,
                             input_ids: torch.Tensor | None = None) -> GenerationConfig:
    """The config stock `generate` would run with: transformers' own merge of `generation_config`
    (or the model's), its global defaults and the call's keyword arguments. With `input_ids` (the
    prompts, padding included), also stock's length preparation (`_prepare_generated_length`): a
    `max_length` nobody set becomes 20 new tokens (capped by `max_position_embeddings`), and
    `min_new_tokens` overrides `min_length`. Raises what stock's merge raises (e.g. greedy
    `num_return_sequences > 1`)."""
    has_default = {
        name: kwargs.get(name) is None
        and (generation_config is None or getattr(generation_config, name) is None)
        and getattr(model.generation_config, name, None) is None
        for name in ("max_length", "min_length")
    }
    gc, _ = model._prepare_generation_config(copy.deepcopy(generation_config), **kwargs)
    if input_ids is not None:
        gc = model._prepare_generated_length(
            generation_config=gc, has_default_max_length=has_default["max_length"],
            has_default_min_length=has_default["min_length"], model_input_name="input_ids",
            input_ids_length=input_ids.shape[1], inputs_tensor=input_ids,
        )
    return gc


def sampling_params_from(gc: GenerationConfig, input_width: int, vocab_size: int | None = None) -> SamplingParams | str:
    """`SamplingParams` for a merged config whose prompts are `input_width` columns wide (padding
    included, as stock counts `max_length` / `min_length`), or the reason the engine cannot honour it.
    With `vocab_size`, token ids stock would reject (`bad_words_ids`, `sequence_bias`) are a reason too.
    """
    for name, value in gc.to_dict().items():
        if name in HONOURED or name in IGNORED:
            continue
        if name in NEUTRAL:
            if not any(value is v or value == v for v in NEUTRAL[name]):
                return f"generation_config.{name}={value!r} is not supported by the engine"
        elif value not in (None, False):
            return f"unknown generation_config field {name}={value!r}"
    if (gc.num_beams or 1) != 1:
        return "beam search"
    n = gc.num_return_sequences if gc.num_return_sequences is not None else 1
    if not _is_int(n) or n < 1:
        return f"num_return_sequences={n!r}"
    if n > 1 and not gc.do_sample:
        return "greedy num_return_sequences > 1 (stock rejects it)"
    if n > 1 and gc.prompt_lookup_num_tokens is not None:
        return "num_return_sequences > 1 with assisted generation (stock rejects it)"
    if gc.use_cache is False:
        return "use_cache=False"
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 20) - input_width
    if max_new < 1:
        return "no room to generate within max_length"  # stock reports this its own way
    # Stock: `min_new_tokens` takes precedence over `min_length` (it rewrites min_length to match).
    if gc.min_new_tokens is not None:
        min_new = gc.min_new_tokens
    else:
        min_new = max(0, (gc.min_length or 0) - input_width)
    min_p = 0.0
    if gc.do_sample:
        if gc.temperature is not None and gc.temperature <= 0:
            return f"do_sample with temperature={gc.temperature}"
        temperature = float(gc.temperature if gc.temperature is not None else 1.0)
        if temperature < SAMPLING_EPS:
            # The engine would decode greedily (its rule for tiny temperatures); stock samples from
            # logits / temperature (or, where that overflows, from NaNs): its scores and its draws differ.
            return f"do_sample with temperature={gc.temperature} (below {SAMPLING_EPS:g}, greedy in the engine)"
        top_k, top_p = int(gc.top_k or 0), float(gc.top_p if gc.top_p is not None else 1.0)
        if gc.min_p is not None:  # stock's MinPLogitsWarper (a warper: sampling only)
            if not _is_number(gc.min_p) or not 0 <= gc.min_p <= 1:
                return f"min_p={gc.min_p!r}"
            min_p = float(gc.min_p)
    else:
        temperature, top_k, top_p = 0.0, 0, 1.0  # stock applies no warper when it does not sample
    no_repeat = gc.no_repeat_ngram_size
    if no_repeat is None or (_is_number(no_repeat) and no_repeat <= 0):
        no_repeat = 0  # stock adds the processor only for a size > 0
    elif not _is_int(no_repeat):
        return f"no_repeat_ngram_size={no_repeat!r}"  # stock's processor rejects it
    bad_words = gc.bad_words_ids
    if bad_words is not None and not _valid_bad_words(bad_words, vocab_size):
        return f"bad_words_ids={bad_words!r}"  # stock's processor rejects it
    logit_bias = None
    if gc.sequence_bias is not None:
        logit_bias = _single_token_bias(gc.sequence_bias, vocab_size)
        if isinstance(logit_bias, str):
            return logit_bias
    params = SamplingParams(
        max_new_tokens=max_new, min_new_tokens=min(min_new, max_new), temperature=temperature, top_k=top_k,
        top_p=top_p, min_p=min_p,
        repetition_penalty=float(gc.repetition_penalty if gc.repetition_penalty is not None else 1.0),
        n=n, logit_bias=logit_bias, bad_words_ids=[list(w) for w in bad_words] if bad_words else None,
        no_repeat_ngram_size=int(no_repeat),
        output_scores=bool(gc.return_dict_in_generate and gc.output_scores),
        output_logits=bool(gc.return_dict_in_generate and gc.output_logits),
    )
    try:
        params.validate(vocab_size)
    except (TypeError, ValueError) as exc:
        return f"invalid sampling settings: {exc}"
    return params


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _token_ok(t, vocab_size) -> bool:
    return _is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size)


def _valid_bad_words(bad_words, vocab_size) -> bool:
    """What stock's `NoBadWordsLogitsProcessor` accepts: a non-empty list of non-empty lists of
    in-vocabulary ids."""
    return (isinstance(bad_words, list) and len(bad_words) > 0
            and all(isinstance(w, list) and len(w) > 0 and all(_token_ok(t, vocab_size) for t in w)
                    for w in bad_words))


def _single_token_bias(sequence_bias, vocab_size) -> dict[int, float] | str:
    """`sequence_bias` (stock's dict `{(ids...): bias}` or list `[[ids, bias], ...]`) as a per-token
    bias, or the reason it cannot be one (a multi-token key, or a value stock rejects)."""
    if isinstance(sequence_bias, dict) and sequence_bias:
        if not all(isinstance(k, tuple) for k in sequence_bias):
            return f"sequence_bias={sequence_bias!r}"  # stock rejects non-tuple keys
        items = list(sequence_bias.items())
    elif isinstance(sequence_bias, list) and sequence_bias:
        if not all(isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[0], list) and isinstance(e[1], float)
                   for e in sequence_bias):
            return f"sequence_bias={sequence_bias!r}"  # stock wants [[ids], float] pairs
        items = [(tuple(ids), bias) for ids, bias in sequence_bias]
    else:
        return f"sequence_bias={sequence_bias!r}"
    bias: dict[int, float] = {}
    for ids, value in items:
        if len(ids) == 0 or not all(_token_ok(t, vocab_size) for t in ids):
            return f"sequence_bias={sequence_bias!r}"  # stock rejects it
        if len(ids) != 1:
            return f"sequence_bias with a multi-token key {ids!r} (its bias depends on the sequence so far)"
        if not _is_number(value) or not math.isfinite(value):
            return f"sequence_bias value {value!r}"
        bias[int(ids[0])] = float(value)  # a later duplicate wins, as in stock's dict
    return bias


def eos_token_ids_of(gc: GenerationConfig) -> list[int]:
    return as_token_id_list(gc.eos_token_id)


def speculative_kwargs(gc: GenerationConfig, assistant) -> dict:
    """Assisted generation (`assistant_model=`) and prompt lookup (`prompt_lookup_num_tokens=`) map onto
    the engine's speculative decoding, for any batch size; at most `MAX_SPECULATIVE_TOKENS` drafts per step."""
    if assistant is not None:
        k = gc.num_assistant_tokens if gc.num_assistant_tokens else 5
        return dict(draft_model=assistant, num_speculative_tokens=max(1, min(int(k), MAX_SPECULATIVE_TOKENS)))
    if gc.prompt_lookup_num_tokens:
        k = int(gc.prompt_lookup_num_tokens)
        return dict(speculative_method="ngram", num_speculative_tokens=max(1, min(k, MAX_SPECULATIVE_TOKENS)),
                    prompt_lookup_max=int(gc.max_matching_ngram_size or 2))
    return {}
