"""The transformers adapter: a `Cache` whose K/V live in blocks, and the hook that plans each step.

* `kv_owner.py`: `KVOwner`, the one owner of a KV pool: the layers' specs and layout, blocks, layer
  tensors (`layer.py`'s `PagedLayer`, and `SharedLayer` for a layer reading another's K/V; byte pages
  for per-layer K/V shapes in `pages.py`), sequences, the step transaction (begin, commit or abort),
  kept sequences and K/V transfer (`kept.py`, `kv_transfer.py`).
* `cache.py`: `PagedCache`, the thin transformers `Cache` adapter over one `KVOwner` (the Cache API,
  and planning a padded batch from stock `generate`).
* `planning.py`: `attach` / `detach`, the forward pre-hook that turns a padded batch into one
  `StepMetadata` and picks the paged or dense attention path.
* `padding.py`: which columns of a padded batch are real tokens (the left-padding rule).
* `multimodal.py`: a vision-language model's images in the engine: split per image, encoded once per
  content digest by the model's own encoder, placed at their placeholders (with Qwen's 3-D positions
  and Gemma 3's bidirectional image blocks), and the block-hash spans that keep them apart.
* `pool_sizing.py`: how far the KV pool may grow. `weights.py`: which weights a prefix was cached
  under (`weights_fingerprint`, and `invalidate` for changes it cannot see). `support.py`: which
  models are supported, and why not.

Depends on `core` (bookkeeping) and `attention` (metadata, kernels); knows nothing about requests,
scheduling or sampling.
"""

from .cache import PagedCache
from .kv_owner import KVOwner
from .layer import PagedLayer, SharedLayer
from .planning import attach, detach
from .support import check_attention_routed, check_model_supported, decoder_of
from .weights import invalidate, weights_fingerprint

__all__ = ["KVOwner", "PagedCache", "PagedLayer", "SharedLayer", "attach", "check_attention_routed",
           "check_model_supported", "decoder_of", "detach", "invalidate", "weights_fingerprint"]
