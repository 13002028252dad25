"""`ModelRunner`: one packed forward of a transformers model over a `PagedCache`.

The engine's target model and a speculative draft model each own one. A step is a list of `Chunk`s,
one per sequence: the tokens it feeds, their slots, and how many trailing positions need logits.
transformers sees a single row `[1, num_tokens]` with explicit positions; the attention layers see
one `StepMetadata` (built here) that tells the sequences apart.

Owns the forward and its tensors (ids, positions, the logits index); it does not choose what runs
(the scheduler does) or what is sampled (`sampling.py`).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch

from ..attention.metadata import build_packed_metadata
from ..core import KVSequence
from ..hf import PagedCache, decoder_of
from ..hf.linear import enable as enable_fast_linear, fast_linear


@dataclass
class Chunk:
    """One sequence's share of a packed forward.

    Attributes:
        seq: the block manager's record, already extended by this chunk (`append_tokens` ran).
        start: position of the first token (tokens already in the cache before this chunk).
        token_ids: the tokens fed, positions `start .. start + len - 1`.
        group_slots: per KV group, the KV slot of each token (-1: prefix-cache hit, nothing to write).
        num_logits: how many of the last positions need logits (0 for a prompt chunk that stops
            short, 1 to sample, k + 1 to verify k speculative tokens).
    """

    seq: KVSequence
    start: int
    token_ids: list[int]
    group_slots: list[list[int]]
    num_logits: int


class ModelRunner:
    """Runs packed forwards of `model` against `cache` (which owns the K/V tensors)."""

    def __init__(self, model: torch.nn.Module, cache: PagedCache):
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device
        params = inspect.signature(decoder_of(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        enable_fast_linear(model)  # inert outside this runner's forwards (see hf.linear)
        # Wall seconds of the latest forward: building its inputs and metadata, and the model call.
        self.last_metadata_seconds = 0.0
        self.last_model_seconds = 0.0

    def forward(self, chunks: list[Chunk], copies: list[tuple[int, int]],
                new_full_blocks: list[tuple[int, int]] = ()) -> torch.Tensor:
        """Returns [sum(num_logits), vocab] logits, chunk by chunk in order.

        Args:
            new_full_blocks: blocks this step fills (`append_tokens(..., register=False)`); they are
                published in the prefix cache once every layer has written its K/V.

        On an exception the cache forgets the step and it propagates; nothing was published."""
        began = time.perf_counter()
        input_ids, positions, keep = [], [], []
        for chunk in chunks:
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + len(chunk.token_ids)))
            end = len(input_ids)
            keep.extend(range(end - chunk.num_logits, end))
        meta = build_packed_metadata(
            q_lens=[len(c.token_ids) for c in chunks],
            seq_lens=[c.seq.num_tokens for c in chunks],
            copies=copies,
            device=self.device,
            **self.cache.group_fields([c.group_slots for c in chunks], [c.seq for c in chunks]),
        )
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([positions], dtype=torch.long, device=self.device)
        keep_index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.begin_step(meta)
        called = time.perf_counter()
        self.last_metadata_seconds = called - began
        try:
            with torch.inference_mode(), fast_linear():
                out = self.model(input_ids=ids, position_ids=pos, use_cache=True, paged_metadata=meta,
                                 logits_to_keep=keep_index, **{self._cache_kwarg: self.cache})
        except BaseException:
            self.cache.abandon_step(reset_prefix_cache=False)  # this step published no block
            self.cache.pool.discard_staged()
            raise
        self.cache.manager.commit_full_blocks(new_full_blocks)
        self.last_model_seconds = time.perf_counter() - called
        return out.logits[0]
