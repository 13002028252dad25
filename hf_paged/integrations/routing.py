"""Which path serves a drop-in `model.generate` call, and why.

`route` is the one decision: it prepares a call the `Engine` can serve (an `EngineCall`) or says why
stock transformers `generate` must serve it instead (a `Fallback`). It runs nothing (no forward, no
engine), so `generate` (through `plan_engine_call`, which logs the reason) and `hf_paged.explain`
(`explain.py`) ask the same question and get the same answer. Each reason is logged at INFO once per
model object (`log_fallback`), so a user sees which path served a call without repeated lines.

The calls stock serves (see `batch_generate`'s docstring for why each differs): beam search, outputs
the engine does not produce, arguments it does not take, a cache passed in that the call does not
extend, settings stock rejects, and the cases where stock's processors see the left padding.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import warnings
import weakref

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..config import PagedCacheConfig
from ..engine.tensor_parallel import tensor_parallel_group
from ..hf import PagedCache
from ..hf.multimodal import ImageSupport
from ..hf.latent import latent_refusal
from ..hf.support import has_latent_kv
from ..transformers_api import stock_penalty_skips_padding
from .generation_config import eos_token_ids_of, merged_generation_config, sampling_params_from, speculative_kwargs
from .images import image_data_of, image_side_inputs, row_prompts
from .logits_processors import StockProcessors, plan_processors, pool_holds_rows
from .returned_cache import ReturnedCache
from .stock_scores import output_vocab_size, stock_processors

logger = logging.getLogger(__name__)

_MODEL_INPUTS = {"input_ids", "attention_mask"}
# Keywords stock `generate` accepts and then ignores for a decoder-only model: `labels` (never
# forwarded; `Seq2SeqTrainer(predict_with_generate=True)` passes its batch whole) and a false
# `synced_gpus` (one process; a true one, for ZeRO-3/FSDP, goes to stock generate).
_IGNORED = {"labels"}
# Every GenerationConfig field may be passed as a keyword; `sampling_params_from` judges its value.
_CONFIG_KEYS = frozenset(GenerationConfig().to_dict()) | {"generation_config"}
_HANDLED = {"assistant_model", "streamer", "stopping_criteria", "tokenizer", "logits_processor",
            "prefix_allowed_tokens_fn"}


# The reason the generate wrap gives for a call with positional arguments after `generation_config`
# (stock's `logits_processor`, `stopping_criteria`, ... by position): the engine only reads keywords.
POSITIONAL_ARGUMENTS = "positional arguments after generation_config (the engine takes them as keywords only)"


@dataclasses.dataclass(frozen=True)
class Fallback:
    """Why stock `generate` serves a call the engine could otherwise take.

    Args:
        reason: a phrase that completes "stock generate serves this call: ...".
    """

    reason: str


# Per model, the fallback reasons already logged (a second model of the same kind logs again).
_logged: "weakref.WeakKeyDictionary[torch.nn.Module, set[str]]" = weakref.WeakKeyDictionary()
_logged_guard = threading.Lock()


def log_fallback(model, reason: str) -> None:
    """Log at INFO that stock generate serves a call of `model`, and why: once per model and reason."""
    with _logged_guard:
        try:
            seen = _logged.setdefault(model, set())
        except TypeError:  # not weak-referenceable: log every time rather than never
            seen = set()
        if reason in seen:
            return
        seen.add(reason)
    logger.info("hf_paged: stock generate serves this call on %s: %s (logged once per model and reason)",
                type(model).__name__, reason)


@dataclasses.dataclass
class EngineCall:
    """One `generate` call the engine can serve, prepared: its merged config, sampling params and rows
    (`route`); `engine_kwargs` sizes an engine for it."""

    model: torch.nn.Module
    gc: GenerationConfig
    params: object  # SamplingParams
    input_ids: torch.Tensor  # [batch, width]
    attention_mask: torch.Tensor  # [batch, width]
    rows: list[list[int]]  # each row's real tokens
    pad: int
    pad_warning: bool
    eos_ids: list[int]
    assistant: torch.nn.Module | None
    streamer: object
    criteria: StoppingCriteriaList | None
    passed: ReturnedCache | None
    paddings: list[set[int]]  # each row's padding ids (`_paddings`)
    image_data: dict | None = None  # the call's image inputs (`pixel_values` of every row's images, ...)
    image_support: ImageSupport | None = None  # the model's, with `image_data`
    row_images: list = dataclasses.field(default_factory=list)  # per row, its `ImageItem`s (None: text only)
    processors: LogitsProcessorList | None = None  # the call's own (`logits_processors.py`), run in lockstep

    def prompts(self, engine) -> list:
        """What the engine is given per row: its tokens, or with the call's images, the vLLM-style dict
        whose `multi_modal_data` holds that row's images (split as transformers splits a batch's
        images per row: by each image's placeholder count, which the engine's encoder gives)."""
        if self.image_data is None:
            return self.rows
        prompts, self.row_images = row_prompts(self.image_support, engine, self.rows, self.image_data)
        return prompts

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]

    @property
    def is_stepwise(self) -> bool:
        """Fed step by step (a streamer or stopping criteria see every step)."""
        return self.streamer is not None or self.criteria is not None

    @property
    def max_len(self) -> int:
        return self.width + self.params.max_new_tokens

    @property
    def retain(self) -> bool:
        """Stock returns (and updates in place) a cache: keep each row's K/V for a `ReturnedCache`."""
        return self.gc.use_cache is not False and (self.gc.return_dict_in_generate or self.passed is not None)

    def engine_kwargs(self, num_rows: int | None = None) -> dict:
        """An engine for `num_rows` rows (default this call's) of this call's longest length."""
        return pool_kwargs(self.model, (num_rows or len(self.rows)) * self.params.n, self.max_len)

    def warn_pad(self, stacklevel: int) -> None:
        """Stock's warning when it pads with the EOS id (no `pad_token_id` set)."""
        if self.pad_warning:
            warnings.warn(f"Setting `pad_token_id` to `eos_token_id`:{self.pad} for open-end generation.",
                          stacklevel=stacklevel)

    def spec_kwargs(self) -> dict:
        return speculative_kwargs(self.gc, self.assistant)

    def run_params(self):
        """The sampling params of one run: with the call's own processors, a fresh `StockProcessors`
        over stock's `input_ids` (it grows a column per step), and no speculation."""
        if self.processors is None:
            return self.params
        n = self.params.n
        ids = self.input_ids.repeat_interleave(n, dim=0) if n > 1 else self.input_ids
        return dataclasses.replace(self.params, batch_processor=StockProcessors(self.processors, ids, self.pad),
                                   num_speculative_tokens=0)


