"""What a proposer is asked and what it answers: the interface every drafting method implements.

A proposer has `propose(requests: list[ProposalRequest]) -> list[Proposal]` (one answer per request,
in order; fewer tokens than asked, even none, is fine) and `free(request_id)` (drop any per-request
state). Plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core import KVSequence
from ..worker.sampling import SamplingState


@dataclass
class ProposalRequest:
    """What a proposer sees of one request: its id, committed tokens (prompt + outputs), how many
    tokens to draft, and its sampling state (a model proposer samples with its keyed noise).

    A proposer that reads the target (`needs_hidden_states`, as `SharedKVDrafterProposer`) also gets
    the request's `KVSequence` in the target's pool (`seq`: the K/V of every committed token but the
    last) and the target's final hidden state at the position that produced the last committed token
    (`hidden_state`, [hidden]; None when the engine has none for the current tokens)."""

    request_id: str
    token_ids: list[int]
    num_tokens: int
    state: SamplingState
    seq: KVSequence | None = None
    hidden_state: Any = None


@dataclass
class Proposal:
    """Drafted tokens, in order (fewer than asked, even none, is fine)."""

    token_ids: list[int]
