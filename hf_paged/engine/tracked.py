"""The engine's record of one live request: `TrackedRequest` (one sample of it) and `RequestGroup`
(its `n` samples).

The core (`core.py`) reads and advances the scheduler's `Request`, the sampling state and the failure
count; output processing (`output_processor.py`) owns the text state, what is returned besides
tokens, and the owner's inbox. Neither holds a request anywhere else.
"""

from __future__ import annotations

import torch

from ..core import KVSequence, Request
from ..sampling_params import SamplingParams
from ..worker.sampler import TokenLogprobs
from ..worker.sampling import SamplingState
from .delivery import Inbox
from .detokenizer import IncrementalDetokenizer
from .metrics import RequestMetrics


class RequestGroup:
    """The `n` samples of one request. Sample 0 is the request itself; it runs alone until its prompt
    is computed, then the others fork from it (sharing every block, copy-on-write)."""

    def __init__(self, request_id: str, n: int, retain_kv: bool = False):
        self.request_id = request_id
        self.n = n
        self.members: list[TrackedRequest | None] = [None] * n
        # retain_kv: each sample's sequence outlives it (`Engine.kept_kv`), for a caller continuing it.
        self.retain_kv = retain_kv
        self.kept: list[KVSequence | None] = [None] * n
        self.forked = n == 1  # nothing to fork
        self.unforked_reason: str | None = None
        self.prompt_logprobs: dict[int, TokenLogprobs] = {}

    @property
    def finished(self) -> bool:
        """Every sample has ended; samples never forked (the request ended first) count as ended."""
        if self.unforked_reason is not None:
            return all(m is None or m.finish_reason is not None for m in self.members)
        return self.forked and all(m is not None and m.finish_reason is not None for m in self.members)


class TrackedRequest:
    """Engine-side state of one request (or one sample of it): the scheduler's view plus sampling,
    text, what it returns besides tokens, and its owner."""

    def __init__(self, request: Request, params: SamplingParams, metrics: RequestMetrics,
                 detok: IncrementalDetokenizer | None, inbox: Inbox | None, index: int, state: SamplingState,
                 group: RequestGroup, sample_index: int = 0):
        self.request = request
        self.params = params
        self.state = state  # the sampler's view: penalty and n-gram state kept as tokens come
        self.metrics = metrics
        self.detok = detok  # streamed text and stop strings; None: text decoded once at the end
        self.inbox = inbox  # the owner's (generate / stream / submit); None for add_request
        self.index = index  # position in the owner's prompts
        self.group = group  # the request's samples (a group of one when n = 1)
        self.sample_index = sample_index
        group.members[sample_index] = self
        self.finish_reason: str | None = None
        self.text: str | None = None
        self.error: Exception | None = None
        self.num_failures = 0
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.scores: list[torch.Tensor] | None = [] if params.output_scores else None
        self.logits: list[torch.Tensor] | None = [] if params.output_logits else None
        self.kv_prefix: KVSequence | None = None  # a kept sequence it takes over when queued
        self.pending_text = ""  # text of `resume_tokens`, prepended to the first streamed delta
        self.images: list | None = None  # its `hf.multimodal.ImageItem`s, in prompt order
        self.image_features = None  # `hf.multimodal.ImageFeatures`, placed before it is first scheduled

    @property
    def public_id(self) -> str:
        """The id the caller knows (the request's, for every one of its samples)."""
        return self.group.request_id

    @property
    def output_ids(self) -> list[int]:
        return self.request.token_ids[self.request.num_prompt_tokens:]
