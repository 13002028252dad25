"""The disaggregated topology under torchrun: `python -m torch.distributed.run --nproc-per-node 1+P+D
-m hf_paged.disagg.torchrun --prefill P --decode D ...`. Rank 0 hosts the store and routes (the
`Supervisor` over torchrun's processes, which it knows only by their heartbeats), ranks 1..P
prefill, the rest decode; prompts come from a JSON-lines file and outputs go to another.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from ..config import EngineConfig
from ..model_source import ModelFromPath
from ..sampling_params import SamplingParams
from .client import DisaggregatedEngine
from .supervisor import Supervisor
from .worker import WorkerSpec
from .worker import main as worker_main


def main(argv: list[str] | None = None) -> int:
    """`python -m torch.distributed.run --nproc-per-node 1+P+D -m hf_paged.disagg.torchrun --prefill P
    --decode D --model default|DIR --input prompts.jsonl --output out.jsonl`: rank 0 routes (and writes
    the outputs), ranks 1..P prefill, the rest decode."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="hf_paged.disagg.torchrun", description=main.__doc__)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--model", default="default", help="a model folder, a factory 'module:callable', or "
                                                               "'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--input", required=True, help="JSON lines with a 'prompt' (text) or 'token_ids' per row")
    parser.add_argument("--output", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    EngineConfig.add_cli_args(parser, ["block_size"])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 1 + args.prefill + args.decode:
        parser.error(f"torchrun started {world} processes; --prefill {args.prefill} --decode {args.decode} needs "
                     f"{1 + args.prefill + args.decode} (one router)")
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    factory = ModelFromPath(args.model)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if rank > 0:
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = f"cuda:{local % torch.cuda.device_count()}" if backend == "nccl" else "cpu"
        name = f"prefill{rank - 1}" if rank <= args.prefill else f"decode{rank - 1 - args.prefill}"
        worker_main(WorkerSpec(name=name, role=name.rstrip("0123456789"), rank=rank - 1, world_size=world - 1,
                               host=host, port=port, backend=backend, model_factory=factory,
                               engine_kwargs={"block_size": args.block_size, "enable_hybrid_kv": False},
                               num_threads=max(1, (os.cpu_count() or 1) // (world - 1)), device=device))
        return 0  # not reached: worker_main exits the process
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    supervisor = Supervisor(store, args.prefill, args.decode, args.block_size, args.heartbeat_timeout)
    # torchrun owns the workers' processes: the router knows them only by their heartbeats.
    supervisor.start({name: _RemoteWorker() for name in supervisor.names}, start_timeout=600.0)
    engine = DisaggregatedEngine.over(supervisor)
    _, tokenizer = factory(tokenizer_only=True)
    rows = [json.loads(line) for line in open(args.input) if line.strip()]
    if tokenizer is None and any("token_ids" not in row for row in rows):
        parser.error(f"{args.model} has no tokenizer: give every input row 'token_ids'")
    prompts = [row["token_ids"] if "token_ids" in row else tokenizer(row["prompt"])["input_ids"] for row in rows]
    try:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
        with open(args.output, "w") as f:
            for i, out in enumerate(outputs):
                text = tokenizer.decode(out.token_ids) if tokenizer is not None else None
                f.write(json.dumps({"index": i, "token_ids": out.token_ids, "text": text,
                                    "finish_reason": out.finish_reason,
                                    "error": None if out.error is None else str(out.error)}) + "\n")
        print(json.dumps({k: v for k, v in engine.metrics().items() if k != "workers"}, default=str))
    finally:
        engine.close()
    return 0


class _RemoteWorker:
    """A torchrun worker as the router sees it: alive while it beats (torchrun owns the process)."""

    pid = -1
    exitcode = None

    def is_alive(self) -> bool:
        return True

    def join(self, timeout=None) -> None:
        return None

    def kill(self) -> None:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
