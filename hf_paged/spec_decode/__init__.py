"""Lossless speculative decoding: proposers that draft tokens, and the verification that keeps
the output distribution exactly the target's.

* `proposal.py`: the proposer interface (`ProposalRequest` -> `Proposal`).
* `ngram.py`: prompt lookup. `draft_model.py`: a smaller model with its own paged cache.
  `layer_skip.py`: a self-speculative draft from the target's first layers.
  `shared_kv_drafter.py`: a Gemma 4 assistant, which reads the target's K/V and hidden state.
* `verify.py`: lossless verification (greedy and keyed sampling), pure functions of the logits.
* `factory.py`: the engine's speculative options -> one proposer.

The engine decides when to propose and commits what `verify` returns; nothing here writes the
target's cache or touches the scheduler (a Gemma 4 assistant reads the target's K/V).
"""

from .draft_model import DraftModelProposer
from .factory import make_proposer
from .layer_skip import layer_skip_draft
from .ngram import NgramProposer
from .proposal import Proposal, ProposalRequest
from .shared_kv_drafter import SharedKVDrafterProposer
from .verify import expected_tokens_per_forward, target_tokens, verify_greedy

__all__ = ["DraftModelProposer", "NgramProposer", "Proposal", "ProposalRequest", "SharedKVDrafterProposer",
           "expected_tokens_per_forward", "layer_skip_draft", "make_proposer", "target_tokens", "verify_greedy"]
