"""Drop-in batched `generate` through the continuous-batching `Engine`.

For a model with `attn_implementation="hf_paged"`, a plain

    model.generate(**tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt"), ...)

runs the rows as independent engine requests (no padding computed or stored, finished rows leave
the batch at once) and returns what stock transformers returns: the left-padded prompts followed by
the generated tokens, rows that ended early filled with `pad_token_id`, the same width. With
`num_return_sequences=k` (sampling) each prompt is one engine request with `n=k` samples sharing
its prefill; the rows come back as stock orders them (prompt 0's k samples, then prompt 1's...).

With `return_dict_in_generate=True` it returns a `GenerateDecoderOnlyOutput` with `sequences` and,
when asked, `scores` / `logits`: one fp32 `[batch * num_return_sequences, vocab]` tensor per generated
step, the processed logits each token was drawn from / the model's raw logits (there is no per-call
cache to return: `cache` is None). Stock keeps feeding rows that already finished (pad tokens,
attended, at consecutive positions) and reports their scores at the later steps too; the engine
stops such a row at once, so those steps are computed afterwards the way stock computes them: one
teacher-forced dense forward of the row's whole padded sequence (its prompt with stock's attention
mask, its tokens, the pads after them; the "hf_paged" attention without paged metadata is
transformers' sdpa/eager), processed by stock's own `LogitsProcessorList` with stock's `input_ids` at
that step (`_stock_rows_after_finish`).

The generation config is merged exactly as stock merges it (the model's `generation_config`,
transformers' defaults such as `top_k=50`, the call's keywords, stock's length rules) and mapped field
by field (`generation_config.py`). Anything the engine does not reproduce exactly returns None from
`try_engine_generate`, and `generate` runs stock transformers with a `PagedCache` instead: beam search,
attentions / hidden-states outputs, custom logits processors or stopping criteria, streamers, a cache
passed in, `inputs_embeds`, a processor the engine lacks, multi-token `sequence_bias`, settings stock
rejects (greedy or assisted `num_return_sequences > 1`: stock raises its own error), and the two cases
where stock's processors see the left padding as tokens (`_padding_visible_to_processors`). Set
`model.hf_paged_use_engine = False` to always take that path.
"""

from __future__ import annotations

import copy
import inspect
import logging
import warnings

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..config import PagedCacheConfig, check_pool_fits
from ..engine import Engine
from ..hf import PagedCache
from ..hf.support import has_latent_kv
from .generation_config import eos_token_ids_of, merged_generation_config, sampling_params_from, speculative_kwargs

logger = logging.getLogger(__name__)

