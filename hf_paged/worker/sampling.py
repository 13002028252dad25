"""Per-request sampling state: `SamplingState` (what a request's sampler needs of its
`hf_paged.sampling_params.SamplingParams`, kept up to date incrementally), and the random numbers
that make every draw reproducible.

Random draws are counter-based: the token at sequence position `pos` is drawn by inverting the CDF
of the processed distribution (its tokens in id order) at a uniform number `u = uniform(seed, pos)`,
a pure function of the request's seed and the position (`uniform`). So a request's tokens depend only
on its seed and its own logits: not on its batch mates, not on how many speculative tokens it was
given (verification compares drafts with this very sample), and a retried step draws the same numbers
again. Inverse-CDF sampling is exact: the token is distributed as `softmax(processed_logits)` (the CDF
is summed in float64, so no token's share is lost to rounding at 150k vocabularies). The seed is
`SamplingParams.seed`, or drawn from torch's global RNG when unset (`draw_seed`, so
`torch.manual_seed` makes unseeded runs reproducible); sample `i` of `n` uses `sample_seed(seed, i)`.

The processing itself is `sampler.py`; this module has no tensor maths beyond the RNG.
"""

from __future__ import annotations

import numpy as np
import torch

from ..sampling_params import SamplingParams


class SamplingState:
    """What the sampler needs of one request, kept up to date as tokens are committed.

    Args:
        params: the request's `SamplingParams`.
        seed: keys its random draws (see `uniform`).
        token_ids: prompt + outputs so far; the engine's own list (read, never written here).
        num_prompt_tokens: the length of the prompt prefix of `token_ids`.
        end_token_ids: ids masked before `min_new_tokens` (eos unless ignore_eos, and stop tokens).
        eos_token_ids: the model's end-of-sequence ids (a lone eos in `bad_words_ids` is not banned).
        grammar: the request's `structured.grammar.GrammarState` (with `params.structured`), advanced here
            by the output tokens already in `token_ids`; the engine advances it as it commits tokens.

    The next token is at sequence position `len(token_ids)`. Penalty state (unique tokens seen, their
    counts among the outputs) and the n-gram table are updated from the tokens appended since the
    last use, so a step costs O(new tokens), never O(context)."""

    def __init__(self, params: SamplingParams, seed: int, token_ids: list[int], num_prompt_tokens: int,
                 end_token_ids: list[int] = (), eos_token_ids: list[int] = (), grammar=None):
        self.params = params
        self.seed = seed
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.end_token_ids = list(end_token_ids)
        self.eos_token_ids = list(eos_token_ids)
        self.grammar = grammar
        if grammar is not None and not grammar.accept(token_ids[num_prompt_tokens:]):
            raise ValueError("the request's output tokens so far do not match its structured outputs constraint")
        self._reset()

    def _reset(self) -> None:
        self._synced = 0
        self._index: dict[int, int] = {}  # token -> slot in the arrays below
        self._ids = np.zeros(64, dtype=np.int64)  # unique tokens of prompt + outputs, first-seen order
        self._counts = np.zeros(64, dtype=np.float32)  # how often each was generated (outputs only)
        self._ngrams: dict[tuple, set[int]] = {}

    @property
    def position(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def sync(self) -> None:
        """Absorb the tokens appended since the last call."""
        tokens = self.token_ids
        if len(tokens) < self._synced:  # never expected (outputs only grow), but never wrong
            self._reset()
        p = self.params
        n = p.no_repeat_ngram_size
        for i in range(self._synced, len(tokens)):
            t = tokens[i]
            if p.has_penalties:
                slot = self._index.get(t)
                if slot is None:
                    slot = self._index[t] = len(self._index)
                    if slot == len(self._ids):
                        self._ids = np.resize(self._ids, 2 * slot)
                        self._counts = np.concatenate([self._counts, np.zeros(slot, dtype=np.float32)])
                    self._ids[slot] = t
                if i >= self.num_prompt_tokens:
                    self._counts[slot] += 1
            if n and i + 1 >= n:
                self._ngrams.setdefault(tuple(tokens[i + 1 - n: i]), set()).add(t)
        self._synced = len(tokens)

    def penalty_arrays(self, extra: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(unique token ids [m] int64, output counts [m] fp32) of prompt + outputs + `extra`."""
        m = len(self._index)
        ids, counts = self._ids[:m], self._counts[:m]
        if not extra:
            return ids, counts
        ids, counts, index = ids.copy(), counts.copy(), dict(self._index)
        add_ids, add_counts = [], []
        for t in extra:  # drafted tokens are outputs
            slot = index.get(t)
            if slot is None:
                index[t] = m + len(add_ids)
                add_ids.append(t)
                add_counts.append(1.0)
            elif slot >= m:
                add_counts[slot - m] += 1
            else:
                counts[slot] += 1
        if add_ids:
            ids = np.concatenate([ids, np.array(add_ids, dtype=np.int64)])
            counts = np.concatenate([counts, np.array(add_counts, dtype=np.float32)])
        return ids, counts

    def banned_tokens(self, extra: tuple[int, ...] = ()) -> list[int]:
        """Tokens `no_repeat_ngram_size` and `bad_words_ids` forbid next, after prompt + outputs + `extra`
        (transformers' `NoRepeatNGramLogitsProcessor` and `NoBadWordsLogitsProcessor`)."""
        p, banned = self.params, []
        history = self.token_ids if not extra else None
        n = p.no_repeat_ngram_size
        total = len(self.token_ids) + len(extra)
        if n and total >= n:
            history = history or self.token_ids + list(extra)
            prefix = tuple(history[total + 1 - n:]) if n > 1 else ()
            banned.extend(self._ngrams.get(prefix, ()))
            # n-grams that end inside `extra` are not in the table
            for end in range(max(len(self.token_ids), n - 1), total):
                if tuple(history[end + 1 - n: end]) == prefix:
                    banned.append(history[end])
        if p.bad_words_ids:
            history = history or self.token_ids + list(extra)
            for word in p.bad_words_ids:
                if len(word) == 1:
                    if word[0] not in self.eos_token_ids:
                        banned.append(word[0])
                elif len(word) - 1 <= total and list(history[total - len(word) + 1:]) == list(word[:-1]):
                    banned.append(word[-1])
        return banned

    def masks_end_tokens(self, num_extra: int = 0) -> bool:
        return bool(self.end_token_ids) and self.num_output_tokens + num_extra < self.params.min_new_tokens


def draw_seed(seed: int | None) -> int:
    """A request's seed: its own, or one drawn from torch's global RNG (so `torch.manual_seed`
    makes unseeded runs reproducible too)."""
    return int(torch.randint(0, 2**62, (1,)).item()) if seed is None else int(seed)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request with `n` samples (sample 0 keeps the request's)."""
    return seed if index == 0 else _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 2


def uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) keyed by (seed, position) alone: the draw for that position."""
    x = _splitmix64(_splitmix64(seed & _MASK64) ^ position)
    return (x >> 11) * 2.0**-53
