"""What the engine hands back: `RequestOutput` (a request's result, or its state so far) and
`StreamEvent` (one generated token, or a request's end). Plain data."""

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
    """One newly generated token of a streamed request, or its end.

    Attributes:
        request_id, index: the request and its position in the prompts given to `stream` (0 for
            `submit`).
        token_id: the new token; None on an end event that carries no token (abort, error).
        text: the text this event adds (None without a tokenizer). Never half a character, never
            text that may still turn out to be the start of a stop string; the texts of all of a
            request's events join to its final `RequestOutput.text`.
        finish_reason: set on the request's last event (exactly one per request).
    """

    request_id: str
    index: int
    token_id: int | None
    text: str | None
    finish_reason: str | None
