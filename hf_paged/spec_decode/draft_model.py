"""`DraftModelProposer`: drafts with a smaller causal LM that shares the target's tokenizer.

It keeps its own `KVOwner` (with its `PagedCache`) and `ModelRunner`. At each proposal it catches up on the tokens
committed since its last one, then drafts k tokens in k packed forwards for all requests at once.
Its rejected positions are rolled back (`truncate`) at the next proposal, so it never reads a stale
token. It never touches the target's cache.
"""

from __future__ import annotations

import copy

import torch

from ..attention import ATTN_IMPLEMENTATION
from ..config import DEFAULT_BLOCK_SIZE, MAX_SPECULATIVE_TOKENS, PagedCacheConfig
from ..core import KVSequence
from ..hf import KVOwner, PagedCache, decoder_of
from ..worker import Chunk, ModelRunner
from ..worker.sampler import SampleRow, Sampler
from .proposal import Proposal, ProposalRequest


class DraftModelProposer:
    """Drafts with a smaller causal LM that shares the target's tokenizer.

    Args:
        model: the draft model (switched to the "hf_paged" attention).
        num_blocks, block_size: its own KV pool.
        kv_cache_dtype, kv_quant_scheme, kv_quant_rotation, enable_hybrid_kv: how that pool stores K/V
            (the target's choice, see `PagedCacheConfig`).
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 kv_cache_dtype: str = "auto", kv_quant_scheme: str = "dynamic", kv_quant_rotation: bool = True,
                 enable_hybrid_kv: bool = True):
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        config = _config_for_layers_present(model)
        # It appends its own drafts before the target verifies them, then rolls back the rejected ones:
        # a sliding-window layer must keep what a rollback of a whole draft would read again.
        self.kv = KVOwner(config, PagedCacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                   kv_cache_dtype=kv_cache_dtype, kv_quant_scheme=kv_quant_scheme,
                                                   kv_quant_rotation=kv_quant_rotation,
                                                   enable_hybrid_kv=enable_hybrid_kv),
                          lookback=MAX_SPECULATIVE_TOKENS)
        self.kv.use_checkpoint_kv_scales(model)
        self.manager = self.kv.manager  # it plans its own appends, as a scheduler does
        self.cache = PagedCache(config, kv=self.kv)
        self.runner = ModelRunner(model, self.cache)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.seqs: dict[str, KVSequence] = {}
        self.num_forwards = 0
        self.sampler = Sampler()

    def free(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.manager.free(seq)

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in requests]
        active, chunks, copies, full = [], [], [], []
        for i, r in enumerate(requests):
            seq = self.seqs.get(r.request_id)
            if seq is None:
                seq = self.seqs[r.request_id] = self.kv.new_sequence()
            # Keep what the draft computed that is still committed; the rest (rejected drafts) goes.
            common = _common_prefix(seq.token_ids, r.token_ids)
            common = min(common, len(r.token_ids) - 1)  # feed at least the newest token
            self.manager.truncate(seq, seq.num_tokens - common)
            feed = r.token_ids[common:]
            if r.num_tokens < 1 or not self.manager.can_append(seq, len(feed) + r.num_tokens - 1):
                continue  # no room in the draft's pool: this request verifies no drafts this step
            result = self.manager.append_tokens(seq, feed, register=False)
            copies.extend(result.copies)
            full.extend(result.new_full_blocks)
            chunks.append(Chunk(seq, common, feed, result.group_slots, 1))
            active.append(i)
        for step in range(max((requests[i].num_tokens for i in active), default=0)):
            if step:
                chunks, copies, full = [], [], []
                still = []
                for i in active:
                    if len(proposals[i].token_ids) >= requests[i].num_tokens:
                        continue
                    seq = self.seqs[requests[i].request_id]
                    result = self.manager.append_tokens(seq, proposals[i].token_ids[-1:], register=False)
                    copies.extend(result.copies)
                    full.extend(result.new_full_blocks)
                    chunks.append(Chunk(seq, seq.num_tokens - 1, proposals[i].token_ids[-1:], result.group_slots, 1))
                    still.append(i)
                active = still
            if not active:
                break
            logits = self.runner.forward(chunks, copies, full)
            self.num_forwards += 1
            # The target's own processors and keyed draws at these positions: the draft's sample is
            # coupled to the token the target will draw there, which is what verification compares.
            rows = [SampleRow(requests[i].state, tuple(proposals[i].token_ids)) for i in active]
            drafted = self.sampler(logits[:, : self.vocab_size].float().clone(), rows, with_outputs=False).token_ids
            for i, token in zip(active, drafted):
                proposals[i].token_ids.append(token)
        return proposals


def _config_for_layers_present(model: torch.nn.Module):
    """The model's config, cut to the decoder layers it really has (a layer-skip draft shares the
    full model's config but runs fewer layers; its cache must expect only those)."""
    layers = getattr(decoder_of(model), "layers", None)
    text = model.config.get_text_config(decoder=True)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) >= text.num_hidden_layers:
        return model.config
    config = copy.deepcopy(model.config)
    text = config.get_text_config(decoder=True)
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    if shared:  # the layers kept that reuse K/V still do (the first reusing layer is where it was)
        text.num_kv_shared_layers = max(0, len(layers) - (text.num_hidden_layers - shared))
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
