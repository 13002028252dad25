"""What runs on the device for one engine step: the packed forward and the sampler.

* `runner.py`: `ModelRunner`, one packed `[1, num_tokens]` forward of a transformers model over a
  `PagedCache`, with its `StepMetadata`; returns only the logits rows that are sampled.
* `sampling.py`: `SamplingParams` (transformers' field names) and the per-request sampler.

Neither decides which requests run (that is `core.scheduler`) nor holds request state.
"""

from .runner import Chunk, ModelRunner
from .sampling import SamplingParams, SamplingState, make_generator, needs_processing, processed_logits, sample

__all__ = ["Chunk", "ModelRunner", "SamplingParams", "SamplingState", "make_generator", "needs_processing",
           "processed_logits", "sample"]
