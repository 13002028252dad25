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
by field (`generation_config.py`). Whether the engine serves a call is decided in `routing.py`, which
`hf_paged.explain` asks too. Anything the engine does not reproduce exactly returns None from
`try_engine_generate` (the reason logged at INFO once per model), and `generate` runs stock
transformers with a `PagedCache` instead: beam search, attentions / hidden-states outputs, a caller's
logits processors together with an assistant model, scores or images (alone they run in the engine:
`logits_processors.py`), a cache passed in (other than a `ReturnedCache` whose columns the call
extends), `inputs_embeds`, a processor the engine lacks, multi-token `sequence_bias`, settings stock
rejects (greedy or assisted `num_return_sequences > 1`: stock raises its own error), and the two cases
where stock's processors see the left padding as tokens (`routing.padding_visible_to_processors`). Set
`model.hf_paged_use_engine = False` to always take that path.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..config import check_pool_fits
from ..engine import Engine
from ..engine.outputs import CompletionOutput
from .images import expanded_images
from .returned_cache import ReturnedCache
from .routing import (EngineCall, log_fallback, padding_visible_to_processors, passed_cache, plan_engine_call,
                      pool_kwargs)
from .stock_scores import output_vocab_size, stock_rows_after_finish
from .shared_prompts import generate_rows

__all__ = ["EngineCall", "build_output", "model_engine", "output_vocab_size", "passed_cache", "plan_engine_call",
           "pool_kwargs", "release", "try_engine_generate", "widen_engine"]

# The output field of the returned cache (`cache` since transformers 5.24, `past_key_values` before).
_CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


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
            log_fallback(call.model, f"images ({exc})")
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


def _raise_first_error(model, metrics: dict, per_row: list[list[CompletionOutput]]) -> None:
    """Raise the first failed sample's error (stock raises for the whole call), recording the metrics."""
    errors = [sample.error for row in per_row for sample in row if sample.error is not None]
    if errors:
        model.hf_paged_last_metrics = metrics
        raise errors[0]


def build_output(call: EngineCall, engine: Engine, samples: list, request_ids: list, metrics: dict):
    """What stock `generate` returns for `call`, from the engine's samples (one per output row) and the
    rows' request ids; None when stock must serve the call after all (its n-gram processor would have
    seen the padding). A `ReturnedCache` takes the rows' kept K/V."""
    model, gc, params, rows, pad, width = call.model, call.gc, call.params, call.rows, call.pad, call.width
    input_ids, attention_mask, passed, n = call.input_ids, call.attention_mask, call.passed, params.n
    kept = _kept_rows(engine, request_ids, rows, samples, n) if call.retain else None
    sample_rows = [rows[i // n] for i in range(len(samples))]
    paddings = call.paddings
    if padding_visible_to_processors(params, [paddings[i // n] for i in range(len(samples))], sample_rows,
                                      before_run=False, generated=[s.token_ids for s in samples]):
        log_fallback(model, "its n-gram processor sees the left padding")
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


# ---------------------------------------------------------------------------------- scores / logits
