"""How many KV blocks an `Engine` reserves when the user names no pool size.

Without `num_blocks` / `max_kv_bytes` the pool gets a byte budget (vLLM's CPU default is 4 GiB; we
take 2 GiB on CPU, half the free device memory on CUDA), capped at what `max_num_seqs` sequences of
`max_model_len` tokens could ever need.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..config import PagedCacheConfig
from ..hf import KVOwner
from ..hf.state import state_bytes_per_row

DEFAULT_KV_BYTES_CPU = 2 << 30
DEFAULT_KV_FRACTION_CUDA = 0.5  # of the device memory free when the engine is built


def default_num_blocks(model: torch.nn.Module, probe: PagedCacheConfig, max_num_seqs: int, max_model_len: int,
                       device: torch.device, state_rows: int = 0) -> int:
    """Blocks for `probe.max_kv_bytes` (or the default budget on `device`), capped at the most ever needed.
    A model with recurrent layers keeps `state_rows` per-sequence states (`hf.state`) in the same budget:
    their bytes come off it first.

    Raises:
        ValueError: the budget is smaller than one block (after the states).
    """
    kv = KVOwner(model.config, replace(probe, num_blocks=None, max_kv_bytes=None))  # sizes blocks only
    dtype = next(model.parameters()).dtype
    bytes_per_block = kv.bytes_per_block(dtype)
    budget = probe.max_kv_bytes
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * DEFAULT_KV_FRACTION_CUDA)
        else:
            budget = DEFAULT_KV_BYTES_CPU
    states = state_rows * state_bytes_per_row(kv.states.shapes, dtype) if kv.states is not None else 0
    most_ever = max_num_seqs * kv.manager.max_blocks_for(min(max_model_len, 1 << 20))  # every KV group
    num_blocks = min((budget - states) // bytes_per_block, most_ever)
    if num_blocks < 1:
        raise ValueError(f"max_kv_bytes={budget} is smaller than one KV block ({bytes_per_block} bytes)"
                         + (f" beside {state_rows} recurrent states ({states} bytes; fewer max_num_seqs or "
                            "max_state_checkpoints need less)" if states else ""))
    return num_blocks
