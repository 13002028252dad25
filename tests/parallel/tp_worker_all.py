"""Run under `python -m torch.distributed.run --nproc-per-node N tp_worker_all.py MODEL_DIR OUT.json [...]`.

`tp_worker.py`'s work for each (MODEL_DIR, OUT.json) pair in turn, in one process group: one torchrun
start (a launcher and N interpreters importing torch, transformers and hf_paged) for every architecture
the tests check, instead of one each. Each pair's files are those `tp_worker.py` writes.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from tp_worker import compare


def main(pairs: list[str]) -> None:
    if not pairs or len(pairs) % 2:
        raise ValueError(f"expected MODEL_DIR OUT.json pairs, got {pairs}")
    for model_dir, out_path in zip(pairs[::2], pairs[1::2]):
        compare(model_dir, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
