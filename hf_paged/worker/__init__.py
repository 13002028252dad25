"""What runs on the device for one engine step: the packed forward and the sampler.

* `runner.py`: `ModelRunner`, one packed `[1, num_tokens]` forward of a transformers model over a
  `PagedCache`, with its `StepMetadata`; returns only the logits rows that are sampled.
* `sampling.py`: `SamplingState` (a request's incrementally kept penalty and n-gram state, from its
  `hf_paged.sampling_params.SamplingParams`) and the counter-based random numbers.
* `sampler.py`: the batched `Sampler`: every row of a step processed and sampled together, with
  logprobs, scores and raw logits on request.
* `cuda_graphs.py`: `DecodeGraphs`, decode steps captured per (batch bucket, max_seqlen_k bucket)
  and replayed from static input buffers (on CUDA with the Triton backend; `Engine(cuda_graphs=)`).
* `cpu_graphs.py`: compiled decode steps on CPU, the model's forward compiled by Inductor per batch bucket
  and run through the same `DecodeGraphs` (off unless asked for: `Engine(cpu_graphs=)`, `HF_PAGED_CPU_GRAPHS`).
* `cpu_caches.py`: caps on oneDNN's shape-keyed primitive caches, so a long-running process's
  memory stays flat as step shapes vary.

Neither decides which requests run (that is `core.scheduler`) nor holds request state.
"""

from .cpu_caches import bound_cpu_kernel_caches
from .runner import Chunk, ModelRunner, StepInputs
from .sampler import SampleRow, Sampler, SamplerOutput, TokenLogprobs, processed_logits, sample_processed
from .sampling import SamplingState, draw_seed, sample_seed, uniform

__all__ = ["bound_cpu_kernel_caches", "Chunk", "ModelRunner", "SampleRow", "StepInputs", "Sampler", "SamplerOutput", "SamplingState",
           "TokenLogprobs", "draw_seed", "processed_logits", "sample_processed", "sample_seed", "uniform"]
