"""`pipeline("text-generation")` with continuous batching across batches.

Stock `TextGenerationPipeline` iterates a DataLoader of padded batches and calls `generate` once per
batch: 256 prompts at `batch_size=8` are 32 calls, each waiting for its slowest row. For a model with
`attn_implementation="hf_paged"`, `get_iterator` is wrapped (version-guarded, with the generate patch,
undone by `uninstall()`): the batches still come from stock's DataLoader (a list, a `KeyDataset`, a
dataset or a generator, chats included) and every output still goes through stock's `_forward` and
`postprocess` (the same records, in the same order), but each batch's rows are queued in the model's
engine as soon as the DataLoader yields the batch, up to `IN_FLIGHT_ROWS` rows (at least two batches)
in flight. The engine runs rows of many batches at once, and a finished row's place is taken by the
next batch's at once: no batch boundary.

How a batch is served without re-implementing `_forward`: the pipeline's `forward(batch)` runs once
with `model.generate` intercepted, which captures the call it makes (prepared for the engine by
`batch_generate.plan_engine_call`; its rows queued), and once more when those rows are done, with
`generate` answering what stock's answers for them (`batch_generate.build_output`). A batch the
engine cannot serve ahead (stock-only arguments; a streamer or stopping criteria, which see every
step) runs when every batch before it is out, through the drop-in `generate` as usual.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue

from transformers.pipelines.pt_utils import PipelineIterator
from transformers.pipelines.text_generation import TextGenerationPipeline

from ..engine import Engine
from ..engine.delivery import Inbox
from ..engine.outputs import RequestOutput
from .batch_generate import EngineCall, build_output, model_engine, plan_engine_call, try_engine_generate, widen_engine
from .intercept import intercept_generate

# Rows queued in the engine ahead of the pipeline's consumer (or two batches, if more).
IN_FLIGHT_ROWS = 64

_original_get_iterator = None


def install() -> None:
    """Wrap `TextGenerationPipeline.get_iterator`. Idempotent; called by `generate.install`."""
    global _original_get_iterator
    if _original_get_iterator is not None:
        return
    original = TextGenerationPipeline.get_iterator
    _original_get_iterator = original

    def get_iterator(self, inputs, num_workers, batch_size, preprocess_params, forward_params, postprocess_params):
        final = original(self, inputs, num_workers, batch_size, preprocess_params, forward_params, postprocess_params)
        model_iterator = getattr(final, "loader", None)
        if not (_serves(self) and isinstance(model_iterator, PipelineIterator)
                and getattr(model_iterator, "infer", None) == self.forward):
            return final  # another model, or a layout this wrapper was not written for: stock's batches
        window = max(IN_FLIGHT_ROWS, 2 * (batch_size or 1))
        model_iterator.loader = EngineFeeder(self, model_iterator.loader, forward_params, window)
        model_iterator.infer, model_iterator.params = _already_forwarded, {}
        return final

    TextGenerationPipeline.get_iterator = get_iterator


def uninstall() -> None:
    global _original_get_iterator
    if _original_get_iterator is not None:
        TextGenerationPipeline.get_iterator = _original_get_iterator
        _original_get_iterator = None


def _serves(pipe) -> bool:
    model = getattr(pipe, "model", None)
    config = getattr(model, "config", None)
    return (getattr(config, "_attn_implementation", None) == "hf_paged"
            and getattr(model, "hf_paged_use_engine", True) and not getattr(config, "is_encoder_decoder", False))


def _already_forwarded(model_outputs, **_):
    return model_outputs


class _Captured(BaseException):
    """The `generate` call a pipeline's `forward` was about to make (a BaseException, so that no
    `except Exception` on the way swallows it)."""

    def __init__(self, model, inputs, generation_config, args: tuple, kwargs: dict):
        super().__init__("captured")
        self.call = (model, inputs, generation_config, args, kwargs)


@dataclasses.dataclass
class _Batch:
    """One DataLoader batch on its way through the engine."""

    batch: dict
    call: EngineCall | None  # None: served in order by the drop-in generate
    output: dict | None = None  # `forward` ran to the end while being captured (it never called generate)
    same_engine: bool = True  # False: served in order, but not on the feeder's engine (other settings)
    inbox: Inbox | None = None
    request_ids: list[str] = dataclasses.field(default_factory=list)
    finals: dict[str, RequestOutput] = dataclasses.field(default_factory=dict)

    @property
    def done(self) -> bool:
        return len(self.finals) == len(self.request_ids)

    def collect(self) -> None:
        while self.inbox is not None and not self.done:
            try:
                _, final = self.inbox.get_nowait()
            except queue.Empty:
                return
            if final is not None:
                self.finals[final.request_id] = final


class EngineFeeder:
    """Stands in for the pipeline's DataLoader in its model iterator: yields each batch's
    `forward` output, in order, while keeping up to `window` rows of later batches in the engine."""

    def __init__(self, pipe, loader, forward_params: dict, window: int):
        self.pipe = pipe
        self.loader = loader
        self.forward_params = forward_params
        self.window = window

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        pending: list[_Batch] = []
        batches = iter(self.loader)
        exhausted = False
        engine: Engine | None = None
        settings = None  # the engine's speculative settings and EOS ids: later calls must match them
        with contextlib.ExitStack() as stack:
            try:
                while True:
                    while not exhausted and self._in_flight(pending) < self.window and (
                            not pending or pending[-1].call is not None):
                        try:
                            batch = next(batches)
                        except StopIteration:
                            exhausted = True
                            break
                        entry = self._capture(batch)
                        if entry.call is not None:
                            call = entry.call
                            if engine is None:  # the model generate was called on (a wrapper's base model)
                                settings = (call.spec_kwargs(), call.eos_ids)
                                engine = stack.enter_context(model_engine(
                                    call.model, call.engine_kwargs(self.window), *settings))
                            if (call.spec_kwargs(), call.eos_ids) != settings or call.model is not engine.model:
                                entry.call, entry.same_engine = None, False
                            else:
                                widen_engine(engine, call.engine_kwargs(self.window))
                                self._submit(engine, entry)
                        pending.append(entry)
                    if not pending:
                        return
                    head = pending[0]
                    if head.call is None:
                        pending.pop(0)
                        yield head.output if head.output is not None else self._in_order(
                            head.batch, engine if head.same_engine else None)
                        continue
                    for entry in pending:
                        entry.collect()
                    if head.done:
                        pending.pop(0)
                        yield self._replay(head, engine)
                        continue
                    if not engine.has_unfinished_requests():
                        raise RuntimeError("hf_paged: the engine finished without the rows of a pipeline batch")
                    engine.advance()
            finally:
                if engine is not None:
                    for entry in pending:
                        for rid in entry.request_ids:
                            if rid not in entry.finals:
                                engine.abort(rid)

    @staticmethod
    def _in_flight(pending: list[_Batch]) -> int:
        return sum(len(e.request_ids) - len(e.finals) for e in pending)

    def _forward(self, batch: dict, answer):
        """The pipeline's `forward(batch)`, its `generate` call answered by `answer`."""
        with intercept_generate(answer):
            return self.pipe.forward(dict(batch), **self.forward_params)

    def _capture(self, batch: dict) -> _Batch:
        """The batch, with its `generate` call prepared for queueing (`call`), or to run in order."""
        def capture(model, inputs, generation_config, args, kwargs):
            raise _Captured(model, inputs, generation_config, args, kwargs)

        try:
            output = self._forward(batch, capture)
        except _Captured as captured:
            model, inputs, generation_config, args, kwargs = captured.call
            call = None if args else plan_engine_call(model, inputs, generation_config, kwargs)
            if call is not None and (call.is_stepwise or call.passed is not None or call.processors is not None):
                call = None
            return _Batch(batch, call)
        return _Batch(batch, None, output=output)  # `forward` never reached generate: its output stands

    def _submit(self, engine: Engine, entry: _Batch) -> None:
        call = entry.call
        call.warn_pad(stacklevel=3)
        entry.inbox = Inbox(wants_tokens=False)
        for i, row in enumerate(call.rows):
            entry.request_ids.append(engine.add_owned_request(row, call.params, None, entry.inbox, i))

    def _replay(self, entry: _Batch, engine: Engine):
        outputs = [entry.finals[rid] for rid in entry.request_ids]
        errors = [o.error for o in outputs if o.error is not None]
        if errors:
            raise errors[0]
        samples = [sample for out in outputs for sample in out.outputs]
        result = build_output(entry.call, engine, samples, entry.request_ids, engine.metrics())
        if result is None:  # stock serves it after all (see `build_output`)
            return self._in_order(entry.batch, engine)
        return self._forward(entry.batch, lambda *_: result)

    def _in_order(self, batch: dict, engine: Engine | None):
        """`forward(batch)` through the drop-in generate, on this feeder's engine (idle now: every batch
        before this one is out, none after it queued) or, before there is one, the model's."""
        def serve(model, inputs, generation_config, args, kwargs):
            if engine is None or args:
                return NotImplemented
            result = try_engine_generate(model, inputs, generation_config, kwargs, engine=engine)
            return NotImplemented if result is None else result

        return self._forward(batch, serve)
