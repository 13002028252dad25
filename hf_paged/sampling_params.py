"""`SamplingParams`: one request's sampling settings, with transformers' and vLLM's field names, and
the limits they are checked against. A request-level type, torch-free: the engine, the server, batch
jobs and the drop-in `generate` all build it; the sampler (`worker/sampler.py`) consumes it through
`worker.sampling.SamplingState`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .config import MAX_SPECULATIVE_TOKENS
from .structured_outputs import StructuredOutputs

LOGPROBS_MODES = ("processed", "raw")
MAX_LOGPROBS = 20  # vLLM's default cap on logprobs / prompt_logprobs
# Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`): the one rule for every path that decides
# greediness (`SamplingParams.is_greedy`). logits / 1e-45 overflows fp32 to inf, and 1e-45 itself
# rounds to a denormal or to 0, so such a temperature cannot be sampled from as written.
SAMPLING_EPS = 1e-5
# The fp32 range the sampler computes in. Settings that would leave it once cast (an infinite
# bias or temperature, a repetition penalty that rounds to 0) are refused by `validate`; a finite
# result that still overflows (a huge logit plus a huge bias, divided by a small penalty or
# temperature) is clamped to FP32_MAX by the sampler, so no processed value is ever +inf or NaN.
FP32_MAX = float(np.finfo(np.float32).max)
FP32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal fp32


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    """How one request generates. Field names follow transformers' `GenerationConfig`, and vLLM's
    `SamplingParams` where transformers has none.

    Args:
        max_new_tokens: most tokens to generate (> 0).
        min_new_tokens: end-of-sequence and `stop_token_ids` are masked until this many were generated.
        temperature: below `SAMPLING_EPS` (1e-5, vLLM's rule; 0 included) means greedy (argmax): a
            tinier temperature cannot be divided by in fp32. At or above it, samples from
            softmax(logits / temperature). At most `FP32_MAX`.
        top_k: keep the k most likely tokens, ties at the k-th value included (0 disables).
        top_p: nucleus sampling; keep the smallest set of tokens whose probability reaches top_p (1 disables).
        min_p: drop tokens less likely than `min_p` times the most likely one (0 disables).
        seed: keys this request's random draws (with each token's position); None draws a seed from
            torch's global RNG when the request is added.
        n: independent samples of the prompt, returned together in one `RequestOutput.outputs`; they
            share the prompt's KV blocks (one prefill, copy-on-write after it).
        stop_token_ids: extra token ids that end the request (the token is kept in the output).
        stop: strings that end the request once the decoded text contains one (needs a tokenizer);
            the text is cut before the stop string.
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        repetition_penalty: transformers' CTRL-style penalty on every token already in prompt or output:
            a logit x becomes x / penalty if x > 0, else x * penalty (1 disables). In
            [`FP32_TINY`, `FP32_MAX`] (a normal fp32 number).
        presence_penalty: OpenAI/vLLM: subtracted once from the logit of every token already generated
            (prompt tokens do not count; 0 disables; may be negative).
        frequency_penalty: OpenAI/vLLM: subtracted from a token's logit once per time it was generated.
        logit_bias: `{token_id: bias}` added to those logits before everything else (transformers'
            `sequence_bias` with one-token sequences). Biases are at most `FP32_MAX` in magnitude.
        bad_words_ids: token sequences never to generate (transformers' semantics: a one-token entry
            is always banned, a longer one bans its last token after the rest; end-of-sequence tokens
            alone are never banned).
        no_repeat_ngram_size: no n-gram of this size occurs twice in prompt + output (0 disables).
        logprobs: return, for each generated token, its log-probability and those of the `logprobs`
            most likely tokens (0: the chosen token only; None: nothing).
        prompt_logprobs: the same for each prompt token after the first, under the model's raw
            distribution (the request then computes its whole prompt: no prefix-cache hits).
        logprobs_mode: "processed" (default, vLLM's): log_softmax of the logits after every processor
            above (-inf outside top-k/top-p); "raw": log_softmax of the model's logits.
        output_scores / output_logits: keep, for each generated token, the processed / raw logits row
            (`CompletionOutput.scores` / `.logits`; what transformers' `output_scores` / `output_logits`
            return). Costs a vocabulary-sized row per token.
        skip_special_tokens: drop special tokens when decoding `.text`.
        num_speculative_tokens: tokens drafted per step for this request when the engine speculates
            (None: the engine's setting; 0: no speculation for this request).
        batch_processor: a `worker.sampler.BatchProcessor` shared by the requests of one batch (a drop-in
            `generate` call's `logits_processor` / `prefix_allowed_tokens_fn`): the engine samples those
            requests in lockstep, and hands it their logits, in the batch's row order, after the
            processors above and before temperature, top-k, top-p and min-p (transformers' place for a
            caller's processors). Such a request is never speculated on.
        structured: a `StructuredOutputs` constraint (JSON schema, JSON object, regex, choice, grammar,
            structural tag): tokens that would break it are masked after the processors above (needs
            the engine's tokenizer and the `structured` extra). Drafts are checked against it too.

    The processing order is transformers' own: logit bias, repetition penalty (then presence and
    frequency, as vLLM orders its penalties), n-gram and bad-word bans, the `min_new_tokens` mask, then
    (when sampling) temperature, top-k, top-p and min-p. Values are checked by `validate()`, which the
    engine calls when a request is added, so one bad request is reported on its own.
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    bad_words_ids: list[list[int]] | None = None
    no_repeat_ngram_size: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "processed"
    output_scores: bool = False
    output_logits: bool = False
    skip_special_tokens: bool = True
    num_speculative_tokens: int | None = None
    batch_processor: object | None = None
    structured: StructuredOutputs | None = None

    @property
    def is_greedy(self) -> bool:
        """Whether the request takes the argmax: a temperature below `SAMPLING_EPS`."""
        return self.temperature < SAMPLING_EPS

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_history_processors(self) -> bool:
        """Whether processing depends on the tokens so far (beyond the `min_new_tokens` count)."""
        return self.has_penalties or bool(self.bad_words_ids) or self.no_repeat_ngram_size > 0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError/TypeError naming the first bad field. With `vocab_size`, token ids in
        `logit_bias` and `bad_words_ids` are checked against it."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens!r}"
            )
        if not _is_number(self.temperature) or not 0 <= self.temperature <= FP32_MAX:
            raise ValueError(f"temperature must be a number in [0, {FP32_MAX:.4g}] (below {SAMPLING_EPS:g} = "
                             f"greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        if self.stop is not None and not (
            isinstance(self.stop, str) or (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop))
        ):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        if self.num_speculative_tokens is not None and (
            not _is_int(self.num_speculative_tokens) or not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS
        ):
            raise ValueError(f"num_speculative_tokens must be None or an integer in [0, {MAX_SPECULATIVE_TOKENS}], got "
                             f"{self.num_speculative_tokens!r}")
        if not _is_number(self.repetition_penalty) or not FP32_TINY <= self.repetition_penalty <= FP32_MAX:
            raise ValueError(f"repetition_penalty must be a number in [{FP32_TINY:.4g}, {FP32_MAX:.4g}] (a normal "
                             f"fp32 number > 0), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2] (OpenAI's range), got {value!r}")
        in_vocab = (lambda t: _is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                in_vocab(t) and _is_number(b) and abs(b) <= FP32_MAX for t, b in self.logit_bias.items()
            ):
                raise ValueError(f"logit_bias must map in-vocabulary token ids to numbers in [-{FP32_MAX:.4g}, "
                                 f"{FP32_MAX:.4g}], got {self.logit_bias!r}")
        if self.bad_words_ids is not None:
            if not isinstance(self.bad_words_ids, (list, tuple)) or not all(
                isinstance(w, (list, tuple)) and len(w) > 0 and all(in_vocab(t) for t in w) for w in self.bad_words_ids
            ):
                raise ValueError("bad_words_ids must be a list of non-empty lists of in-vocabulary token ids, got "
                                 f"{self.bad_words_ids!r}")
        if not _is_int(self.no_repeat_ngram_size) or self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be an integer >= 0, got {self.no_repeat_ngram_size!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.batch_processor is not None and not callable(self.batch_processor):
            raise TypeError(f"batch_processor must be a callable BatchProcessor, got {type(self.batch_processor).__name__}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputs):
                raise TypeError(f"structured must be a StructuredOutputs, got {type(self.structured).__name__}")
            self.structured.validate()
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
