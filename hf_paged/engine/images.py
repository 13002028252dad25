"""`ImageQueue`: the requests with images the core queued since its last step, placed before any of them
is scheduled (encoded once per distinct image by the executor, in one call), and the image figures of
their admissions.

Placing a request sets what its scheduling depends on: its image features (written at its
placeholders by the runner), its sequence's block-hash spans (`KVSequence.mm_spans`) and, for images
attended both ways, the spans a chunk never ends inside (`Request.atomic_spans`). A request whose
images cannot be placed ends with the error, alone.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from .metrics import EngineMetrics
from .tracked import TrackedRequest


class ImageQueue:
    """Requests whose images are not placed yet (see the module docstring).

    Args:
        executor: places images (`Executor.place_images`).
        max_num_batched_tokens: reads the scheduler's budget (an image attended both ways must fit one step).
        metrics: the engine's; its image counters are kept here.
        fail: ends a request with an error (`EngineCore.fail`).
    """

    def __init__(self, executor, max_num_batched_tokens: Callable[[], int], metrics: EngineMetrics,
                 fail: Callable[[TrackedRequest, Exception], None]):
        self.executor = executor
        self.max_num_batched_tokens = max_num_batched_tokens
        self.metrics = metrics
        self.fail = fail
        self._pending: list[TrackedRequest] = []

    def add(self, tracked: TrackedRequest) -> None:
        """Note a request just queued (one without images is not kept)."""
        if tracked.images:
            self._pending.append(tracked)

    def place(self) -> None:
        """Place every pending request's images (their sequences are hashed with the digests from here on)."""
        pending, self._pending = [t for t in self._pending if t.finish_reason is None], []
        if not pending:
            return
        results, num_encoded = self.executor.place_images(
            [(t.request.token_ids[:t.request.num_prompt_tokens], t.images) for t in pending])
        self.metrics.mm_cache_queries += sum(len(t.images) for t in pending)
        self.metrics.mm_encoder_runs += num_encoded
        budget = self.max_num_batched_tokens()
        for tracked, result in zip(pending, results):
            if isinstance(result, Exception):
                self.fail(tracked, result)
                continue
            features, spans = result
            longest = max((e - s for s, e in features.blocks), default=0)
            if longest > budget:
                self.fail(tracked, ValueError(f"an image of {longest} placeholder tokens must be computed in one step, "
                                              f"but max_num_batched_tokens is {budget}; raise it"))
                continue
            tracked.image_features, tracked.request.seq.mm_spans = features, spans
            tracked.request.atomic_spans = features.blocks  # attended both ways: one chunk each

    def note_admission(self, tracked: TrackedRequest) -> None:
        """Count the placeholders among the tokens a request's admission took from the prefix cache."""
        if tracked.image_features is not None:
            self.metrics.mm_prefix_cache_hits += bisect.bisect_left(tracked.image_features.positions,
                                                                    tracked.request.num_cached_tokens)