def plan_engine_call(model, inputs, generation_config, kwargs: dict) -> EngineCall | None:
    """`route`, with a `Fallback` logged (`log_fallback`) and returned as None."""
    call = route(model, inputs, generation_config, kwargs)
    if isinstance(call, Fallback):
        log_fallback(model, call.reason)
        return None
    return call


def route(model, inputs, generation_config, kwargs: dict) -> EngineCall | Fallback:
    """Prepare `model.generate(inputs, generation_config, **kwargs)` for the engine, or say why the
    call needs something only stock generate provides. Runs nothing and logs nothing."""
    if not getattr(model, "hf_paged_use_engine", True):
        return Fallback("model.hf_paged_use_engine is False")
    if getattr(model.config, "is_encoder_decoder", False):
        return Fallback("an encoder-decoder model (the engine serves decoder-only models)")
    if has_latent_kv(model.config):
        why = latent_refusal(model)
        if why is None and (getattr(model, "hf_paged_cache_config", None) or PagedCacheConfig()).kv_dtype.is_quantized:
            why = "its latents are kept quantised, which only dense steps read"
        if why is not None:
            return Fallback(f"latent attention (MLA) the engine cannot run: {why}")
    if _positions_itself(model):
        return Fallback("the model positions its tokens itself (its prepare_inputs_for_generation drops "
                        "position_ids), not as the engine does")
    passed = passed_cache(kwargs)
    images = image_data_of(model, kwargs)
    if isinstance(images, str):
        return Fallback(images)
    image_data, image_support = images
    image_side = image_side_inputs(image_support, kwargs, inputs if inputs is not None else kwargs.get("input_ids"))
    if isinstance(image_side, str):
        return Fallback(image_side)
    unknown = set(kwargs) - _MODEL_INPUTS - _CONFIG_KEYS - _IGNORED - set(image_data or ()) - image_side - _HANDLED
    if "synced_gpus" in kwargs and not kwargs["synced_gpus"]:
        unknown.discard("synced_gpus")
    if kwargs.get("synced_gpus") is None and _synced_by_default(model):
        return Fallback("synced_gpus, which stock turns on itself under ZeRO-3 or FSDP over several processes")
    if isinstance(passed, ReturnedCache):
        unknown -= {"cache", "past_key_values"}
    if unknown:
        return Fallback(f"arguments the engine does not take ({', '.join(sorted(unknown))})")
    assistant = kwargs.get("assistant_model")
    if assistant is not None and (not isinstance(assistant, torch.nn.Module)
                                  or getattr(assistant.config, "is_encoder_decoder", False)):
        return Fallback("an assistant_model that is not a decoder-only torch module")
    input_ids = inputs if inputs is not None else kwargs.get("input_ids")
    if inputs is not None and "input_ids" in kwargs:
        return Fallback("both inputs and input_ids (stock raises its own error)")
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype != torch.long or input_ids.shape[0] == 0:
        return Fallback("no input_ids as a non-empty [batch, width] tensor of token ids")
    width = input_ids.shape[1]
    config_kwargs = {k: v for k, v in kwargs.items() if k in _CONFIG_KEYS and k != "generation_config"}
    try:
        gc = merged_generation_config(model, kwargs.get("generation_config", generation_config), config_kwargs,
                                      input_ids=input_ids)
    except (ValueError, TypeError, AttributeError) as exc:  # stock raises its own error for the same call
        return Fallback(f"its generation config ({exc})")
    vocab_size = output_vocab_size(model)
    params = sampling_params_from(gc, width, vocab_size)
    if isinstance(params, str):
        return Fallback(params)
    if image_data is not None and (params.output_scores or params.output_logits or assistant is not None):
        # Scores of rows that finished early come from a text-only teacher-forced forward; drafts see no images.
        return Fallback("images with scores, logits or an assistant")
    if params.n > 1 and assistant is not None:
        return Fallback("num_return_sequences > 1 with an assistant_model (stock rejects it)")
    eos_ids = eos_token_ids_of(gc)
    pad = gc.pad_token_id
    pad_warning = False
    if pad is None:
        if not eos_ids:
            return Fallback("neither pad_token_id nor eos_token_id is set")
        pad, pad_warning = eos_ids[0], True  # what stock generate does, with the same warning
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = _inferred_attention_mask(input_ids, pad, eos_ids)
    rows = _left_padded_rows(input_ids, attention_mask)
    if rows is None:
        return Fallback("an attention mask that is not left padding of non-empty rows")
    if passed is not None and passed.continuation_prefixes(None, input_ids, attention_mask, rows) is None:
        return Fallback("it does not extend the cache passed in")
    paddings = _paddings(input_ids, rows)
    if padding_visible_to_processors(params, paddings, rows, before_run=True):
        return Fallback("its processors see the left padding")
    if params.output_scores:
        try:  # stock's processors complete finished rows' scores (see `stock_scores.stock_rows_after_finish`)
            stock_processors(model, gc, attention_mask.long(), width, input_ids.device)
        except Exception as exc:  # noqa: BLE001 - whatever stops it here, stock serves the call
            return Fallback(f"its processors ({exc})")
    processors = None
    if kwargs.get("logits_processor") is not None or kwargs.get("prefix_allowed_tokens_fn") is not None:
        processors = plan_processors(model, gc, kwargs, params, attention_mask, width, assistant, image_data)
        if isinstance(processors, str):
            return Fallback(processors)
    streamer = kwargs.get("streamer")
    criteria = None
    if kwargs.get("stopping_criteria") or gc.stop_strings or gc.max_time is not None:
        try:  # stock's own list (max length, EOS, stop strings, max time and the caller's), called step by step
            stock_gc = copy.deepcopy(gc)
            model._prepare_special_tokens(stock_gc, True, device=input_ids.device)
            criteria = model._get_stopping_criteria(generation_config=stock_gc, stopping_criteria=kwargs.get(
                "stopping_criteria") or StoppingCriteriaList(), tokenizer=kwargs.get("tokenizer"))
        except (ValueError, TypeError, AttributeError) as exc:  # stock raises its own error for the same call
            return Fallback(f"its stopping criteria ({exc})")
        if not eos_ids:
            # Without an EOS criterion stock keeps extending a row its criteria stopped (no padding).
            return Fallback("stopping criteria without eos_token_id")
    if streamer is not None or criteria is not None:
        # Fed step by step as the tokens come: only calls the engine surely serves to the end (no
        # after-run fallback to stock, which would feed a streamer twice), one sample per row, and no
        # scores (stock hands its criteria the scores tuple).
        fed = "a streamer" if streamer is not None else "stopping criteria"
        if params.n > 1:
            return Fallback(f"{fed} with num_return_sequences={params.n}")
        if params.output_scores or params.output_logits:
            return Fallback(f"{fed} with output_scores or output_logits")
        if params.no_repeat_ngram_size >= 2 and any(len(r) < width for r in rows):
            return Fallback(f"{fed} with no_repeat_ngram_size over padded rows")
    call = EngineCall(model=model, gc=gc, params=params, input_ids=input_ids, attention_mask=attention_mask,
                      rows=rows, pad=pad, pad_warning=pad_warning, eos_ids=eos_ids, assistant=assistant,
                      streamer=streamer, criteria=criteria, passed=passed, paddings=paddings, image_data=image_data,
                      image_support=image_support, processors=processors)
    if processors is not None and not pool_holds_rows(call.model, call.engine_kwargs(), len(call.rows) * call.params.n,
                                                      call.max_len):
        # Lockstep needs every row running at once: a pool the caller capped may not hold them all.
        return Fallback("its logits processors, and a pool too small for every row at once")
    if "mm_token_type_ids" in image_side and call.retain:
        # A returned cache turns dense with 1-D positions (`ReturnedCache.to_dense`): not Qwen-VL's 3-D ones.
        return Fallback("a returned cache of M-RoPE images")
    if tensor_parallel_group(model) is not None and (
            call.retain or passed is not None or streamer is not None or criteria is not None or assistant is not None
            or image_data is not None or processors is not None):
        # Rank 0 alone runs a tensor-parallel call and hands the other ranks its result: returned caches,
        # streamers, a caller's stopping criteria and images stay with stock, which every rank runs.
        return Fallback("a tensor-parallel call with a returned cache, streamer, stopping criteria, assistant, "
                        "images or logits processors")
    return call


