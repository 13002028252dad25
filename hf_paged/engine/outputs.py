"""What the engine hands back: `RequestOutput`, `StreamEvent`, and turning token ids into text.

Owns detokenising (the final text, stream deltas, the stop-string search); it never changes a
request's state or touches the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .metrics import RequestMetrics


@dataclass
class RequestOutput:
    """The result (or, while streaming, the state so far) of one request.

    Attributes:
        request_id: the request's id.
        prompt_token_ids: the prompt as token ids.
        token_ids: generated tokens only.
        text: decoded `token_ids` when the engine has a tokenizer (cut before a matched stop string).
        finish_reason: "stop" (end-of-sequence, stop token or stop string), "length"
            (max_new_tokens or the model's max positions), "abort", "error", or None while running.
        metrics: the request's `RequestMetrics`.
        error: the exception that rejected the request (finish_reason "error").
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    error: Exception | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamEvent:
    """One newly generated token of a streamed request.

    Attributes:
        request_id, index: the request and its position in the prompts given to `stream`.
        token_id: the new token.
        text: the text this token adds (None without a tokenizer).
        finish_reason: set on the request's last event.
    """

    request_id: str
    index: int
    token_id: int
    text: str | None
    finish_reason: str | None


def decode_output(tokenizer, token_ids: list[int], skip_special_tokens: bool) -> str:
    """The text of generated `token_ids`."""
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def stop_string_cut(text: str, stop_strings: list[str]) -> int | None:
    """Where `text` must be cut before the earliest stop string in it, or None if none occurs."""
    cuts = [c for c in (text.find(s) for s in stop_strings) if c >= 0]
    return min(cuts) if cuts else None


class StreamText:
    """Per-request text deltas of a stream: each event adds what its token added to the text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[str, str] = {}

    def delta(self, out: RequestOutput) -> str | None:
        if self.tokenizer is None:
            return None
        full = out.text if out.finished else decode_output(self.tokenizer, out.token_ids, skip_special_tokens=True)
        seen = self._texts.get(out.request_id, "")
        self._texts[out.request_id] = full
        return full[len(seen):]
