"""Lossless speculative decoding: proposers and verification.

A proposer drafts k tokens per request; the target verifies them all in one forward (the k + 1
positions `[last, d1 .. dk]` of each request, through the q_len = k + 1 paged path) and keeps:

* greedy: the longest prefix of drafts equal to the target's own argmax, plus the target's token at
  the first mismatch (or its bonus token after the last draft) -> `verify_greedy`;
* sampling: each draft with probability min(1, p/q); at the first rejection a token from the
  normalised residual max(p - q, 0); after k acceptances a bonus token from p -> `rejection_sample`
  (Leviathan et al. 2023; Chen et al. 2023). The output distribution is exactly the target's.

Both are pure functions of the probability tensors. Proposers:

* `NgramProposer` (prompt lookup): no model; continues the latest earlier occurrence of the
  sequence's last n-gram (n from `max_ngram` down to `min_ngram`) in prompt + output.
* `DraftModelProposer`: a smaller causal LM sharing the tokenizer, with its own `PagedCache`; it
  catches up on the tokens committed since its last proposal, then drafts k tokens in k packed
  forwards for all requests at once. Its rejected positions are rolled back (`truncate`) at the
  next proposal, so it never reads a stale token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import PagedCache
from .config import PagedCacheConfig
from .runner import Chunk, ModelRunner
from .sampling import SamplingState, processed_logits
from .sequence import Sequence


# ---------------------------------------------------------------------------------------- verification
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


# ---------------------------------------------------------------------------------------- proposers
@dataclass
class ProposalRequest:
    """What a proposer sees of one request: its id, committed tokens (prompt + outputs), how many
    tokens to draft, and its sampling state (drafts are sampled with it, so q is known)."""

    request_id: str
    token_ids: list[int]
    num_tokens: int
    state: SamplingState


@dataclass
class Proposal:
    """Drafted tokens, and the distributions they were sampled from ([k, vocab]; None = one-hot)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


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


class DraftModelProposer:
    """Drafts with a smaller causal LM that shares the target's tokenizer.

    Args:
        model: the draft model (switched to the "hf_paged" attention).
        num_blocks, block_size: its own KV pool.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int = 16):
        from .attention import ATTN_IMPLEMENTATION

        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.cache = PagedCache(_config_for_layers_present(model),
                                PagedCacheConfig(block_size=block_size, num_blocks=num_blocks))
        self.manager = self.cache.manager
        self.runner = ModelRunner(model, self.cache)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.seqs: dict[str, Sequence] = {}
        self.num_forwards = 0

    def free(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.manager.free(seq)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in requests]
        active, chunks, copies = [], [], []
        for i, r in enumerate(requests):
            seq = self.seqs.get(r.request_id)
            if seq is None:
                seq = self.seqs[r.request_id] = self.cache.new_sequence()
            # Keep what the draft computed that is still committed; the rest (rejected drafts) goes.
            common = _common_prefix(seq.token_ids, r.token_ids)
            common = min(common, len(r.token_ids) - 1)  # feed at least the newest token
            self.manager.truncate(seq, seq.num_tokens - common)
            feed = r.token_ids[common:]
            if r.num_tokens < 1 or not self.manager.can_append(seq, len(feed) + r.num_tokens - 1):
                continue  # no room in the draft's pool: this request verifies no drafts this step
            result = self.manager.append_tokens(seq, feed)
            copies.extend(result.copies)
            chunks.append(Chunk(seq, common, feed, result.slots, 1))
            active.append(i)
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        for step in range(max((requests[i].num_tokens for i in active), default=0)):
            if step:
                chunks, copies = [], []
                still = []
                for i in active:
                    if len(proposals[i].token_ids) >= requests[i].num_tokens:
                        continue
                    seq = self.seqs[requests[i].request_id]
                    result = self.manager.append_tokens(seq, proposals[i].token_ids[-1:])
                    copies.extend(result.copies)
                    chunks.append(Chunk(seq, seq.num_tokens - 1, proposals[i].token_ids[-1:], result.slots, 1))
                    still.append(i)
                active = still
            if not active:
                break
            logits = self.runner.forward(chunks, copies)
            self.num_forwards += 1
            for row, i in enumerate(active):
                r = requests[i]
                drafted = proposals[i].token_ids
                processed = processed_logits(logits[row, : self.vocab_size], r.state.extended(drafted))
                if r.state.params.is_greedy:
                    drafted.append(int(processed.argmax()))
                else:
                    q = processed.softmax(dim=-1)
                    drafted.append(int(torch.multinomial(q, 1, generator=r.state.generator)))
                    probs[i].append(q)
        for i, rows in probs.items():
            if rows:
                proposals[i].probs = torch.stack(rows)
        return proposals


def _config_for_layers_present(model: torch.nn.Module):
    """The model's config, cut to the decoder layers it really has (a layer-skip draft shares the
    full model's config but runs fewer layers; its cache must expect only those)."""
    import copy

    from .hooks import _decoder_of

    layers = getattr(_decoder_of(model), "layers", None)
    text = model.config.get_text_config(decoder=True)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) >= text.num_hidden_layers:
        return model.config
    config = copy.deepcopy(model.config)
    text = config.get_text_config(decoder=True)
    text.num_hidden_layers = len(layers)
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types[: len(layers)])
    return config


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def expected_tokens_per_forward(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): expected tokens committed per target forward with k drafts
    accepted independently with probability alpha (Leviathan et al.)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def layer_skip_draft(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A self-speculative draft: the target's first `num_layers` decoder layers, its final norm and
    its LM head, sharing the target's weights (no copy). Use it as `draft_model`.

    The draft shares the target's config object too, so it always runs the same attention
    implementation (transformers' decoders loop over `self.layers[: num_hidden_layers]`, which is
    simply the shorter list here). Its `PagedCache` allocates only the layers that run.

    Raises:
        ValueError: `num_layers` is not in [1, the model's layer count], or the model's decoder has no
            `layers` list to cut.
    """
    from .hooks import _decoder_of

    decoder = _decoder_of(model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"cannot build a layer-skip draft of {type(model).__name__}: its decoder has no `layers`")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be an integer in [1, {len(layers)}], got {num_layers!r}")
    with torch.device("meta"):
        draft = type(model)(model.config)
    draft_decoder = _decoder_of(draft)
    for name, child in model.named_children():
        if child is not decoder:
            setattr(draft, name, child)
    for name, child in decoder.named_children():
        setattr(draft_decoder, name, torch.nn.ModuleList(list(child[:num_layers])) if name == "layers" else child)
    for name, buf in decoder.named_buffers(recurse=False):
        draft_decoder.register_buffer(name, buf, persistent=False)
    for name, buf in model.named_buffers(recurse=False):
        draft.register_buffer(name, buf, persistent=False)
    left = [n for n, p in list(draft.named_parameters()) + list(draft.named_buffers()) if p.is_meta]
    if left:
        raise ValueError(f"cannot build a layer-skip draft of {type(model).__name__}: unshared tensors {left[:3]}")
    draft.generation_config = model.generation_config
    return draft.eval()