def passed_cache(kwargs: dict):
    """The cache object a generate call passed (`cache=`, or `past_key_values=` before 5.24)."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def pool_kwargs(model, batch_size: int, max_len: int) -> dict:
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


_SELF_POSITIONED: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def _positions_itself(model) -> bool:
    """Whether the model's own `prepare_inputs_for_generation` drops the position ids stock `generate`
    made from the attention mask, so that its layers position the tokens themselves (Kosmos-2.5 counts
    from past its padding index): the engine's 0-based positions would differ from stock's. Asked once
    per class, by calling that method on three ids (no forward)."""
    cls = type(model)
    if cls not in _SELF_POSITIONED:
        from transformers import DynamicCache

        ids, positions = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]])
        try:
            inputs = model.prepare_inputs_for_generation(ids, attention_mask=torch.ones_like(ids), position_ids=positions,
                                                         cache=DynamicCache(config=model.config), use_cache=True,
                                                         is_first_iteration=True)
            _SELF_POSITIONED[cls] = inputs.get("position_ids") is None
        except Exception:  # noqa: BLE001 - a model that cannot answer this keeps the engine
            _SELF_POSITIONED[cls] = False
    return _SELF_POSITIONED[cls]


def _synced_by_default(model) -> bool:
    """Stock generate's own default for `synced_gpus=None`: ZeRO-3 or FSDP, more than one process."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    if not (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)):
        return False
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


