"""The KV sizing and roofline planner: how many bytes a model's KV and fixed state take, what bounds a
decode step, and how large a batch a memory budget allows. Torch-free arithmetic on a model config:
neither torch nor transformers is imported.

* `configs.py`: a config.json (a path, a model directory or a bundled `reference_configs/` name) as a
  dict, its text model and the defaults transformers would fill in.
* `layers.py`: each layer's kind (attention, linear attention / Mamba, hybrid, MLP-only) and the fixed
  state a linear-attention or Mamba layer keeps per sequence (its shapes by `state_spec`, the cache's
  definition).
* `shape.py`: `ModelShape` (what sizing needs from a config) and the dtype vocabulary.
* `kv.py`, `plan.py`: KV bytes; blocks and sequences per GPU, and the tensor-parallel split that fits.
* `sizing.py`: the roofline, and the one public face re-exporting the rest.
* `refusals.py`: whether hf_paged can serve the model yet, from its config.
* `cli.py`: `hf-paged kv-size | roofline | plan`.

Stands apart from the serving stack: it imports nothing of hf_paged but the torch-free definitions
the cache shares (`config`, `kv_spec`, `state_spec`), and nothing of the serving stack imports it.
"""
