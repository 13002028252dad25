"""What the engine hands back: `RequestOutput` (a request's result, or its state so far), with one
`CompletionOutput` per sample, and `StreamEvent` (one generated token, or a sample's end). Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..worker.sampler import TokenLogprobs
from .metrics import RequestMetrics


@dataclass
class CompletionOutput:
    """One sample of a request (`SamplingParams.n` of them).

    Attributes:
        index: the sample's position in `RequestOutput.outputs`.
        token_ids: generated tokens only.
        text: decoded `token_ids` when the engine has a tokenizer (cut before a matched stop string).
        finish_reason: "stop", "length", "abort", "error", or None while running.
        logprobs: with `SamplingParams.logprobs=k`, one `TokenLogprobs` per generated token.
        scores / logits: with `output_scores` / `output_logits`, one [vocab] fp32 row per generated
            token: the processed logits the token was drawn from / the model's raw logits.
        error: the exception that ended this sample (finish_reason "error").
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    scores: list[torch.Tensor] | None = None
    logits: list[torch.Tensor] | None = None
    error: Exception | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result (or, while streaming, the state so far) of one request.

    Attributes:
        request_id: the request's id.
        prompt_token_ids: the prompt as token ids.
        outputs: one `CompletionOutput` per sample (`SamplingParams.n`), in sample order.
        prompt_logprobs: with `SamplingParams.prompt_logprobs=k`, per prompt token: None for the first,
            then its `TokenLogprobs` under the model's raw distribution.
        metrics: the request's `RequestMetrics` (its first sample's, for n > 1).
        token_ids, text, finish_reason, error: the first sample's (`outputs[0]`), for the common n = 1;
            `finish_reason` is set once every sample has finished.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def text(self) -> str | None:
        return self.outputs[0].text if self.outputs else None

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs if self.outputs else None

    @property
    def error(self) -> Exception | None:
        return next((o.error for o in self.outputs if o.error is not None), None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamEvent:
    """One newly generated token of a streamed request, or a sample's end.

    Attributes:
        request_id, index: the request and its position in the prompts given to `stream` (0 for
            `submit`).
        token_id: the new token; None on an end event that carries no token (abort, error).
        text: the text this event adds (None without a tokenizer). Never half a character, never
            text that may still turn out to be the start of a stop string; the texts of all of a
            sample's events join to its final text.
        finish_reason: set on the sample's last event (exactly one per sample).
        sample_index: which of the request's `n` samples the token belongs to.
        logprobs: with `SamplingParams.logprobs=k`, the new token's `TokenLogprobs` (None otherwise,
            and on an end event that carries no token).
    """

    request_id: str
    index: int
    token_id: int | None
    text: str | None
    finish_reason: str | None
    sample_index: int = 0
    logprobs: TokenLogprobs | None = None
