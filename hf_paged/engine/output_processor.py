"""`OutputProcessor`: everything a request returns besides its token ids being advanced: text
(incremental detokenising and stop strings), streaming events to the owner's inbox, logprobs /
scores / logits, and the `RequestOutput` of a request and its n samples.

The core (`core.py`) decides the tokens; for each request it calls, in this order,

    cut(tracked, tokens, reason)        text deltas, cut at a stop string (may raise: nothing changed)
    record(tracked, tokens, deltas, out) after the tokens are committed: events, logprobs, inbox
    finish(tracked, reason, last_event)  once, when the request ends: settled text, the last event

and `output(tracked)` builds what `step()` returns. This is the only place that touches a tokenizer
after intake.
"""

from __future__ import annotations

import logging

import torch

from ..sampling_params import SamplingParams
from ..worker.sampler import SamplerOutput, logprobs_of
from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestOutput, StreamEvent
from .tracked import TrackedRequest

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Text, events and outputs of the engine's requests. `tokenizer` may be None (token ids only)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def new_detokenizer(self, prompt_ids: list[int], params: SamplingParams,
                        streamed: bool) -> IncrementalDetokenizer | None:
        """A request's incremental text state: when its text streams or it has stop strings."""
        if self.tokenizer is None or not (streamed or params.stop_strings):
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=params.skip_special_tokens,
                                      stop_strings=params.stop_strings)

    def fork_detokenizer(self, parent: TrackedRequest, prompt_ids: list[int]) -> IncrementalDetokenizer | None:
        """Sample j's text state: a fresh one over the shared prompt, if its parent has one."""
        if parent.detok is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=parent.params.skip_special_tokens,
                                      stop_strings=parent.params.stop_strings)

    # ------------------------------------------------------------------ per step
    @staticmethod
    def cut(tracked: TrackedRequest, tokens: list[int], reason: str | None) -> tuple[list[int], str | None, list[str]]:
        """Feed `tokens` to the request's text state: returns the tokens kept (cut after a stop string),
        the finish reason, and one text delta per kept token (none without a text state). May raise;
        nothing of the request has changed then except its text state (see `replay`)."""
        deltas: list[str] = []
        if tracked.detok is None:
            return tokens, reason, deltas
        for j, token in enumerate(tokens):
            deltas.append(tracked.detok.add(token))
            if tracked.detok.stop_hit is not None:
                tokens, reason = tokens[: j + 1], "stop"
                break
        if reason is not None:
            deltas[-1] += tracked.detok.finish()
        if tracked.pending_text and deltas:
            deltas[0] = tracked.pending_text + deltas[0]
        return tokens, reason, deltas

    @staticmethod
    def record(tracked: TrackedRequest, tokens: list[int], deltas: list[str], out: SamplerOutput,
               finished: bool) -> list[StreamEvent]:
        """The committed tokens' events (row j of `out` came with token j): logprobs, scores and logits
        are recorded, and every event but a finished request's last goes to its owner now (the last
        one carries the finish, see `finish`). Never raises for a well-formed request. A request
        without an owner's inbox (`add_request`) gets no events: nothing would read them."""
        if deltas:
            tracked.pending_text = ""
        num_tokens = len(tokens)
        if tracked.logprobs is not None:
            tracked.logprobs.extend(out.logprobs[:num_tokens])
        if tracked.scores is not None:
            tracked.scores.extend(out.scores[:num_tokens])
        if tracked.logits is not None:
            tracked.logits.extend(out.logits[:num_tokens])
        if tracked.inbox is None:
            return []
        events = [StreamEvent(tracked.public_id, tracked.index, token, delta, None, tracked.sample_index,
                              out.logprobs[j] if tracked.logprobs is not None else None)
                  for j, (token, delta) in enumerate(zip(tokens, deltas or [None] * num_tokens))]
        for event in events[:-1] if finished else events:
            tracked.inbox.put(event, None)
        return events

    @staticmethod
    def record_prompt_logprobs(tracked: TrackedRequest, start: int, num_tokens: int, rows: torch.Tensor) -> None:
        """Prompt logprobs from a chunk's logits rows (`rows[j]` at position `start + j`, which predicts
        token `start + j + 1`)."""
        request = tracked.request
        targets = [(j, start + j + 1) for j in range(num_tokens) if start + j + 1 < request.num_prompt_tokens]
        if not targets:
            return
        found = logprobs_of(rows[[j for j, _ in targets]], [request.token_ids[t] for _, t in targets],
                            tracked.params.prompt_logprobs)
        for (_, t), entry_lp in zip(targets, found):
            tracked.group.prompt_logprobs[t] = entry_lp

    def replay(self, tracked: TrackedRequest) -> None:
        """Rebuild a request's text state from its committed tokens (after a failed step). May raise."""
        if tracked.detok is None:
            return
        request = tracked.request
        detok = IncrementalDetokenizer(self.tokenizer, request.token_ids[: request.num_prompt_tokens],
                                       skip_special_tokens=tracked.params.skip_special_tokens,
                                       stop_strings=tracked.params.stop_strings)
        for token in tracked.output_ids:
            detok.add(token)
        tracked.detok = detok

    # ------------------------------------------------------------------ the end
    def finish(self, tracked: TrackedRequest, reason: str, last_event: StreamEvent | None, tail: str,
               output: RequestOutput | None) -> None:
        """Tell the owner that a sample ended: its last event carries the finish reason, the text's
        tail and (for the request's last sample) the whole output."""
        if tracked.inbox is None:
            return
        if last_event is None:
            text = tail if tracked.detok is not None else None
            last_event = StreamEvent(tracked.public_id, tracked.index, None, text, reason, tracked.sample_index)
        else:
            last_event.finish_reason = reason
            if tail:
                last_event.text = (last_event.text or "") + tail
        tracked.inbox.put(last_event, output)

    def settle_text(self, tracked: TrackedRequest) -> str:
        """Set the finished request's `.text`; returns the stream's last delta. If the incremental
        text fails now, the text is decoded whole instead (and the stream's tail is that remainder)."""
        if self.tokenizer is None:
            return ""
        if tracked.detok is not None:
            try:
                tail = tracked.detok.finish()
                tracked.text = tracked.detok.text
                return tail
            except Exception:
                logger.warning("hf_paged: detokenising request %r failed at its end; decoding it whole",
                               tracked.request.request_id, exc_info=True)
        try:
            text = self.tokenizer.decode(tracked.output_ids, skip_special_tokens=tracked.params.skip_special_tokens)
        except Exception:
            logger.warning("hf_paged: decoding request %r failed", tracked.request.request_id, exc_info=True)
            return ""
        shown = tracked.detok.text if tracked.detok is not None else ""
        tracked.text = text
        return text[len(shown):] if text.startswith(shown) else ""

    @staticmethod
    def output(tracked: TrackedRequest) -> RequestOutput:
        """The request's output so far: every sample of it (text is set once a sample finishes;
        streams carry their own deltas)."""
        group = tracked.group
        first = group.members[0]
        outputs = []
        for j, m in enumerate(group.members):
            if m is None:  # never forked: the request ended first
                outputs.append(CompletionOutput(j, finish_reason=group.unforked_reason, error=first.error))
                continue
            outputs.append(CompletionOutput(
                # output_ids is already a fresh slice: copying it again cost O(length) per request and step
                index=j, token_ids=m.output_ids, text=m.text, finish_reason=m.finish_reason,
                logprobs=None if m.logprobs is None else list(m.logprobs),
                scores=None if m.scores is None else list(m.scores),
                logits=None if m.logits is None else list(m.logits), error=m.error))
        request = first.request
        prompt_logprobs = None
        if first.params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [group.prompt_logprobs.get(t) for t in range(1, request.num_prompt_tokens)]
        return RequestOutput(
            request_id=group.request_id,
            prompt_token_ids=request.token_ids[: request.num_prompt_tokens],
            outputs=outputs,
            prompt_logprobs=prompt_logprobs,
            metrics=first.metrics,
            finish_reason=outputs[0].finish_reason if group.finished else None,
        )
