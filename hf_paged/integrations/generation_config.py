"""A merged transformers `GenerationConfig` -> the engine's `SamplingParams`, field by field.

`model.generate(...)` applies defaults the caller never typed: the model's `generation_config`,
then transformers' global defaults (`top_k=50`, `temperature=1.0`, `max_length=20`...), then the
call's keyword arguments. `merged_generation_config` runs transformers' own merge, so the engine
sees exactly what stock would use. `sampling_params_from` then maps every field: a field the engine
honours is translated, a field that only has an effect when set must hold its neutral value, and
anything else (an unknown field, a processor the engine does not have) makes it return the reason
it cannot serve the call, so `generate` falls back to stock transformers instead of sampling from a
different distribution.
"""

from __future__ import annotations

import copy

from transformers import GenerationConfig

from ..config import MAX_SPECULATIVE_TOKENS
from ..engine.inputs import as_token_id_list
from ..worker.sampling import SamplingParams

# Fields mapped onto SamplingParams / the engine's call (see `sampling_params_from`).
HONOURED = frozenset({
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "eos_token_id", "pad_token_id", "num_beams", "num_return_sequences", "use_cache",
    "return_dict_in_generate", "prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens",
})
# Fields that change the output only away from these values; the engine serves only these values.
NEUTRAL: dict[str, tuple] = {
    "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "min_p": (None,),
    "top_h": (None,), "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,), "renormalize_logits": (None, False), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "sequence_bias": (None,), "token_healing": (None, False), "guidance_scale": (None, 1.0),
    "watermarking_config": (None,), "stop_strings": (None,), "max_time": (None,), "output_attentions": (None, False),
    "output_hidden_states": (None, False), "output_scores": (None, False), "output_logits": (None, False),
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
})


def merged_generation_config(model, generation_config: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
    """The config stock `generate` would run with: transformers' own merge of `generation_config`
    (or the model's), its global defaults and the call's keyword arguments."""
    gc, _ = model._prepare_generation_config(copy.deepcopy(generation_config), **kwargs)
    return gc


def sampling_params_from(gc: GenerationConfig, input_width: int) -> SamplingParams | str:
    """`SamplingParams` for a merged config whose prompts are `input_width` columns wide (padding
    included, as stock counts `max_length` / `min_length`), or the reason the engine cannot honour it.
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
    if (gc.num_return_sequences or 1) != 1:
        return "num_return_sequences > 1"
    if gc.use_cache is False:
        return "use_cache=False"
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 20) - input_width
    if max_new < 1:
        return "no room to generate within max_length"  # stock reports this its own way
    min_new = max(gc.min_new_tokens or 0, (gc.min_length or 0) - input_width)
    if gc.do_sample:
        if gc.temperature is not None and gc.temperature <= 0:
            return f"do_sample with temperature={gc.temperature}"
        temperature = float(gc.temperature if gc.temperature is not None else 1.0)
        top_k, top_p = int(gc.top_k or 0), float(gc.top_p if gc.top_p is not None else 1.0)
    else:
        temperature, top_k, top_p = 0.0, 0, 1.0  # stock applies no warper when it does not sample
    params = SamplingParams(
        max_new_tokens=max_new, min_new_tokens=min(min_new, max_new), temperature=temperature, top_k=top_k,
        top_p=top_p, repetition_penalty=float(gc.repetition_penalty if gc.repetition_penalty is not None else 1.0),
    )
    try:
        params.validate()
    except (TypeError, ValueError) as exc:
        return f"invalid sampling settings: {exc}"
    return params


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
