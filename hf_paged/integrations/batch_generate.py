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
step, the processed logits each token was drawn from / the model's raw logits, and `cache`: a
`ReturnedCache` (`returned_cache.py`) that continues in the engine when passed back, reusing each
row's K/V, and behaves as stock's `DynamicCache` otherwise. Stock keeps feeding rows that already finished (pad tokens,
attended, at consecutive positions) and reports their scores at the later steps too; the engine
stops such a row at once, so those steps are computed afterwards the way stock computes them: one
teacher-forced dense forward of the row's whole padded sequence (its prompt with stock's attention
mask, its tokens, the pads after them; the "hf_paged" attention without paged metadata is
transformers' sdpa/eager), processed by stock's own `LogitsProcessorList` with stock's `input_ids` at
that step (`stock_scores.py`).

With images (`pixel_values` and the encoder's other inputs, for a model whose images the engine can
place: `hf.multimodal.ImageSupport`) each row becomes a request carrying its own images, split from
the batch's by each image's placeholder count as transformers splits them (`EngineCall.prompts`).

The generation config is merged exactly as stock merges it (the model's `generation_config`,
transformers' defaults such as `top_k=50`, the call's keywords, stock's length rules) and mapped field
by field (`generation_config.py`). Anything the engine does not reproduce exactly returns None from
`try_engine_generate`, and `generate` runs stock transformers with a `PagedCache` instead: beam search,
attentions / hidden-states outputs, a caller's logits processors together with an assistant model, scores or
images (alone they run in the engine: `logits_processors.py`), a cache passed in (other than a
`ReturnedCache` whose columns the call extends), `inputs_embeds`, a processor the engine lacks, multi-token `sequence_bias`, settings stock
rejects (greedy or assisted `num_return_sequences > 1`: stock raises its own error), and the two cases
where stock's processors see the left padding as tokens (`_padding_visible_to_processors`). Set
`model.hf_paged_use_engine = False` to always take that path.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading
import weakref
import warnings

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..config import PagedCacheConfig, check_pool_fits
from ..engine import Engine
from ..engine.tensor_parallel import tensor_parallel_group
from ..engine.outputs import CompletionOutput
from ..hf import PagedCache
from ..hf.multimodal import ImageSupport
from ..hf.support import has_latent_kv
from ..transformers_api import stock_penalty_skips_padding
from .images import expanded_images, image_data_of, image_side_inputs, row_prompts
from .returned_cache import ReturnedCache
from .logits_processors import StockProcessors, plan_processors, pool_holds_rows
from .stock_scores import output_vocab_size, stock_processors, stock_rows_after_finish
from .shared_prompts import generate_rows
from .generation_config import eos_token_ids_of, merged_generation_config, sampling_params_from, speculative_kwargs

logger = logging.getLogger(__name__)

_MODEL_INPUTS = {"input_ids", "attention_mask"}
# Keywords stock `generate` accepts and then ignores for a decoder-only model: `labels` (never
# forwarded; `Seq2SeqTrainer(predict_with_generate=True)` passes its batch whole) and a false
# `synced_gpus` (one process; a true one, for ZeRO-3/FSDP, goes to stock generate).
_IGNORED = {"labels"}
# Every GenerationConfig field may be passed as a keyword; `sampling_params_from` judges its value.
_CONFIG_KEYS = frozenset(GenerationConfig().to_dict()) | {"generation_config"}
# The output field of the returned cache (`cache` since transformers 5.24, `past_key_values` before).
_CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


@dataclasses.dataclass
class EngineCall:
    """One `generate` call the engine can serve, prepared: its merged config, sampling params and rows
    (`plan_engine_call`); `engine_kwargs` sizes an engine for it."""

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

    def prompts(self, engine: Engine) -> list:
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


def try_engine_generate(model, inputs, generation_config, kwargs: dict, engine: Engine | None = None):
    """Run `model.generate(inputs, generation_config, **kwargs)` through an `Engine` (the model's, or
    `engine`, idle, when given), or return None when the call needs something only stock generate
    provides."""
    call = plan_engine_call(model, inputs, generation_config, kwargs)
    if call is None:
        return None
    call.warn_pad(stacklevel=4)
    engine_kwargs = call.engine_kwargs()
    check_pool_fits(engine_kwargs["num_blocks"], engine_kwargs["block_size"], call.max_len)
    with contextlib.ExitStack() as stack:
        if engine is None:
            engine = stack.enter_context(model_engine(model, engine_kwargs, call.spec_kwargs(), call.eos_ids))
        else:
            widen_engine(engine, engine_kwargs)
        # Under tensor parallelism every rank makes this call: rank 0 runs it, the others follow its steps.
        return engine.run_on_every_rank(lambda: _run_call(call, engine))


def _run_call(call: EngineCall, engine: Engine):
    """Run a planned call on `engine`: what stock `generate` returns, or None when stock must serve it."""
    passed, rows, params = call.passed, call.rows, call.run_params()
    prefixes = passed.continuation_prefixes(engine, call.input_ids, call.attention_mask, rows) if passed else None
    try:
        try:
            prompts = call.prompts(engine)
        except ValueError as exc:  # images the engine cannot split per image: stock serves (or raises its own)
            logger.debug("hf_paged: stock generate serves this call (images: %s)", exc)
            if passed is not None:
                passed.release_rows()
            return None
        if call.is_stepwise:
            samples, request_ids = _run_stepwise(engine, prompts, params, call.input_ids, call.pad, call.streamer,
                                                 call.criteria, prefixes, call.retain)
            metrics = engine.metrics()
        elif call.retain or prefixes is not None or call.image_data is not None or call.processors is not None:
            outputs = engine.generate(prompts, params, kv_prefixes=prefixes, retain_kv=call.retain)
            metrics = engine.metrics()
            _raise_first_error(call.model, metrics, [out.outputs for out in outputs])
            # Row order of stock's expanded batch: prompt i's samples at rows i*n .. i*n + n-1.
            samples = [sample for out in outputs for sample in out.outputs]
            request_ids = [out.request_id for out in outputs]
        else:  # repeated prompts (RL rollouts) share their blocks
            per_row = generate_rows(engine, rows, params)
            metrics = engine.metrics()
            _raise_first_error(call.model, metrics, per_row)
            samples, request_ids = [sample for row in per_row for sample in row], [None] * len(rows)
    except BaseException:
        if passed is not None:
            passed.release_rows()  # what it handed to the call went with the call
        raise
    return build_output(call, engine, samples, request_ids, metrics)


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


def _raise_first_error(model, metrics: dict, per_row: list[list[CompletionOutput]]) -> None:
    """Raise the first failed sample's error (stock raises for the whole call), recording the metrics."""
    errors = [sample.error for row in per_row for sample in row if sample.error is not None]
    if errors:
        model.hf_paged_last_metrics = metrics
        raise errors[0]


def plan_engine_call(model, inputs, generation_config, kwargs: dict) -> EngineCall | None:
    """Prepare `model.generate(inputs, generation_config, **kwargs)` for the engine, or None when the
    call needs something only stock generate provides. Runs nothing."""
    if not getattr(model, "hf_paged_use_engine", True) or getattr(model.config, "is_encoder_decoder", False):
        return None
    if has_latent_kv(model.config):
        return None  # the Engine cannot serve latent attention; stock generate over a PagedCache can
    if _positions_itself(model):
        return None  # the engine's positions are not the ones this model's generate uses
    passed = passed_cache(kwargs)
    image_data, image_support = image_data_of(model, kwargs)
    image_side = image_side_inputs(image_support, kwargs, inputs if inputs is not None else kwargs.get("input_ids"))
    if image_side is None:
        return None
    unknown = set(kwargs) - _MODEL_INPUTS - _CONFIG_KEYS - _IGNORED - set(image_data or ()) - image_side - {
        "assistant_model", "streamer", "stopping_criteria", "tokenizer", "logits_processor", "prefix_allowed_tokens_fn"}
    if "synced_gpus" in kwargs and not kwargs["synced_gpus"]:
        unknown.discard("synced_gpus")
    if kwargs.get("synced_gpus") is None and _synced_by_default(model):
        return None  # stock turns synced_gpus on itself (ZeRO-3 or FSDP over several processes)
    if isinstance(passed, ReturnedCache):
        unknown -= {"cache", "past_key_values"}
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
    vocab_size = output_vocab_size(model)
    params = sampling_params_from(gc, width, vocab_size)
    if isinstance(params, str):
        logger.debug("hf_paged: stock generate serves this call (%s)", params)
        return None
    if image_data is not None and (params.output_scores or params.output_logits or assistant is not None):
        # Scores of rows that finished early come from a text-only teacher-forced forward; drafts see no images.
        logger.debug("hf_paged: stock generate serves this call (images with scores, logits or an assistant)")
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
    if passed is not None and passed.continuation_prefixes(None, input_ids, attention_mask, rows) is None:
        logger.debug("hf_paged: stock generate serves this call (it does not extend the cache passed in)")
        return None
    paddings = _paddings(input_ids, rows)
    if _padding_visible_to_processors(params, paddings, rows, before_run=True):
        logger.debug("hf_paged: stock generate serves this call (its processors see the left padding)")
        return None
    if params.output_scores:
        try:  # stock's processors complete finished rows' scores (see `stock_scores.stock_rows_after_finish`)
            stock_processors(model, gc, attention_mask.long(), width, input_ids.device)
        except Exception as exc:  # noqa: BLE001 - whatever stops it here, stock serves the call
            logger.debug("hf_paged: stock generate serves this call (its processors: %s)", exc)
            return None
    processors = None
    if kwargs.get("logits_processor") is not None or kwargs.get("prefix_allowed_tokens_fn") is not None:
        processors = plan_processors(model, gc, kwargs, params, attention_mask, width, assistant, image_data)
        if processors is False:
            return None
    streamer = kwargs.get("streamer")
    criteria = None
    if kwargs.get("stopping_criteria") or gc.stop_strings or gc.max_time is not None:
        try:  # stock's own list (max length, EOS, stop strings, max time and the caller's), called step by step
            stock_gc = copy.deepcopy(gc)
            model._prepare_special_tokens(stock_gc, True, device=input_ids.device)
            criteria = model._get_stopping_criteria(generation_config=stock_gc, stopping_criteria=kwargs.get(
                "stopping_criteria") or StoppingCriteriaList(), tokenizer=kwargs.get("tokenizer"))
        except (ValueError, TypeError, AttributeError) as exc:  # stock raises its own error for the same call
            logger.debug("hf_paged: stock generate serves this call (%s)", exc)
            return None
        if not eos_ids:
            # Without an EOS criterion stock keeps extending a row its criteria stopped (no padding).
            logger.debug("hf_paged: stock generate serves this call (stopping criteria without eos_token_id)")
            return None
    if (streamer is not None or criteria is not None) and (
            params.n > 1 or params.output_scores or params.output_logits
            or (params.no_repeat_ngram_size >= 2 and any(len(r) < width for r in rows))):
        # Fed step by step as the tokens come: only calls the engine surely serves to the end (no
        # after-run fallback to stock, which would feed a streamer twice), one sample per row, and no
        # scores (stock hands its criteria the scores tuple).
        logger.debug("hf_paged: stock generate serves this call (streamer/criteria with n=%d, scores or n-grams)",
                     params.n)
        return None
    call = EngineCall(model=model, gc=gc, params=params, input_ids=input_ids, attention_mask=attention_mask,
                      rows=rows, pad=pad, pad_warning=pad_warning, eos_ids=eos_ids, assistant=assistant,
                      streamer=streamer, criteria=criteria, passed=passed, paddings=paddings, image_data=image_data,
                      image_support=image_support, processors=processors)
    if processors is not None and not pool_holds_rows(call.model, call.engine_kwargs(), len(call.rows) * call.params.n,
                                                      call.max_len):
        # Lockstep needs every row running at once: a pool the caller capped may not hold them all.
        logger.debug("hf_paged: stock generate serves this call (its processors, and a pool too small for every row)")
        return None
    if "mm_token_type_ids" in image_side and call.retain:
        # A returned cache turns dense with 1-D positions (`ReturnedCache.to_dense`): not Qwen-VL's 3-D ones.
        logger.debug("hf_paged: stock generate serves this call (a returned cache of M-RoPE images)")
        return None
    if tensor_parallel_group(model) is not None and (
            call.retain or passed is not None or streamer is not None or criteria is not None or assistant is not None
            or image_data is not None or processors is not None):
        # Rank 0 alone runs a tensor-parallel call and hands the other ranks its result: returned caches,
        # streamers, a caller's stopping criteria and images stay with stock, which every rank runs.
        logger.debug("hf_paged: stock generate serves this tensor-parallel call (cache, streamer, criteria, images)")
        return None
    return call


def build_output(call: EngineCall, engine: Engine, samples: list, request_ids: list, metrics: dict):
    """What stock `generate` returns for `call`, from the engine's samples (one per output row) and the
    rows' request ids; None when stock must serve the call after all (its n-gram processor would have
    seen the padding). A `ReturnedCache` takes the rows' kept K/V."""
    model, gc, params, rows, pad, width = call.model, call.gc, call.params, call.rows, call.pad, call.width
    input_ids, attention_mask, passed, n = call.input_ids, call.attention_mask, call.passed, params.n
    kept = _kept_rows(engine, request_ids, rows, samples, n) if call.retain else None
    sample_rows = [rows[i // n] for i in range(len(samples))]
    paddings = call.paddings
    if _padding_visible_to_processors(params, [paddings[i // n] for i in range(len(samples))], sample_rows,
                                      before_run=False, generated=[s.token_ids for s in samples]):
        logger.debug("hf_paged: stock generate serves this call (its n-gram processor sees the left padding)")
        if kept is not None:
            engine.free_kv(kept)
        if passed is not None:
            passed.release_rows()
        return None
    model.hf_paged_last_metrics = metrics  # introspection: the last engine-served call
    device = input_ids.device
    generated = max(len(s.token_ids) for s in samples)
    sequences = torch.full((len(samples), width + generated), pad, dtype=torch.long, device=device)
    sequences[:, :width] = input_ids.repeat_interleave(n, dim=0) if n > 1 else input_ids
    for row, sample in enumerate(samples):
        sequences[row, width: width + len(sample.token_ids)] = torch.tensor(sample.token_ids, dtype=torch.long)
    cache = None
    if call.retain:
        mask = attention_mask.to(device="cpu", dtype=torch.long)
        mask = mask.repeat_interleave(n, dim=0) if n > 1 else mask
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], generated - 1)], dim=1)
        if passed is not None:
            passed.adopt(engine, sequences[:, :-1], mask, kept)
            cache = passed
        else:
            images = expanded_images(call.row_images, n)
            if images is not None and call.image_support.is_bidirectional:  # stock's token types, for to_dense
                images["token_type_ids"] = (sequences[:, :-1] == engine.image_token_id).long()
            cache = ReturnedCache(model, engine, sequences[:, :-1], mask, kept, images)
    if not gc.return_dict_in_generate:
        return sequences
    scores = logits = None
    if params.output_scores or params.output_logits:
        mask = attention_mask.to(device=device, dtype=torch.long)
        mask = mask.repeat_interleave(n, dim=0) if n > 1 else mask
        scores, logits = stock_rows_after_finish(model, gc, sequences, mask, width, samples, params)
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits,
                                     **({_CACHE_FIELD: cache} if cache is not None else {}))


