"""Drop-in batched `generate` through the continuous-batching `Engine`.

For a model with `attn_implementation="hf_paged"`, a plain

    model.generate(**tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt"), ...)

runs the rows as independent engine requests (no padding computed or stored, finished rows leave
the batch at once) and returns what stock transformers returns: the left-padded prompts followed by
the generated tokens, rows that ended early filled with `pad_token_id`, the same width. With
`return_dict_in_generate=True` it returns a `GenerateDecoderOnlyOutput` with `sequences` (there is no
per-call cache to return: `cache` is None). The engine's metrics of the call (KV peak, prefix hits,
speculation) are left in `model.hf_paged_last_metrics`.

The generation config is merged exactly as stock merges it (the model's `generation_config`,
transformers' defaults such as `top_k=50`, the call's keywords) and mapped field by field
(`generation_config.py`). Anything the engine does not reproduce exactly (beam search, scores/logits/
attentions outputs, custom logits processors or stopping criteria, streamers, a cache passed in,
`inputs_embeds`, a processor the engine lacks...) returns None from `try_engine_generate`, and
`generate` runs stock transformers with a `PagedCache` instead. Set
`model.hf_paged_use_engine = False` to always take that path.
"""

from __future__ import annotations

import logging
import warnings

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..config import PagedCacheConfig, check_pool_fits
from ..engine import Engine
from ..hf.support import has_latent_kv
from .generation_config import eos_token_ids_of, merged_generation_config, sampling_params_from, speculative_kwargs

logger = logging.getLogger(__name__)

_MODEL_INPUTS = {"input_ids", "attention_mask"}
# Every GenerationConfig field may be passed as a keyword; `sampling_params_from` judges its value.
_CONFIG_KEYS = frozenset(GenerationConfig().to_dict()) | {"generation_config"}


def try_engine_generate(model, inputs, generation_config, kwargs: dict):
    """Run `model.generate(inputs, generation_config, **kwargs)` through an `Engine`, or return None
    when the call needs something only stock generate provides."""
    if not getattr(model, "hf_paged_use_engine", True) or getattr(model.config, "is_encoder_decoder", False):
        return None
    if has_latent_kv(model.config):
        return None  # the Engine cannot serve latent attention; stock generate over a PagedCache can
    unknown = set(kwargs) - _MODEL_INPUTS - _CONFIG_KEYS - {"assistant_model"}
    if unknown:
        logger.debug("hf_paged: stock generate serves this call (arguments %s)", sorted(unknown))
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
    rows = _left_padded_rows(input_ids, kwargs.get("attention_mask"))
    if rows is None:
        return None
    width = input_ids.shape[1]
    config_kwargs = {k: v for k, v in kwargs.items() if k in _CONFIG_KEYS and k != "generation_config"}
    gc = merged_generation_config(model, kwargs.get("generation_config", generation_config), config_kwargs)
    params = sampling_params_from(gc, width)
    if isinstance(params, str):
        logger.debug("hf_paged: stock generate serves this call (%s)", params)
        return None
    eos_ids = eos_token_ids_of(gc)
    pad = gc.pad_token_id
    if pad is None:
        if not eos_ids:
            return None
        pad = eos_ids[0]  # what stock generate does, with the same warning
        warnings.warn(f"Setting `pad_token_id` to `eos_token_id`:{pad} for open-end generation.", stacklevel=3)
    max_len = width + params.max_new_tokens
    engine_kwargs = _engine_kwargs(model, len(rows), max_len)
    check_pool_fits(engine_kwargs["num_blocks"], engine_kwargs["block_size"], max_len)
    engine = Engine(model, **engine_kwargs, show_progress=False, eos_token_ids=eos_ids,
                    **speculative_kwargs(gc, assistant))
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