_MODEL_INPUTS = {"input_ids", "attention_mask"}
# Every GenerationConfig field may be passed as a keyword; `sampling_params_from` judges its value.
_CONFIG_KEYS = frozenset(GenerationConfig().to_dict()) | {"generation_config"}
# Teacher-forced forwards for finished rows: rows per forward bounded by this many fp32 elements of
# kept logits plus hidden states.
_FORWARD_BUDGET = 1 << 26


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
    width = input_ids.shape[1]
    config_kwargs = {k: v for k, v in kwargs.items() if k in _CONFIG_KEYS and k != "generation_config"}
    try:
        gc = merged_generation_config(model, kwargs.get("generation_config", generation_config), config_kwargs,
                                      input_ids=input_ids)
    except (ValueError, TypeError, AttributeError) as exc:  # stock raises its own error for the same call
        logger.debug("hf_paged: stock generate serves this call (%s)", exc)
        return None
    vocab_size = _output_vocab_size(model)
    params = sampling_params_from(gc, width, vocab_size)
    if isinstance(params, str):
        logger.debug("hf_paged: stock generate serves this call (%s)", params)
        return None
    if params.n > 1 and assistant is not None:
        return None  # stock: "num_return_sequences has to be 1 when doing assisted generate"
    eos_ids = eos_token_ids_of(gc)
    pad = gc.pad_token_id
    pad_warning = False
    if pad is None:
        if not eos_ids:
            return None
        pad, pad_warning = eos_ids[0], True  # what stock generate does, with the same warning
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = _inferred_attention_mask(input_ids, pad, eos_ids)
    rows = _left_padded_rows(input_ids, attention_mask)
    if rows is None:
        return None
    if _padding_visible_to_processors(params, rows, width, pad, before_run=True):
        logger.debug("hf_paged: stock generate serves this call (its processors see the left padding)")
        return None
    if params.output_scores:
        try:  # stock's processors complete finished rows' scores (see `_stock_rows_after_finish`)
            _stock_processors(model, gc, attention_mask.long(), width, input_ids.device)
        except Exception as exc:  # noqa: BLE001 - whatever stops it here, stock serves the call
            logger.debug("hf_paged: stock generate serves this call (its processors: %s)", exc)
            return None
    if pad_warning:
        warnings.warn(f"Setting `pad_token_id` to `eos_token_id`:{pad} for open-end generation.", stacklevel=3)
    n = params.n
    max_len = width + params.max_new_tokens
    engine_kwargs = _engine_kwargs(model, len(rows) * n, max_len)
    check_pool_fits(engine_kwargs["num_blocks"], engine_kwargs["block_size"], max_len)
    engine = Engine(model, **engine_kwargs, show_progress=False, eos_token_ids=eos_ids,
                    **speculative_kwargs(gc, assistant))
    outputs = engine.generate(rows, params)
    metrics = engine.metrics()
    errors = [o.error for o in outputs if o.error is not None]
    if errors:
        model.hf_paged_last_metrics = metrics
        raise errors[0]
    # Row order of stock's expanded batch: prompt i's samples at rows i*n .. i*n + n-1.
    samples = [sample for out in outputs for sample in out.outputs]
    sample_rows = [rows[i // n] for i in range(len(samples))]
    if _padding_visible_to_processors(params, sample_rows, width, pad, before_run=False,
                                      generated=[s.token_ids for s in samples]):
        logger.debug("hf_paged: stock generate serves this call (its n-gram processor sees the left padding)")
        return None
    model.hf_paged_last_metrics = metrics  # introspection: the last engine-served call
    device = input_ids.device
    generated = max(len(s.token_ids) for s in samples)
    sequences = torch.full((len(samples), width + generated), pad, dtype=torch.long, device=device)
    sequences[:, :width] = input_ids.repeat_interleave(n, dim=0) if n > 1 else input_ids
    for row, sample in enumerate(samples):
        sequences[row, width: width + len(sample.token_ids)] = torch.tensor(sample.token_ids, dtype=torch.long)
    if not gc.return_dict_in_generate:
        return sequences
    scores = logits = None
    if params.output_scores or params.output_logits:
        mask = attention_mask.to(device=device, dtype=torch.long)
        mask = mask.repeat_interleave(n, dim=0) if n > 1 else mask
        scores, logits = _stock_rows_after_finish(model, gc, sequences, mask, width, samples, params)
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)


# ---------------------------------------------------------------------------------- inputs
def _output_vocab_size(model) -> int | None:
    """The width of the model's logits (what stock's processors check token ids against)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    size = getattr(head, "out_features", None)
    if size is None:
        size = getattr(model.config.get_text_config(), "vocab_size", None)
    return size


def _inferred_attention_mask(input_ids: torch.Tensor, pad: int, eos_ids: list[int]) -> torch.Tensor:
    """Stock's mask when none is passed (`_prepare_attention_mask_for_generation`): the non-pad tokens
    if the inputs hold the pad id and it is no end-of-sequence id, else every token."""
    if pad not in eos_ids and bool((input_ids == pad).any()):
        return input_ids.ne(pad).long()
    return torch.ones_like(input_ids)


def _left_padded_rows(input_ids: torch.Tensor, attention_mask) -> list[list[int]] | None:
    """Each row's real tokens, or None unless every row is left-padded and non-empty."""
    if not torch.is_tensor(attention_mask) or attention_mask.shape != input_ids.shape:
        return None
    mask = attention_mask.bool().cpu()
    num_real = mask.sum(dim=1)
    expected = torch.arange(mask.shape[1])[None, :] >= (mask.shape[1] - num_real)[:, None]
    if not torch.equal(mask, expected) or bool((num_real == 0).any()):
        return None
    ids = input_ids.tolist()
    return [row[len(row) - n:] for row, n in zip(ids, num_real.tolist())]


def _padding_visible_to_processors(params, rows: list[list[int]], width: int, pad: int, before_run: bool,
                                   generated: list[list[int]] | None = None) -> bool:
    """Whether stock's processors could treat a row's left padding as tokens where the engine (which
    never sees it) does not. Stock hands its processors the padded `input_ids`; two of them read it
    (the repetition penalty skips the padding, `prompt_ignore_length`):

    * `bad_words_ids`: a multi-token word is matched against the last tokens, pads included, so a word
      whose prefix holds the pad id can match a short row's padding (checked before the run);
    * `no_repeat_ngram_size`: n-grams run over the padding too. Size 1 bans the pad id from the first
      step (checked before the run). Larger sizes: an n-gram starting in the padding has the pad id
      first, so it can only match the row's last tokens when the pad id occurs among the row's own
      tokens before the last step (prompt or generated); checked after the run, on what was generated.
    """
    padded = [len(r) < width for r in rows]
    if not any(padded):
        return False
    size = params.no_repeat_ngram_size
    if before_run:
        if size == 1:
            return True
        return any(len(w) > 1 and pad in w[:-1] for w in params.bad_words_ids or ())
    if size < 2:
        return False
    return any(p and (pad in row or pad in gen[:-1]) for p, row, gen in zip(padded, rows, generated))


def _engine_kwargs(model, batch_size: int, max_len: int) -> dict:
    """A pool sized like the model's `hf_paged_cache_config`, or else for every row at full length (the
    most stock generate would hold); every row runs at once."""
    cfg = getattr(model, "hf_paged_cache_config", None) or PagedCacheConfig()
    num_blocks = cfg.num_blocks
    if num_blocks is None and cfg.max_kv_bytes is None:  # every KV group of every row at full length
        num_blocks = batch_size * PagedCache(model.config, cfg).manager.max_blocks_for(max_len)
    return dict(
        max_num_seqs=batch_size, block_size=cfg.block_size, num_blocks=num_blocks, max_kv_bytes=cfg.max_kv_bytes,
        kv_cache_dtype=cfg.kv_cache_dtype, kv_quant_scheme=cfg.kv_quant_scheme, kv_quant_rotation=cfg.kv_quant_rotation,
        enable_prefix_caching=cfg.enable_prefix_caching, enable_hybrid_kv=cfg.enable_hybrid_kv,
        cache_salt=cfg.cache_salt, max_model_len=max(max_len, 2),
    )


# ---------------------------------------------------------------------------------- scores / logits
def _stock_rows_after_finish(model, gc, sequences: torch.Tensor, mask: torch.Tensor, width: int, samples,
                             params) -> tuple[tuple | None, tuple | None]:
    """Stock's `scores` / `logits` tuples: per generated step one fp32 [rows, vocab] tensor.

    A row's steps up to its end are the engine's rows. Stock computes the later steps of a finished
    row too: its forward on the token fed there (the row's last token, then pads), with the mask
    extended by ones, then its processors on `input_ids` as they stand (pads included). Those steps
    come from one teacher-forced forward of the row's padded sequence (all logits at once, kept for
    the missing positions only) and stock's own `LogitsProcessorList`, applied step by step to the
    rows missing that step, with those rows' `input_ids` at that step."""
    device = sequences.device
    total = sequences.shape[1] - width  # generated width
    lengths = [len(s.token_ids) for s in samples]
    short = [r for r, g in enumerate(lengths) if g < total]
    raw_late = _teacher_forced_logits(model, sequences, mask, short, lengths, width) if short else {}
    late_scores: dict[int, list[torch.Tensor]] = {r: [] for r in short}
    if params.output_scores and short:
        processors_for: dict[tuple[int, ...], object] = {}
        for t in range(min(lengths[r] for r in short), total):
            group = tuple(r for r in short if lengths[r] <= t)
            if group not in processors_for:
                processors_for[group] = _stock_processors(model, gc, mask[list(group)], width, device)
            x = torch.stack([raw_late[r][t - lengths[r]] for r in group])
            out = processors_for[group](sequences[list(group), : width + t], x.clone())
            for j, r in enumerate(group):
                late_scores[r].append(out[j])

    def steps(kind: str, late: dict[int, list[torch.Tensor]]) -> tuple:
        per_row = [[x.to(device=device, dtype=torch.float32) for x in getattr(s, kind)] + late.get(r, [])
                   for r, s in enumerate(samples)]
        return tuple(torch.stack([row[t] for row in per_row]) for t in range(total))

    scores = steps("scores", late_scores) if params.output_scores else None
    logits = steps("logits", raw_late) if params.output_logits else None
    return scores, logits


def _teacher_forced_logits(model, sequences: torch.Tensor, mask: torch.Tensor, short: list[int],
                           lengths: list[int], width: int) -> dict[int, list[torch.Tensor]]:
    """Raw fp32 logits stock computes for each row of `short` after it finished: the rows of steps
    `lengths[r]` .. end, from one dense forward (no cache) of its sequence up to the last fed token,
    with stock's mask (prompt mask, then ones) and positions (cumulative mask - 1, as generate does)."""
    total = sequences.shape[1] - width
    length = width + total - 1  # the last generated token is never fed
    ids = sequences[:, :length]
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], total - 1)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 0)
    model_device = next(model.parameters()).device
    keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
    hidden = getattr(model.config.get_text_config(), "hidden_size", 0) or 0
    vocab = _output_vocab_size(model) or 1
    order = sorted(short, key=lambda r: lengths[r])  # most missing steps first
    out: dict[int, list[torch.Tensor]] = {}
    start = 0
    with torch.no_grad():
        while start < len(order):
            keep = total - lengths[order[start]]
            per_row = length * hidden + keep * vocab
            count = max(1, min(len(order) - start, _FORWARD_BUDGET // max(per_row, 1)))
            chunk = order[start: start + count]
            start += count
            extra = {"logits_to_keep": keep} if keeps_logits else {}
            result = model(input_ids=ids[chunk].to(model_device), attention_mask=full_mask[chunk].to(model_device),
                           position_ids=positions[chunk].to(model_device), use_cache=False, **extra)
            rows = result.logits[:, -keep:].to(device=sequences.device, dtype=torch.float32)
            for j, r in enumerate(chunk):
                missing = total - lengths[r]
                out[r] = list(rows[j, keep - missing:])
    return out


def _stock_processors(model, gc, mask: torch.Tensor, width: int, device):
    """Stock's `LogitsProcessorList` for these rows (built as `generate` builds it, from the prepared
    config and the rows' attention mask, which the repetition penalty reads for the padding)."""
    gc = copy.deepcopy(gc)
    model._prepare_special_tokens(gc, True, device=device)
    return model._get_logits_processor(
        generation_config=gc, input_ids_seq_length=width, encoder_input_ids=None, prefix_allowed_tokens_fn=None,
        logits_processor=None, device=device, model_kwargs={"attention_mask": mask},
    )
