"""Drop-in batched `generate` through the continuous-batching `Engine`.

For a model with `attn_implementation="hf_paged"`, a plain

    model.generate(**tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt"), ...)

runs the rows as independent engine requests (no padding computed or stored, finished rows leave
the batch at once) and returns what stock transformers returns: the left-padded prompts followed by
the generated tokens, rows that ended early filled with `pad_token_id`, the same width. With
`return_dict_in_generate=True` it returns a `GenerateDecoderOnlyOutput` with `sequences` (there is no
per-call cache to return: `cache` is None). The engine's metrics of the call (KV peak, prefix hits,
speculation) are left in `model.hf_paged_last_metrics`.

Anything the engine does not reproduce exactly (beam search, assisted decoding, scores/logits/
attentions outputs, custom logits processors or stopping criteria, streamers, a cache passed in,
`inputs_embeds`, less common generation-config fields...) returns None from `try_engine_generate`,
and `generate` runs stock transformers with a `PagedCache` instead. Set
`model.hf_paged_use_engine = False` to always take that path.
"""

from __future__ import annotations

import copy
import warnings

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..config import MAX_SPECULATIVE_TOKENS, PagedCacheConfig, check_pool_fits
from ..engine import Engine
from ..engine.inputs import as_token_id_list
from ..worker.sampling import SamplingParams

# generate() keyword arguments the engine path understands; anything else falls back.
_MODEL_INPUTS = {"input_ids", "attention_mask"}
_CONFIG_KEYS = {
    "max_new_tokens", "min_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p",
    "repetition_penalty", "eos_token_id", "pad_token_id", "bos_token_id", "return_dict_in_generate", "use_cache",
    "num_beams", "num_return_sequences", "prompt_lookup_num_tokens", "num_assistant_tokens",
    "max_matching_ngram_size",
}
# Generation-config fields (as in `to_diff_dict`) whose non-default values the engine honours.
_SUPPORTED_DIFF = _CONFIG_KEYS | {"transformers_version", "_from_model_config", "max_length"}


def try_engine_generate(model, inputs, generation_config, kwargs: dict):
    """Run `model.generate(inputs, generation_config, **kwargs)` through an `Engine`, or return None
    when the call needs something only stock generate provides."""
    if not getattr(model, "hf_paged_use_engine", True) or getattr(model.config, "is_encoder_decoder", False):
        return None
    if set(kwargs) - _MODEL_INPUTS - _CONFIG_KEYS - {"generation_config", "assistant_model"}:
        return None
    assistant = kwargs.get("assistant_model")
    if assistant is not None and (not isinstance(assistant, torch.nn.Module)
                                  or getattr(assistant.config, "is_encoder_decoder", False)):
        return None
    input_ids = inputs if inputs is not None else kwargs.get("input_ids")
    if inputs is not None and "input_ids" in kwargs:
        return None
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype != torch.long or input_ids.shape[0] == 0:
        return None
    gc = _merged_config(model, generation_config, {k: v for k, v in kwargs.items() if k in _CONFIG_KEYS})
    if gc is None or (gc.num_beams or 1) != 1 or (gc.num_return_sequences or 1) != 1 or gc.use_cache is False:
        return None
    rows = _left_padded_rows(input_ids, kwargs.get("attention_mask"))
    if rows is None:
        return None
    width = input_ids.shape[1]
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 20) - width
    if max_new < 1:
        return None  # stock generate reports this case its own way
    eos_ids = as_token_id_list(gc.eos_token_id)
    pad = gc.pad_token_id
    if pad is None:
        if not eos_ids:
            return None
        pad = eos_ids[0]  # what stock generate does, with the same warning
        warnings.warn(f"Setting `pad_token_id` to `eos_token_id`:{pad} for open-end generation.", stacklevel=3)
    params = SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=gc.min_new_tokens or 0,
        temperature=float(gc.temperature if gc.temperature is not None else 1.0) if gc.do_sample else 0.0,
        top_k=int(gc.top_k or 0) if gc.do_sample else 0,
        top_p=float(gc.top_p if gc.top_p is not None else 1.0) if gc.do_sample else 1.0,
        repetition_penalty=float(gc.repetition_penalty or 1.0),
    )
    try:
        params.validate()
    except (TypeError, ValueError):
        return None
    engine_kwargs = _engine_kwargs(model, len(rows), width + max_new)
    check_pool_fits(engine_kwargs["num_blocks"], engine_kwargs["block_size"], width + max_new)
    engine = Engine(model, **engine_kwargs, show_progress=False, eos_token_ids=eos_ids,
                    **_speculative_kwargs(gc, assistant))
    outputs = engine.generate(rows, params)
    model.hf_paged_last_metrics = engine.metrics()  # introspection: the last engine-served call
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        raise errors[0]
    generated = max(len(o.token_ids) for o in outputs)
    sequences = torch.full((len(rows), width + generated), pad, dtype=torch.long, device=input_ids.device)
    sequences[:, :width] = input_ids
    for row, out in enumerate(outputs):
        sequences[row, width : width + len(out.token_ids)] = torch.tensor(out.token_ids, dtype=torch.long)
    if gc.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _speculative_kwargs(gc: GenerationConfig, assistant) -> dict:
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


def _merged_config(model, generation_config, overrides: dict) -> GenerationConfig | None:
    base = generation_config if generation_config is not None else model.generation_config
    gc = copy.deepcopy(base)
    gc.update(**overrides)
    diff = gc.to_diff_dict()
    if any(value not in (None, False) for key, value in diff.items() if key not in _SUPPORTED_DIFF):
        return None
    if any(getattr(gc, flag, False) for flag in ("output_scores", "output_logits", "output_attentions",
                                                   "output_hidden_states")):
        return None
    if gc.do_sample and (gc.temperature is not None and gc.temperature <= 0):
        return None
    return gc


def _left_padded_rows(input_ids: torch.Tensor, attention_mask) -> list[list[int]] | None:
    """Each row's real tokens, or None unless every row is left-padded and non-empty."""
    if attention_mask is None:
        return input_ids.tolist()
    if not torch.is_tensor(attention_mask) or attention_mask.shape != input_ids.shape:
        return None
    mask = attention_mask.bool().cpu()
    num_real = mask.sum(dim=1)
    expected = torch.arange(mask.shape[1])[None, :] >= (mask.shape[1] - num_real)[:, None]
    if not torch.equal(mask, expected) or bool((num_real == 0).any()):
        return None
    ids = input_ids.tolist()
    return [row[len(row) - n:] for row, n in zip(ids, num_real.tolist())]


def _engine_kwargs(model, batch_size: int, max_len: int) -> dict:
    """A pool sized like the model's `hf_paged_cache_config`, or else for every row at full length (the
    most stock generate would hold); every row runs at once."""
    cfg = getattr(model, "hf_paged_cache_config", None) or PagedCacheConfig()
    num_blocks = cfg.num_blocks
    if num_blocks is None and cfg.max_kv_bytes is None:
        num_blocks = batch_size * -(-max_len // cfg.block_size)
    return dict(
        max_num_seqs=batch_size, block_size=cfg.block_size, num_blocks=num_blocks, max_kv_bytes=cfg.max_kv_bytes,
        kv_cache_dtype=cfg.kv_cache_dtype, enable_prefix_caching=cfg.enable_prefix_caching,
        cache_salt=cfg.cache_salt, max_model_len=max(max_len, 2),
    )
