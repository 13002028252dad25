"""The executor seam: how a scheduled step becomes logits.

    execute(step) -> logits [num logit rows, vocab]

`InProcessExecutor` runs the step on this process's `ModelRunner`. Tensor parallelism (one forward
per rank, rank 0 sampling), disaggregation and any later multi-process form are other executors:
the core (`core.py`) hands them the same `ExecutorStep` and reads back the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..worker import Chunk, ModelRunner


class ExecutorLostError(RuntimeError):
    """The executor can run no step any more (a tensor-parallel rank's process is gone): every request it
    had fails with this at once, and so does every later step. Not a request's fault, nor transient."""


@dataclass
class ExecutorStep:
    """One forward: a chunk per scheduled sequence, the step's copy-on-write copies, and the full
    blocks it fills (published once their K/V are written)."""

    chunks: list[Chunk]
    copies: list[tuple[int, int]] = field(default_factory=list)
    new_full_blocks: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class StepTimes:
    """Wall seconds of the latest `execute`: building inputs and metadata, and the model call."""

    metadata_seconds: float = 0.0
    model_seconds: float = 0.0


class Executor(Protocol):
    def execute(self, step: ExecutorStep) -> torch.Tensor:  # [sum(c.num_logits for c in step.chunks), vocab]
        """Run the step's forward; on an exception the step left no trace (the KV owner aborted it)."""
        ...

    @property
    def last_times(self) -> StepTimes: ...

    def encode_images(self, items: list) -> tuple[list, int]:
        """Features [n_i, hidden] per `ImageItem`, and how many images the encoder ran on."""
        ...

    def place_images(self, requests: list) -> tuple[list, int]:
        """Per request `(prompt ids, [ImageItem])`: `(ImageFeatures, block-hash spans)` or the
        exception that rules it out; and the number of images encoded (`ModelRunner.place_images`)."""
        ...


class InProcessExecutor:
    """Runs every step on one `ModelRunner` in this process."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._times = StepTimes()

    def execute(self, step: ExecutorStep) -> torch.Tensor:  # [num logit rows, vocab]
        try:
            return self.runner.forward(step.chunks, step.copies, step.new_full_blocks)
        finally:
            self._times = StepTimes(self.runner.last_metadata_seconds, self.runner.last_model_seconds)

    @property
    def last_times(self) -> StepTimes:
        return self._times

    @property
    def last_hidden_states(self) -> torch.Tensor | None:  # [num logit rows, hidden] or None
        """The target's final hidden state at each logits row of the latest step, when the runner keeps
        them (`ModelRunner.keep_hidden_states`, for a proposer that drafts from them)."""
        return self.runner.last_hidden_states

    def encode_images(self, items: list) -> tuple[list, int]:
        return self.runner.encode_images(items)

    def place_images(self, requests: list) -> tuple[list, int]:
        return self.runner.place_images(requests)
