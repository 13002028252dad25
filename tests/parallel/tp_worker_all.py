"""Run under `python -m torch.distributed.run --nproc-per-node N tp_worker_all.py MODEL_DIR OUT.json [...]`.

`tp_worker.py`'s work for each (MODEL_DIR, OUT.json) pair in turn, in one process group: one torchrun
start (a launcher and N interpreters importing torch, transformers and hf_paged) for every architecture
the tests check, instead of one each. Each pair's files are those `tp_worker.py` writes.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from tp_worker import NEW_TOKENS, padded, prompts, run


def one(model_dir: str, out_path: str) -> None:
    """`tp_worker.main` less the process group's end (the next pair runs in the same group)."""
    world = int(os.environ["WORLD_SIZE"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="hf_paged",
                                                 distributed_config=DistributedConfig(tp_size=world))
    rank = dist.get_rank()
    got = run(model)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(got, f)
    if rank == 0:
        single = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="hf_paged")
        stock = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
        ref = run(single)
        ids, mask = padded(prompts())
        ref["stock_greedy"] = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                             do_sample=False, pad_token_id=0).tolist()
        with open(out_path, "w") as f:
            json.dump(ref, f)
    dist.barrier()


def main(pairs: list[str]) -> None:
    if not pairs or len(pairs) % 2:
        raise ValueError(f"expected MODEL_DIR OUT.json pairs, got {pairs}")
    for model_dir, out_path in zip(pairs[::2], pairs[1::2]):
        one(model_dir, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