def passed_cache(kwargs: dict):
    """The cache object a generate call passed (`cache=`, or `past_key_values=` before 5.24)."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _kept_rows(engine: Engine, request_ids: list[str | None], rows: list[list[int]], samples, n: int) -> list:
    """Per output row, the engine sequence kept for it (trimmed to the row's fed tokens: its prompt and
    all its generated tokens but the last), or None."""
    kept = []
    for i, rid in enumerate(request_ids):
        seqs = engine.kept_kv(rid) if rid is not None else []
        kept.extend(seqs + [None] * (n - len(seqs)))
    for r, (seq, sample) in enumerate(zip(kept, samples)):
        if seq is not None and not engine.trim_kv(seq, len(rows[r // n]) + max(len(sample.token_ids) - 1, 0)):
            kept[r] = None
    return kept


def _run_stepwise(engine: Engine, rows: list[list[int]], params, input_ids: torch.Tensor, pad: int, streamer,
                  criteria, prefixes=None, retain: bool = False) -> tuple[list, list]:
    """Run the rows through `engine.stream` and replay stock's per-step loop over what comes out.

    Step t happens once every row still running has its t-th token: the column of this step's tokens
    (a finished row's entry is the pad id, as in stock) extends stock's `[batch, width + t + 1]`
    `input_ids`; stock's `criteria` (a `StoppingCriteriaList`, per-row state and all) are called on it
    with `scores=None`, as stock calls them without `output_scores`; a row they stop keeps its tokens
    up to this step and its request is aborted (blocks freed at once); then `streamer` gets the
    column. `streamer.put` of the prompt ids comes first and `end()` last, as in stock. Rows run
    independently in the engine, so a row that ran ahead of a stop loses only tokens stock never
    made. `prefixes`, `retain`: as for `Engine.stream`. Returns the samples (`CompletionOutput`) in
    row order and the rows' request ids.

    Raises:
        RuntimeError: a request failed in the engine (stock would have raised from its forward).
    """
    if streamer is not None:
        streamer.put(input_ids.cpu())
    num_rows = len(rows)
    tokens: list[list[int]] = [[] for _ in rows]
    reasons: list[str | None] = [None] * num_rows
    request_ids: list[str | None] = [None] * num_rows
    stopped = [False] * num_rows  # by the criteria: nothing after the step they stopped it at counts
    ids, steps = input_ids, 0

    def advance(final: bool) -> None:
        nonlocal ids, steps
        while True:
            live = [i for i in range(num_rows) if not stopped[i] and len(tokens[i]) > steps]
            waiting = [i for i in range(num_rows) if not stopped[i] and reasons[i] is None and len(tokens[i]) <= steps]
            if not live or (waiting and not final):
                return
            column = [tokens[i][steps] if i in live else pad for i in range(num_rows)]
            ids = torch.cat([ids, torch.tensor(column, dtype=ids.dtype, device=ids.device)[:, None]], dim=1)
            if criteria is not None:
                done = criteria(ids, None)
                for i in live:
                    if bool(done[i]) and not stopped[i]:
                        stopped[i] = True
                        del tokens[i][steps + 1:]
                        if reasons[i] is None:
                            reasons[i] = "stop"
                            engine.abort(request_ids[i])
            if streamer is not None:
                streamer.put(torch.tensor(column, dtype=torch.long))
            steps += 1

    for event in engine.stream(rows, params, kv_prefixes=prefixes, retain_kv=retain):
        i = event.index
        request_ids[i] = event.request_id
        if stopped[i]:
            continue
        if event.token_id is not None:
            tokens[i].append(event.token_id)
        if event.finish_reason is not None:
            reasons[i] = event.finish_reason
        advance(final=False)
    advance(final=True)
    if streamer is not None:
        streamer.end()
    failed = [i for i, r in enumerate(reasons) if r == "error"]
    if failed:
        raise RuntimeError(f"hf_paged: the engine failed rows {failed}")
    return [CompletionOutput(0, token_ids=t, finish_reason=r) for t, r in zip(tokens, reasons)], request_ids


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


def _padding_visible_to_processors(params, paddings: list[set[int]], rows: list[list[int]], before_run: bool,
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


_ENGINE_ATTR = "_hf_paged_engine"  # the model's `_EngineSlot`
_SLOTS_GUARD = threading.Lock()


class _EngineSlot:
    """Where a model keeps its drop-in engine. A copy or pickle of the model gets an empty slot (an
    engine and a lock neither copy nor pickle, and a copied model must not share the original's K/V)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.key: tuple | None = None
        self.engine: Engine | None = None
        self.release_pending = False  # `release` came while a call held the engine: drop it after

    def __deepcopy__(self, memo):
        return _EngineSlot()

    def __reduce__(self):
        return (_EngineSlot, ())


def _slot_of(model) -> _EngineSlot:
    with _SLOTS_GUARD:
        slot = model.__dict__.get(_ENGINE_ATTR)
        if slot is None:
            slot = _EngineSlot()
            object.__setattr__(model, _ENGINE_ATTR, slot)  # a plain attribute, not a submodule
        return slot


@contextlib.contextmanager
def model_engine(model, engine_kwargs: dict, spec_kwargs: dict, eos_ids: list[int]):
    """The model's drop-in engine for one call, kept across calls with its pool and prefix cache.

    Reused while the cache settings and speculative settings stay the same (else replaced). Between
    calls its pool grows to what the call needs (`engine_kwargs["num_blocks"]`; with a `max_kv_bytes`
    budget the pool is that budget from the start), and its `max_num_seqs` / `max_model_len` widen;
    its metrics restart, so `model.hf_paged_last_metrics` describes this call. A weights change is
    seen at the next step (`Engine._note_weights`): no prefix computed under other weights is ever
    hit. One call at a time uses it; a call made while another thread's call runs gets an engine of
    its own for that call. `release(model)` drops it and its memory.
    """
    slot = _slot_of(model)
    if not slot.lock.acquire(blocking=False):  # another call of this model is running
        yield Engine(model, **engine_kwargs, show_progress=False, eos_token_ids=eos_ids, **spec_kwargs)
        return
    try:
        fixed = {k: v for k, v in engine_kwargs.items() if k not in ("num_blocks", "max_num_seqs", "max_model_len")}
        weight = next(model.parameters(), None)  # a cast or a move (TRL casts for its rollouts): new pool
        key = (tuple(sorted(fixed.items())),
               tuple(sorted((k, id(v) if isinstance(v, torch.nn.Module) else v) for k, v in spec_kwargs.items())),
               None if weight is None else (weight.dtype, weight.device))
        engine = slot.engine
        if engine is not None and slot.key == key and not engine.has_unfinished_requests():
            engine.drop_unclaimed_kv()
            widen_engine(engine, engine_kwargs, kept_blocks=engine.num_used_kv_blocks)  # idle: all kept
            engine.eos_token_ids = list(eos_ids)
            engine.reset_metrics()
        else:
            slot.engine = None  # the old engine's memory goes before the new one's comes
            engine = Engine(model, **engine_kwargs, show_progress=False, eos_token_ids=eos_ids, **spec_kwargs)
            slot.key, slot.engine = key, engine
        yield engine
    finally:
        if slot.release_pending:
            slot.engine, slot.key, slot.release_pending = None, None, False
        slot.lock.release()


def widen_engine(engine: Engine, engine_kwargs: dict, kept_blocks: int = 0) -> None:
    """Let `engine` take a call sized by `engine_kwargs`: its `max_num_seqs` and `max_model_len` widen,
    and its pool grows to the call's blocks plus `kept_blocks` (what returned caches hold in it, for an
    idle engine its blocks in use). Never shrinks anything."""
    num_blocks = engine_kwargs["num_blocks"]
    engine.resize(max_num_seqs=engine_kwargs["max_num_seqs"], max_model_len=engine_kwargs["max_model_len"],
                  num_blocks=None if num_blocks is None else num_blocks + kept_blocks)


def release(model) -> bool:
    """Drop the engine the drop-in `generate` keeps for `model` (its KV pool and prefix cache, and the
    blocks returned caches keep there); the next call builds a new one. Never waits: while a call (or a
    pipeline being iterated) uses the engine, it is dropped when that ends. Returns whether there was
    one."""
    slot = model.__dict__.get(_ENGINE_ATTR)
    if slot is None or slot.engine is None:
        return False
    if slot.lock.acquire(blocking=False):
        try:
            slot.engine, slot.key = None, None
        finally:
            slot.lock.release()
    else:
        slot.release_pending = True
    return True


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


# ---------------------------------------------------------------------------------- scores / logits