# ---------------------------------------------------------------------------------- inputs
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


def _paddings(input_ids: torch.Tensor, rows: list[list[int]]) -> list[set[int]]:
    """Each row's padding ids: the `input_ids` under its attention mask's zeros (the left columns
    `_left_padded_rows` cut off), whatever `pad_token_id` says. Stock's processors see these ids."""
    width = input_ids.shape[1]
    padded = [i for i, r in enumerate(rows) if len(r) < width]
    ids = input_ids[padded].tolist() if padded else []
    found = [set() for _ in rows]
    for i, row_ids in zip(padded, ids):
        found[i] = set(row_ids[: width - len(rows[i])])
    return found


def padding_visible_to_processors(params, paddings: list[set[int]], rows: list[list[int]], before_run: bool,
                                  generated: list[list[int]] | None = None) -> bool:
    """Whether stock's processors could treat a row's left padding as tokens where the engine (which
    never sees it) does not. Stock hands its processors the padded `input_ids`, so they see each row's
    own padding ids (`paddings`, from `_paddings`: the ids under the mask, which need not be
    `pad_token_id`, and may differ from row to row and within a row); these read it:

    * `repetition_penalty`: from 5.23 stock skips the padding (`prompt_ignore_length`); before, it
      penalises the padding ids as seen tokens (checked before the run, for any padded row);
    * `bad_words_ids`: a multi-token word is matched against the last tokens, pads included, so a word
      whose prefix holds one of a padded row's padding ids can match that row's padding (checked
      before the run);
    * `no_repeat_ngram_size`: n-grams run over the padding too. Size 1 bans the padding ids from the
      first step (checked before the run, for any padded row). Larger sizes: an n-gram starting in the
      padding has a padding id first, so it can only match the row's last tokens when one of the row's
      padding ids occurs among its own tokens before the last step (prompt or generated); checked after
      the run, on what was generated.

    Conservative: True where stock might differ, not only where it does.
    """
    if not any(paddings):
        return False
    size = params.no_repeat_ngram_size
    if before_run:
        if size == 1 or params.repetition_penalty != 1.0 and not stock_penalty_skips_padding():
            return True
        return any(len(w) > 1 and not pads.isdisjoint(w[:-1])
                   for pads in paddings if pads for w in params.bad_words_ids or ())
    if size < 2:
        return False
    return any(pads and not (pads.isdisjoint(row) and pads.isdisjoint(gen[:-1]))
               for pads, row, gen in zip(paddings, rows, generated))
