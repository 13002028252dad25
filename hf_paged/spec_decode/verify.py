"""Lossless verification of speculative tokens: pure functions of the target's logits.

The target scores the k + 1 positions `[last, d1 .. dk]` of a request in one forward (the
q_len = k + 1 paged path) and keeps:

* greedy: the longest prefix of drafts equal to the target's own argmax, plus the target's token at
  the first mismatch (or its bonus token after the last draft) -> `verify_greedy`;
* sampling: the same rule, applied to the target's own *sample* at each position. Every token is an
  inverse-CDF draw from the processed distribution at a uniform number keyed by (seed, position)
  (`worker.sampling.uniform`), so the target's token at a position does not depend on the drafts: a
  draft is kept iff it equals that token (`target_tokens` + `verify_greedy`). The output is exactly
  what the request would sample without speculation, token for token, so it is exactly the target's
  distribution, and a seeded request's tokens never depend on how many drafts it got. Position j
  is processed with the drafts before it as history (`SampleRow.extra`): the same processors as
  plain sampling. Draft proposers draw with the same keyed numbers, which couples their drafts to
  the target's draws and keeps acceptance high where the two distributions agree.

No model, cache or request state here: inputs in, tokens out.
"""

from __future__ import annotations

import torch

from ..worker.sampler import SampleRow, Sampler
from ..worker.sampling import SamplingState


def verify_greedy(target_tokens: list[int], draft_tokens: list[int]) -> list[int]:
    """Tokens to commit: the drafts up to the first one the target disagrees with, then the target's
    token there (or, when all match, its bonus token).

    Args:
        target_tokens: the target's (processed) argmax at each of the k + 1 verified positions.
        draft_tokens: the k drafts.
    """
    if len(target_tokens) != len(draft_tokens) + 1:
        raise ValueError(f"need k + 1 target tokens for k drafts, got {len(target_tokens)} for {len(draft_tokens)}")
    out = []
    for target, draft in zip(target_tokens, draft_tokens):
        if target != draft:
            out.append(target)
            return out
        out.append(draft)
    out.append(target_tokens[-1])
    return out


def target_tokens(logits: torch.Tensor, state: SamplingState, draft_tokens: list[int]) -> list[int]:
    """The target's own token at each of the k + 1 verified positions: position j sees the history
    extended by the first j drafts (repetition penalty, min_new_tokens), and samples exactly as a
    step without speculation would (greedy argmax, or the inverse-CDF draw keyed by its position).

    Args:
        logits: [k + 1, vocab] raw target logits at the verified positions.
    """
    rows = [SampleRow(state, tuple(draft_tokens[:j])) for j in range(len(draft_tokens) + 1)]
    return Sampler()(logits.float().clone(), rows).token_ids


def expected_tokens_per_forward(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): expected tokens committed per target forward with k drafts
    accepted independently with probability alpha (Leviathan et al.)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)
