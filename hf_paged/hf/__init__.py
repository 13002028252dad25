"""The transformers adapter: a `Cache` whose K/V live in blocks, and the hook that plans each step.

* `cache.py`: `PagedCache` / `PagedLayer`, the only owner of KV tensors (transformers' Cache API).
* `kv_owner.py`: `KVOwner`, the block-level API over one `PagedCache` for steps planned outside it
  (the engine's): the step transaction (begin, commit or abort), sequences, kept sequences, transfer.
* `planning.py`: `attach` / `detach`, the forward pre-hook that turns a padded batch into one
  `StepMetadata` and picks the paged or dense attention path.
* `padding.py`: which columns of a padded batch are real tokens (the left-padding rule).
* `pool_sizing.py`: how far the KV pool may grow. `weights.py`: which weights a prefix was cached
  under (`weights_fingerprint`, and `invalidate` for changes it cannot see). `support.py`: which
  models are supported, and why not.

Depends on `core` (bookkeeping) and `attention` (metadata, kernels); knows nothing about requests,
scheduling or sampling.
"""

from .cache import PagedCache, PagedLayer
from .kv_owner import KVOwner
from .planning import attach, detach
from .support import check_model_supported, decoder_of
from .weights import invalidate, weights_fingerprint

__all__ = ["KVOwner", "PagedCache", "PagedLayer", "attach", "check_model_supported", "decoder_of", "detach",
           "invalidate", "weights_fingerprint"]
