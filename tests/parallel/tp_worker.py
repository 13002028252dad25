"""Run under `python -m torch.distributed.run --nproc-per-node N tp_worker.py MODEL_DIR OUT.json`.

Loads MODEL_DIR with transformers' tensor parallelism over the N ranks (gloo on CPU) and with
attn_implementation="hf_paged", then on every rank: `Engine.generate` greedy and seeded-sampled over
mixed-length prompts, the same with a pool small enough to preempt, and drop-in `generate` on a
left-padded batch, greedy and sampled. Each rank writes what it got and its pool's K/V bytes per
token (measured on the pool's tensors) to OUT.json.rank<r>; rank 0 also writes the single-process
references (the same model loaded without tensor parallelism) to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from hf_paged import Engine, SamplingParams

PROMPT_LENGTHS = (3, 17, 40, 9, 26)
NEW_TOKENS = 8
# Two prompts that fill a pool of 4 blocks of 16 between them and outgrow it as they decode: one is
# preempted and recomputed.
SMALL_POOL, SMALL_PROMPT_LENGTHS, SMALL_NEW_TOKENS = 4, (28, 30), 12


def prompts(lengths=PROMPT_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]


def padded(rows: list[list[int]]):
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def pool_bytes_per_token(engine: Engine) -> int:
    kv = engine.kv
    total = sum(t.numel() * t.element_size() for layer in kv.slot_owners() for t in layer.payload())
    return total // (kv.num_blocks * kv.block_size)


def run(model) -> dict:
    rows = prompts()
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9, seed=11)
    out = {}
    engine = Engine(model)
    out["greedy"] = [o.outputs[0].token_ids for o in engine.generate(rows, greedy)]
    out["sampled"] = [o.outputs[0].token_ids for o in engine.generate(rows, sampled)]
    out["bytes_per_token"] = pool_bytes_per_token(engine)
    # A recurrent model's per-sequence state: transformers' plan gathers its mixers' outputs, so every rank
    # keeps the whole state (measured on the pool's tensors, one row).
    out["state_bytes_per_row"] = engine.kv.states.bytes_per_row() if engine.kv.states is not None else 0
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # a rank's shards
    out["weight_bytes"] = sum(t.numel() * t.element_size() for t in local)
    small, crowded = Engine(model, num_blocks=SMALL_POOL), prompts(SMALL_PROMPT_LENGTHS)
    out["preempted_greedy"] = [o.outputs[0].token_ids for o in small.generate(
        crowded, SamplingParams(max_new_tokens=SMALL_NEW_TOKENS, temperature=0.0))]
    out["preempted_sampled"] = [o.outputs[0].token_ids for o in small.generate(
        crowded, SamplingParams(max_new_tokens=SMALL_NEW_TOKENS, temperature=1.0, seed=3))]
    out["preemptions"] = small.metrics().get("vllm:num_preemptions")
    ids, mask = padded(rows)
    out["dropin_greedy"] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                          do_sample=False, pad_token_id=0).tolist()
    out["dropin_steps"] = getattr(model, "hf_paged_last_metrics", {}).get("vllm:num_steps", getattr(model, "hf_paged_last_metrics", {}).get("num_steps"))
    torch.manual_seed(5)
    out["dropin_sampled"] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                           do_sample=True, pad_token_id=0).tolist()
    return out


def compare(model_dir: str, out_path: str) -> None:
    """One model: each rank's outputs under TP, and rank 0's single-process and stock references."""
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


def main(model_dir: str, out_path: str) -> None:
    compare(model_dir, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
