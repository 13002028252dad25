"""`hf-paged serve`'s command line: its flags, the checks made before anything loads, where the model
goes (`--device`, `--dtype`), the engine behind the server (in this process, over tensor-parallel
ranks, or over disaggregated workers), the start-up banner, and uvicorn until SIGTERM.

The server itself is `api_server.Server`; the request caps and `max_tokens`' defaults are
`openai_protocol.Limits` and `openai_protocol.max_tokens_for`, each flag defined once there.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys

from ..config import EngineConfig
from ..model_source import DTYPES, ModelFromPath, ModelPathError, check_model_path, resolve_placement
from .api_server import Server
from .auth import check_api_key
from .openai_protocol import Limits, describe_defaults

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line: serve's usage alone is a screenful
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """`hf-paged serve`'s flags."""
    parser = _Parser(prog="hf-paged serve", description="OpenAI-compatible server over hf_paged")
    parser.add_argument("model", help="a model folder, a factory 'module:callable', or 'default' (SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("HF_PAGED_API_KEY"),
                        help="require 'Authorization: Bearer <key>' (default: $HF_PAGED_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients pass (default: the path)")
    parser.add_argument("--device", default=None,
                        help="where the model runs: cpu, cuda or cuda:N (default: cuda if a GPU is present, else cpu)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, metavar="{" + ",".join(DTYPES) + "}",
                        help="the model's dtype (default auto: the checkpoint's on a GPU, float32 on the CPU)")
    parser.add_argument("--max-waiting", type=int, default=256, help="requests in flight before 429")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + completion tokens per request (default: the model's, at most 8192)")
    for name, flag, default, help in Limits.flags():  # the request caps: one definition, in openai_protocol.Limits
        parser.add_argument(flag, dest=name, type=int, default=default,
                            help=help if default is None else f"{help} (default {default})")
    EngineConfig.add_cli_args(parser, ["max_num_seqs", "num_blocks", "block_size", "attention_backend"])  # one definition
    parser.add_argument("--grace", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")
    parser.add_argument("--num-prefill", type=int, default=None,
                        help="serve over disaggregated workers: prefill processes (default 1 with --num-decode)")
    parser.add_argument("--num-decode", type=int, default=None,
                        help="serve over disaggregated workers: decode processes (default 1 with --num-prefill)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split the model over this many ranks (processes this command starts; gloo on CPU, "
                             "NCCL on GPU) with transformers' tensor parallelism; this process is rank 0")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="serve this many replicas of the model (one process each, each tensor-parallel with "
                             "--tensor-parallel-size), each request routed to one by prefix-cache affinity, then load")
    for role in ("prefill", "decode"):
        parser.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None,
                            help=f"with --num-prefill/--num-decode: ranks per {role} worker (default "
                                 "--tensor-parallel-size); each KV head moves once, from the prefill rank holding it "
                                 "to the decode rank that needs it")
    return parser


def load_placed(model: str, device, dtype: str):
    """The model of `model` (a folder, "default" or "module:callable") on `device` in `dtype`, in eval
    mode, with its tokenizer (None without one) and its multimodal processor (None for text).
    `device` and `dtype` as `resolve_placement` gives them."""
    source = ModelFromPath(model, dtype=dtype)
    loaded, tokenizer = source()
    return loaded.to(device).eval(), tokenizer, source.processor()


@dataclasses.dataclass
class Launched:
    """A server ready to serve: the `Server` (its ASGI `app`), the engine client behind it, the
    start-up banner, and what `close` stops."""

    args: argparse.Namespace
    server: Server
    client: object
    banner: str
    ranks: list
    tensor_parallel: object = None

    def close(self) -> None:
        """Stop the engine (what is in flight is aborted) and the tensor-parallel ranks this process started."""
        asyncio.run(self.client.shutdown(drain=False))
        if self.ranks:
            self.tensor_parallel.stop_ranks(self.ranks)  # they stopped following when the engine shut down


