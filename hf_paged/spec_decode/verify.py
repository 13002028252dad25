"""Lossless verification of speculative tokens: pure functions of the probability tensors.

The target scores the k + 1 positions `[last, d1 .. dk]` of a request in one forward (the
q_len = k + 1 paged path) and keeps:

* greedy: the longest prefix of drafts equal to the target's own argmax, plus the target's token at
  the first mismatch (or its bonus token after the last draft) -> `verify_greedy`;
* sampling: each draft with probability min(1, p/q); at the first rejection a token from the
  normalised residual max(p - q, 0); after k acceptances a bonus token from p -> `rejection_sample`
  (Leviathan et al. 2023; Chen et al. 2023). The output distribution is exactly the target's.

No model, cache or request state here: inputs in, tokens out.
"""

from __future__ import annotations

import torch

from ..worker.sampling import SamplingState, processed_logits


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


def rejection_sample(
    target_probs: torch.Tensor,  # [k + 1, vocab] target distribution at each verified position
    draft_probs: torch.Tensor | None,  # [k, vocab] distribution each draft was sampled from; None = one-hot
    draft_tokens: list[int],
    generator: torch.Generator | None = None,
) -> list[int]:
    """Speculative sampling: commits 1 .. k + 1 tokens whose distribution is exactly the target's.

    Draft j is accepted with probability min(1, p_j(d) / q_j(d)). At the first rejection the token is
    drawn from max(p_j - q_j, 0), normalised, and verification stops; if all k are accepted a bonus
    token is drawn from p_k. A deterministic proposer (prompt lookup) has q_j = one-hot(d_j).
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1 or (draft_probs is not None and draft_probs.shape[0] != k):
        raise ValueError(f"shapes do not match {k} drafts: target {tuple(target_probs.shape)}, "
                         f"draft {None if draft_probs is None else tuple(draft_probs.shape)}")
    out = []
    for j, token in enumerate(draft_tokens):
        p = target_probs[j]
        q_tok = 1.0 if draft_probs is None else float(draft_probs[j, token])
        p_tok = float(p[token])
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_tok > 0 and u * q_tok < p_tok:
            out.append(token)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0
        else:
            residual = (p - draft_probs[j]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # p == q: a rejection has probability 0; kept for safety
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out


def target_distributions(logits: torch.Tensor, state: SamplingState, draft_tokens: list[int]) -> torch.Tensor:
    """[k + 1, vocab] processed target distributions (or, for greedy, one-hot argmax) at the verified
    positions: position j sees the history extended by the first j drafts (repetition penalty,
    min_new_tokens)."""
    rows = [processed_logits(logits[j], state.extended(draft_tokens[:j])) for j in range(len(draft_tokens) + 1)]
    processed = torch.stack(rows)
    if state.params.is_greedy:
        return torch.nn.functional.one_hot(processed.argmax(dim=-1), processed.shape[-1]).float()
    return processed.softmax(dim=-1)


def expected_tokens_per_forward(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): expected tokens committed per target forward with k drafts
    accepted independently with probability alpha (Leviathan et al.)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)
