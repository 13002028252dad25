"""Per-request sampling: `SamplingParams` (HF's field names) and the sampler that turns one step's
logits into one token per request.

Every request carries its own `torch.Generator`, seeded from `SamplingParams.seed` (or drawn from
torch's global RNG when unset), so a seeded request samples the same tokens whichever other
requests share its batch. The processing order is transformers' own: repetition penalty, then
`min_new_tokens` (end-of-sequence tokens masked), then temperature, top-k and top-p.

Owns the maths from logits to tokens; it knows nothing of blocks, caches or scheduling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..config import MAX_SPECULATIVE_TOKENS


@dataclass
class SamplingParams:
    """How one request generates. Field names follow transformers' `GenerationConfig`.

    Args:
        max_new_tokens: most tokens to generate (> 0).
        min_new_tokens: end-of-sequence and `stop_token_ids` are masked until this many were generated.
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens (0 disables).
        top_p: nucleus sampling; keep the smallest set of tokens whose probability reaches top_p (1 disables).
        seed: seeds this request's own generator; None draws a seed from torch's global RNG.
        stop_token_ids: extra token ids that end the request (the token is kept in the output).
        stop: strings that end the request once the decoded text contains one (needs a tokenizer);
            the text is cut before the stop string.
        ignore_eos: keep generating past the model's end-of-sequence tokens.
        repetition_penalty: transformers' CTRL-style penalty on tokens already in prompt or output (1 disables).
        skip_special_tokens: drop special tokens when decoding `.text`.
        num_speculative_tokens: tokens drafted per step for this request when the engine speculates
            (None: the engine's setting; 0: no speculation for this request).

    Values are checked by `validate()`, which the engine calls when a request is added, so one bad
    request is reported on its own instead of failing a whole batch.
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    num_speculative_tokens: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def validate(self) -> None:
        """Raise ValueError/TypeError naming the first bad field."""
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens!r}"
            )
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) or not (
            math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not is_int(self.seed):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        if self.stop is not None and not (
            isinstance(self.stop, str) or (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop))
        ):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        if self.num_speculative_tokens is not None and (
            not is_int(self.num_speculative_tokens) or not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS
        ):
            raise ValueError(f"num_speculative_tokens must be None or an integer in [0, {MAX_SPECULATIVE_TOKENS}], got "
                             f"{self.num_speculative_tokens!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not (
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0
        ):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")


@dataclass
class SamplingState:
    """What the sampler needs of one request: its params, generator, tokens so far and end ids."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]  # prompt + outputs, for the repetition penalty
    num_output_tokens: int
    end_token_ids: list[int]  # eos (unless ignore_eos) + stop_token_ids, masked before min_new_tokens

    def extended(self, tokens: list[int]) -> "SamplingState":
        """The state after `tokens` were generated (speculative positions see their drafted history)."""
        if not tokens:
            return self
        return SamplingState(params=self.params, generator=self.generator, token_ids=self.token_ids + list(tokens),
                             num_output_tokens=self.num_output_tokens + len(tokens),
                             end_token_ids=self.end_token_ids)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A request's own generator; without a seed, one drawn from torch's global RNG (so
    `torch.manual_seed` makes unseeded runs reproducible too)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    """One token per row.

    Args:
        logits: [num_rows, vocab_size] raw next-token logits, one row per state.
        states: per row, its `SamplingState`.
    """
    logits = logits.float()
    out: list[int | None] = [None] * len(states)
    plain = [i for i, s in enumerate(states) if s.params.is_greedy and not needs_processing(s)]
    if plain:
        for i, tok in zip(plain, logits[plain].argmax(dim=-1).tolist()):
            out[i] = tok
    for i, state in enumerate(states):
        if out[i] is None:
            out[i] = _sample_row(logits[i], state)
    return out  # type: ignore[return-value]


def needs_processing(state: SamplingState) -> bool:
    """Whether the raw logits' argmax may differ from the processed one (penalty, min_new_tokens)."""
    p = state.params
    return p.repetition_penalty != 1.0 or (state.num_output_tokens < p.min_new_tokens and bool(state.end_token_ids))


def processed_logits(row: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """[vocab] logits after the request's processors, in transformers' order: repetition penalty,
    `min_new_tokens` mask, then (when sampling) temperature, top-k and top-p (-inf outside)."""
    p = state.params
    row = row.float().clone()
    if p.repetition_penalty != 1.0 and state.token_ids:
        ids = torch.tensor(sorted(set(state.token_ids)), device=row.device)
        score = row[ids]
        row[ids] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
    if state.num_output_tokens < p.min_new_tokens and state.end_token_ids:
        row[torch.tensor(state.end_token_ids, device=row.device)] = float("-inf")
    if p.is_greedy:
        return row
    row = row / p.temperature
    if p.top_k and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - p.top_p)
        remove[-1] = False  # always keep the most likely token
        row = row.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return row


def _sample_row(row: torch.Tensor, state: SamplingState) -> int:
    row = processed_logits(row, state)
    if state.params.is_greedy:
        return int(row.argmax())
    return int(torch.multinomial(row.softmax(dim=-1), 1, generator=state.generator))