def prepare(argv: list[str] | None = None, disaggregated=None, tensor_parallel=None) -> Launched:
    """Parse `argv`, refuse bad flags before anything loads (exit 2, one line), load the model and
    build the engine and the `Server`. `main` serves it; arguments as `main`'s."""
    from ..hf.rope import default_max_model_len
    from ..worker.cpu_caches import bound_cpu_kernel_caches

    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("tensor_parallel_size", "data_parallel_size", "prefill_tensor_parallel_size",
                 "decode_tensor_parallel_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    is_split = args.num_prefill is not None or args.num_decode is not None
    data_parallel = args.data_parallel_size > 1
    is_disaggregated = is_split or data_parallel  # served by worker processes
    pool_sizes = tuple(args.tensor_parallel_size if n is None else n
                       for n in (args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size))
    if not is_split and (args.prefill_tensor_parallel_size or args.decode_tensor_parallel_size):
        parser.error("--prefill-tensor-parallel-size/--decode-tensor-parallel-size size the pools of "
                     "--num-prefill/--num-decode; without them, use --tensor-parallel-size")
    if max(args.tensor_parallel_size, *pool_sizes) > 1 and tensor_parallel is None:
        parser.error("--tensor-parallel-size is wired by the hf-paged command (python -m hf_paged.cli serve)")
    if is_split and data_parallel:
        parser.error("--data-parallel-size does not combine with --num-prefill/--num-decode (add decode workers "
                     "with --num-decode instead)")
    if is_disaggregated and disaggregated is None:
        parser.error("--num-prefill/--num-decode/--data-parallel-size are wired by the hf-paged command "
                     "(python -m hf_paged.cli serve)")
    caps = {name: getattr(args, name) for name, _, _, _ in Limits.flags()}
    try:  # before loading anything: an empty key would open every route; a typo'd path loads nothing
        check_api_key(args.api_key)
        Limits(**caps)
        check_model_path(args.model)
    except (ModelPathError, ValueError) as exc:
        parser.error(str(exc))
    if args.attention_backend is not None:
        from ..attention.dispatch import choices

        if args.attention_backend.lower() not in choices():
            parser.error(f"--attention-backend must be one of {', '.join(choices())}, got {args.attention_backend!r}")
    places_itself = is_disaggregated or args.tensor_parallel_size > 1
    if places_itself and (args.device is not None or args.dtype != "auto"):
        parser.error("--tensor-parallel-size, --data-parallel-size and --num-prefill/--num-decode place the model "
                     "themselves: leave --device and --dtype unset")
    if not places_itself:
        try:
            device, dtype = resolve_placement(args.device, args.dtype)
        except ValueError as exc:
            parser.error(str(exc))
    from ..optional import require

    for module in ("fastapi", "uvicorn", "prometheus_client"):  # the `serve` extra, before loading anything
        require(module, "serve", "hf-paged serve")
    ranks, processor, model = [], None, None  # the tensor-parallel ranks this process starts
    bound_cpu_kernel_caches()  # before the first forward: a server's RSS stays flat (worker/cpu_caches.py)
    if is_disaggregated:  # the workers load the model; this process only tokenises
        client, tokenizer = _disaggregated(parser, args, disaggregated, tensor_parallel, data_parallel, pool_sizes)
        limit = args.max_model_len or min(client.max_model_len or 2048, 8192)
    else:
        from ..engine import AsyncEngine, Engine

        if args.tensor_parallel_size > 1:  # ranks 1.. start now: every rank loads its shard at once
            ranks = tensor_parallel.start_ranks(args.model, args.tensor_parallel_size, EngineConfig.from_cli_args(
                args, max_model_len=args.max_model_len).engine_kwargs())
            source = ModelFromPath(args.model, args.tensor_parallel_size)
            model, tokenizer = source()
            model, processor = model.eval(), source.processor()
        else:
            model, tokenizer, processor = load_placed(args.model, device, dtype)
        if tokenizer is None:
            parser.error(f"{args.model} has no tokenizer")
        if processor is not None:  # images in chat messages, for a vision-language model
            from ..optional import require

            require("PIL", what="serving a vision-language model's images")  # at start, not per request
        limit = args.max_model_len or min(default_max_model_len(model.config.get_text_config(decoder=True)) or 2048,
                                          8192)
        engine = Engine(model, tokenizer, **EngineConfig.from_cli_args(args, max_model_len=limit).engine_kwargs(),
                        show_progress=False)
        client = AsyncEngine(engine)
    name = args.served_model_name or args.model
    limits = Limits(**caps, max_model_len=limit)
    server = Server(client, tokenizer, name, api_key=args.api_key, limits=limits, max_waiting=args.max_waiting,
                    processor=processor)
    text = banner(name, args, limits, model, None if model is None else client.metrics())
    return Launched(args, server, client, text, ranks, tensor_parallel)


def _disaggregated(parser, args, disaggregated, tensor_parallel, data_parallel: bool, pool_sizes):
    """The client over disaggregated workers (`--num-prefill`/`--num-decode`) or replicas
    (`--data-parallel-size`), and the tokenizer this process uses."""
    _, tokenizer = ModelFromPath(args.model)(tokenizer_only=True)
    if tokenizer is None:
        parser.error(f"{args.model} has no tokenizer")
    engine_kwargs = EngineConfig.from_cli_args(args, max_model_len=args.max_model_len).engine_kwargs()
    if data_parallel:  # replicas: every worker runs whole requests, each at --tensor-parallel-size
        factory = (tensor_parallel.TensorParallelReplica(args.model, args.tensor_parallel_size)
                   if args.tensor_parallel_size > 1 else ModelFromPath(args.model))
        return disaggregated(factory, tokenizer=tokenizer, num_prefill=0, num_decode=args.data_parallel_size,
                             engine_kwargs=engine_kwargs), tokenizer
    factory = (tensor_parallel.TensorParallelReplica(args.model) if max(pool_sizes) > 1
               else ModelFromPath(args.model))  # prefill and decode pools, each at its own size
    return disaggregated(factory, tokenizer=tokenizer, num_prefill=1 if args.num_prefill is None else args.num_prefill,
                         num_decode=1 if args.num_decode is None else args.num_decode, engine_kwargs=engine_kwargs,
                         prefill_tensor_parallel_size=pool_sizes[0],
                         decode_tensor_parallel_size=pool_sizes[1]), tokenizer


def banner(name: str, args, limits: Limits, model=None, metrics: dict | None = None) -> str:
    """Two lines for the start: what is served where (model, device, dtype, KV pool, context, batch),
    then the request defaults and the address. `model` and the engine's `metrics` when the model is in
    this process (None: in worker processes)."""
    if model is not None:
        param = next(model.parameters())
        blocks, block_size = metrics["kv_num_blocks"], metrics["kv_block_size"]
        pool = (f"KV pool {blocks:,} blocks x {block_size} tokens = {blocks * block_size:,} tokens "
                f"({_bytes(blocks * metrics['kv_bytes_per_block'])})")
        where = f"on {param.device}, {str(param.dtype).removeprefix('torch.')}"
        if args.tensor_parallel_size > 1:
            where += f", tensor-parallel over {args.tensor_parallel_size} ranks"
    else:
        where, pool = "in worker processes", "KV pools in the workers"
    return (f"hf-paged serve: {name} ({args.model}) {where}; {pool}; max_model_len {limits.max_model_len:,}, "
            f"max_num_seqs {args.max_num_seqs}\n"
            f"hf-paged serve: {describe_defaults(limits)}; listening on http://{args.host}:{args.port}")


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def main(argv: list[str] | None = None, disaggregated=None, tensor_parallel=None) -> int:
    """`hf-paged serve MODEL_DIR|default|module:callable [--host --port --api-key --device --dtype ...]`.

    Args:
        disaggregated: builds the `EngineClient` over disaggregated workers for `--num-prefill` /
            `--num-decode`, and over replicas for `--data-parallel-size` (no prefill worker): called as
            `disaggregated(model_factory, tokenizer=, num_prefill=, num_decode=, engine_kwargs=)` (pools
            add `prefill_tensor_parallel_size=` and `decode_tensor_parallel_size=`), with a `max_model_len`
            attribute on what it returns (the `hf-paged` command passes
            `disagg.AsyncDisaggregatedEngine.launch`).
        tensor_parallel: starts and stops the other ranks for `--tensor-parallel-size`: a module with
            `start_ranks(model, size, engine_kwargs) -> ranks`, `stop_ranks(ranks)` and
            `TensorParallelReplica(model, size)`, a replica's model factory (the `hf-paged` command
            passes `hf_paged.parallel`).
    """
    launched = prepare(argv, disaggregated, tensor_parallel)
    args = launched.args
    import uvicorn

    if args.api_key is None and args.host not in LOOPBACK:
        print(f"WARNING: hf-paged serve listens on {args.host} without --api-key: anyone who can reach it can use "
              "it", file=sys.stderr, flush=True)
    print(launched.banner, file=sys.stderr, flush=True)
    config = uvicorn.Config(launched.server.app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.grace, limit_concurrency=None)
    # uvicorn drains on SIGTERM, then re-raises it under the handler it found: a no-op, so that a
    # drained shutdown exits 0 instead of dying of the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.Server(config).run()  # SIGTERM/SIGINT: stop accepting, finish in-flight requests, return
    launched.close()
    return 0
