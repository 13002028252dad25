"""`python -m hf_paged.attention.triton.tune`: search the attention kernels' launch configurations on
this GPU for a few model shapes, and merge the winners into a winners file (see `tuning`).

    python -m hf_paged.attention.triton.tune --out hf_paged/attention/triton/tuned_configs.json
    python -m hf_paged.attention.triton.tune --list     # each key's pruned candidates; needs no GPU

Each model shape runs one decode step (`paged_decode`, every sequence `--context` tokens long) and
one batch of full prefills (`flash_prefill`) with HF_PAGED_AUTOTUNE=force, so every key those
launches use is searched afresh on realistic arguments: each pruned candidate is compiled once and
timed with a cold L2. A key's winner replaces the heuristic only when it is more than
`tuning.MIN_GAIN` faster. Compiling dominates: about a second per candidate.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from . import decode, prefill
from .tuning import (
    AUTOTUNE_ENV,
    DEFAULT_CONFIGS_PATH,
    SearchResult,
    TuningKey,
    clear_cache,
    config_str,
    search_results,
    shared_memory_limit,
    write_winners,
)


@dataclass(frozen=True)
class ModelShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


KERNELS = ("paged_decode", "flash_prefill")
MODELS = {
    "smollm2-135m": ModelShape(num_q_heads=9, num_kv_heads=3, head_dim=64),
    "llama-8b": ModelShape(num_q_heads=32, num_kv_heads=8, head_dim=128),
}


def paged_batch(shape: ModelShape, num_seqs: int, seq_len: int, q_len: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0) -> dict:
    """Arguments of one step: `num_seqs` sequences of `seq_len` cached tokens (the last `q_len` of them
    this step's queries) in randomly placed blocks."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = math.ceil(seq_len / block_size)
    num_blocks = num_seqs * blocks_per_seq
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    return dict(
        query=torch.randn(num_seqs * q_len, shape.num_q_heads, shape.head_dim, device=device, generator=gen,
                          dtype=dtype),
        key_cache=torch.randn(cache_shape, device=device, generator=gen, dtype=dtype),
        value_cache=torch.randn(cache_shape, device=device, generator=gen, dtype=dtype),
        block_tables=torch.randperm(num_blocks, device=device, generator=gen).view(num_seqs, blocks_per_seq).int(),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        cu_seqlens_q=(torch.arange(num_seqs + 1, device=device) * q_len).int(),
        max_seqlen_q=q_len,
        max_seqlen_k=seq_len,
        scale=shape.head_dim ** -0.5,
    )


def tune(
    models: list[str],
    dtypes: list[torch.dtype],
    block_sizes: list[int],
    query_lens: list[int],
    decode_seqs: int,
    context: int,
    prefill_seqs: int,
    prefill_len: int,
    device: torch.device,
    kernels: tuple[str, ...] | list[str] = KERNELS,
    after_each: Callable[[list[SearchResult]], None] | None = None,
) -> list[SearchResult]:
    """Search every key the listed workloads launch, afresh; returns the searches in order.
    `after_each` gets the searches so far after every launch (the command writes them then, so a run
    stopped at a time limit keeps what it measured).

    Decode runs `decode_seqs` sequences of `context` tokens for each query length in `query_lens`
    (1: decode; k + 1: a speculative verify step; lengths that give the same BLOCK_M share a key);
    prefill runs `prefill_seqs` full prefills of `prefill_len` tokens. `kernels` picks which run.
    """
    previous = os.environ.get(AUTOTUNE_ENV)
    os.environ[AUTOTUNE_ENV] = "force"
    clear_cache()
    try:
        for name in models:
            shape = MODELS[name]
            for dtype in dtypes:
                for block_size in block_sizes:
                    if "paged_decode" in kernels:
                        for q_len in query_lens:
                            decode.paged_decode(**paged_batch(shape, decode_seqs, context, q_len, block_size, dtype,
                                                              device))
                            if after_each is not None:
                                after_each(search_results())
                    if "flash_prefill" in kernels:
                        prefill.flash_prefill(**paged_batch(shape, prefill_seqs, prefill_len, prefill_len,
                                                            block_size, dtype, device))
                        if after_each is not None:
                            after_each(search_results())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        if previous is None:
            os.environ.pop(AUTOTUNE_ENV, None)
        else:
            os.environ[AUTOTUNE_ENV] = previous
    return search_results()


def list_candidates(
    models: list[str],
    dtypes: list[torch.dtype],
    block_sizes: list[int],
    query_lens: list[int],
    device: torch.device,
    kernels: tuple[str, ...] | list[str] = KERNELS,
) -> dict[TuningKey, list[triton.Config]]:
    """Each key's pruned candidates (heuristic first), as `tune` would search them; printed too."""
    found = {}
    for name in models:
        shape = MODELS[name]
        group = shape.num_q_heads // shape.num_kv_heads
        for dtype in dtypes:
            for block_size in block_sizes:
                keys = []
                if "paged_decode" in kernels:
                    keys += [decode.tuning_key(device, shape.head_dim, shape.head_dim, group, block_size, dtype,
                                               dtype, q) for q in query_lens]
                if "flash_prefill" in kernels:
                    keys.append(prefill.tuning_key(device, shape.head_dim, shape.head_dim, group, block_size, dtype,
                                                   dtype))
                for key in dict.fromkeys(keys):
                    build = decode.decode_configs if key.kernel == "paged_decode" else prefill.prefill_configs
                    found[key] = configs = build(key, shared_memory_limit(device))
                    print(f"{name} {key}: {len(configs)} candidates")
                    for config in configs:
                        print(f"    {config_str(config)}")
    print(f"{sum(map(len, found.values()))} candidates in all")
    return found


def _report(results: list[SearchResult]) -> None:
    for r in results:
        k = r.key
        shape = f"d{k.head_dim} g{k.group} bs{k.block_size} {k.dtype}" + (f" m{k.block_m}" if k.block_m else "")
        print(f"{k.kernel:13s} {shape}: heuristic {r.heuristic_ms * 1e3:8.1f} us -> {config_str(r.winner)} "
              f"{r.winner_ms * 1e3:8.1f} us ({r.heuristic_ms / r.winner_ms:.2f}x)")
        for config, ms in sorted(r.timings, key=lambda t: t[1]):
            print(f"    {ms * 1e3:8.1f} us  {config_str(config)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_paged.attention.triton.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_CONFIGS_PATH,
                        help="winners file to merge into (default: the packaged tuned_configs.json)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16", "float32"], default=["bfloat16"])
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[16])
    parser.add_argument("--query-lens", nargs="+", type=int, default=[1],
                        help="decode query lengths (1: decode, k+1: speculative verify)")
    parser.add_argument("--decode-seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024, help="tokens per sequence in the decode step")
    parser.add_argument("--prefill-seqs", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--list", action="store_true", help="print the pruned candidates of each key and exit")
    parser.add_argument("--dry-run", action="store_true", help="search and report, but write nothing")
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, name) for name in args.dtypes]

    if args.list:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        list_candidates(args.models, dtypes, args.block_sizes, args.query_lens, device, args.kernels)
        return 0
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        print("tune needs a CUDA GPU and compiled Triton (TRITON_INTERPRET unset)", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    results = tune(args.models, dtypes, args.block_sizes, args.query_lens, args.decode_seqs, args.context,
                   args.prefill_seqs, args.prefill_len, device, args.kernels,
                   after_each=None if args.dry_run else lambda done: write_winners(args.out, done))
    _report(results)
    if not args.dry_run:
        write_winners(args.out, results)
        print(f"wrote {len(results)} winners for {torch.cuda.get_device_name(device)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
