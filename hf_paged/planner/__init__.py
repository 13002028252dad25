"""The KV sizing and roofline planner: how many bytes a model's KV takes, what bounds a decode step,
and how large a batch a memory budget allows. Torch-free arithmetic on a model config.

* `sizing.py`: the calculus (`ModelShape`, `kv_size`, `roofline`, `plan`) and the bundled
  `reference_configs/`.
* `cli.py`: `hf-paged kv-size | roofline | plan`.

Stands apart from the serving stack: it imports nothing of hf_paged but `config`, and nothing of
the serving stack imports it.
"""
