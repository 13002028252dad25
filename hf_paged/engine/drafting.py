"""Speculative decoding's part of a step: how many tokens each request may draft, and the drafts.

The engine core asks `Drafter.propose` before scheduling; the scheduler then schedules each running
request's drafts (`Request.spec_token_ids`) with its next position, and the core verifies them
(`spec_decode.verify_greedy`). Torch-free: the proposer (`spec_decode.make_proposer`) owns any model; a
proposer that drafts from the target's hidden states gets the ones the core notes here (opaque rows).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ..core import Request
from ..spec_decode import ProposalRequest
from .metrics import EngineMetrics
from .tracked import TrackedRequest

logger = logging.getLogger(__name__)


class Drafter:
    """Owns the draft proposer (or None: no speculative decoding).

    Args:
        proposer, num_speculative_tokens: `spec_decode.make_proposer`'s.
        vocab_size: the target model's (drafts outside its vocabulary are cut).
        metrics: the engine's (a failed proposal counts as a failed step).
    """

    def __init__(self, proposer, num_speculative_tokens: int, *, vocab_size: int, metrics: EngineMetrics):
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.metrics = metrics
        # A proposer that drafts from the target's own states (`needs_hidden_states`) gets, per request,
        # the target's final hidden state that produced its last committed token: (number of committed
        # tokens it goes with, the row), noted by the core as it commits (`note_commit`).
        self.needs_hidden_states = bool(getattr(proposer, "needs_hidden_states", False))
        self._hidden: dict[str, tuple[int, object]] = {}

    def note_commit(self, tracked: TrackedRequest, first_sampled_row: int, num_before: int, executor) -> None:
        """After a step committed tokens to `tracked` (it held `num_before`) from its sampled rows (the
        first at `first_sampled_row` of the step's logits rows), keep the target's hidden state of the
        row that produced the last one, for a proposer that drafts from it (`needs_hidden_states`)."""
        hidden_rows = getattr(executor, "last_hidden_states", None)  # [num logits rows, hidden] or None
        request = tracked.request
        num_committed = len(request.token_ids) - num_before
        if not self.needs_hidden_states or tracked.finish_reason is not None or hidden_rows is None \
                or num_committed <= 0:
            return
        row = hidden_rows[first_sampled_row + num_committed - 1].clone()
        self._hidden[request.request_id] = (len(request.token_ids), row)

    def num_drafts_for(self, tracked: TrackedRequest, max_model_len: int) -> int:
        request, params = tracked.request, tracked.params
        if params.batch_processor is not None:
            return 0  # a caller's processors see each position once, as in stock's loop
        k = self.num_speculative_tokens if params.num_speculative_tokens is None else params.num_speculative_tokens
        # Never draft past what the request may still generate (the last token comes from the target).
        room = min(params.max_new_tokens - request.num_output_tokens, max_model_len - len(request.token_ids))
        return max(0, min(k, room - 1))

    def propose(self, running: list[Request], requests: Mapping[str, TrackedRequest], max_model_len: int) -> None:
        """Set each decoding request's drafts (never past `max_model_len`, the engine's current limit). If the proposer raises, this step runs without any, and
        every request's draft state is dropped (the proposer starts afresh from the committed tokens)."""
        if self.proposer is None:
            return
        asks = []
        for request in running:
            if request.num_pending_tokens != 1:
                continue  # still in prefill
            tracked = requests[request.request_id]
            if not tracked.group.forked:
                continue  # its first token is drawn once per sample from one row: no drafts
            k = self.num_drafts_for(tracked, max_model_len)
            if k > 0:
                ask = ProposalRequest(request.request_id, request.token_ids, k, tracked.state)
                if self.needs_hidden_states:
                    noted = self._hidden.get(request.request_id)
                    ask.seq = request.seq
                    ask.hidden_state = noted[1] if noted is not None and noted[0] == len(request.token_ids) else None
                asks.append(ask)
        if not asks:
            return
        try:
            proposals = self.proposer.propose(asks)
        except Exception:
            logger.warning("hf_paged: the draft proposer failed; this step runs without drafts", exc_info=True)
            self.metrics.num_failed_steps += 1
            for request in running:
                self.proposer.free(request.request_id)
            return
        for ask, proposal in zip(asks, proposals):
            drafts = proposal.token_ids[: ask.num_tokens]
            valid = next((i for i, t in enumerate(drafts) if not 0 <= t < self.vocab_size), len(drafts))
            tracked = requests[ask.request_id]
            if tracked.state.grammar is not None:  # a draft its grammar rejects is never verified
                valid = tracked.state.grammar.valid_prefix(drafts[:valid])
            tracked.request.spec_token_ids = drafts[:valid]  # a draft vocab may be larger

    def free(self, request_id: str) -> None:
        """Drop a finished or preempted request's draft state."""
        self._hidden.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.free(request_id)
