"""Prompt lookup decoding (`NgramProposer`): drafts from the sequence itself, no model.

Continues the latest earlier occurrence of the sequence's last n-gram (n from `max_ngram` down to
`min_ngram`) in prompt + output. Pure Python over token ids.
"""

from __future__ import annotations

from .proposal import Proposal, ProposalRequest


class NgramProposer:
    """Prompt lookup decoding: no model, drafts from the sequence itself.

    Args:
        min_ngram, max_ngram: n-gram sizes tried, longest first.
    """

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        return [Proposal(self.lookup(r.token_ids, r.num_tokens)) for r in requests]

    def lookup(self, tokens: list[int], num_tokens: int) -> list[int]:
        """The `num_tokens` tokens that followed the latest earlier occurrence of the last n-gram."""
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            pattern = tokens[length - n:]
            first = pattern[0]
            for start in range(length - n - 1, -1, -1):  # latest occurrence first
                if tokens[start] == first and tokens[start:start + n] == pattern:
                    return tokens[start + n: start + n + num_tokens]
        return []

    def free(self, request_id: str) -> None:
        """Nothing is kept per request."""
