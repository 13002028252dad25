"""What runs on the device for one engine step: the packed forward and the sampler.

* `runner.py`: `ModelRunner`, one packed `[1, num_tokens]` forward of a transformers model over a
  `PagedCache`, with its `StepMetadata`; returns only the logits rows that are sampled.
* `sampling.py`: `SamplingParams` (transformers' field names) and the per-request sampler.

Neither decides which requests run (that is `core.scheduler`) nor holds request state.
"""

from .runner import Chunk, ModelRunner
from .sampling import (
    SamplingParams,
    SamplingState,
    draw_seed,
    needs_processing,
    processed_logits,
    sample,
    sample_processed,
    token_noise,
)

__all__ = ["Chunk", "ModelRunner", "SamplingParams", "SamplingState", "draw_seed", "needs_processing",
           "processed_logits", "sample", "sample_processed", "token_noise"]
