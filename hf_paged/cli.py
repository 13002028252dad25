"""`hf-paged` command line."""

from __future__ import annotations

import argparse
import sys

from .config import EngineConfig
from .planner import cli as planner_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from .disagg import AsyncDisaggregatedEngine
        from .serve.api_server import main as serve_main

        # serve and disagg never import each other: the server gets the disaggregated client here.
        from . import parallel

        return serve_main(argv[1:], disaggregated=AsyncDisaggregatedEngine.launch, tensor_parallel=parallel)
    if argv[:1] == ["lm-eval"]:  # every later argument is lm-eval's own
        from .integrations.lm_eval_cli import main as lm_eval_main

        return lm_eval_main(argv[1:])
    parser = argparse.ArgumentParser(prog="hf-paged", description="Paged KV cache for transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate with the default model and check against stock transformers")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--no-verify", action="store_true", help="skip the comparison with stock transformers")
    gen = sub.add_parser("generate", help="answer one chat prompt, or every row of a dataset file (--input)")
    gen.add_argument("prompt", nargs="?", help="one chat prompt (without --input)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--model", default="default", help="a model folder, or 'default' (SmolLM2-135M-Instruct)")
    gen.add_argument("--input", help="rows to complete: .jsonl, .json, .csv, .parquet, or a saved datasets folder")
    gen.add_argument("--column", default="prompt", help="the input column holding each prompt")
    gen.add_argument("--output", help="JSON lines written as rows finish; rows already there are skipped")
    gen.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None, help="row i samples with seed + i")
    EngineConfig.add_cli_args(gen, ["max_num_seqs", "block_size"])  # the engine's knobs: one definition
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    gen.add_argument("--device", default=None, help="where the model runs (default: cuda if present, else cpu)")
    gen.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16 or float16")
    gen.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="a batch job over this many tensor-parallel ranks (processes it starts; with --dtype auto)")
    sub.add_parser("info", help="versions and the supported transformers range")
    sub.add_parser("serve", help="an OpenAI-compatible HTTP server (hf-paged serve MODEL_DIR|default --help)")
    sub.add_parser("lm-eval", help="lm-evaluation-harness's command line (same arguments) with the hf_paged "
                                   "attention registered: --model hf --model_args ...,attn_implementation=hf_paged")
    planner_cli.add_subcommands(sub)
    args = parser.parse_args(argv)
    if hasattr(args, "sizing_handler"):
        return planner_cli.run(args)

    if args.command == "demo":
        from .defaults.demo import run_demo

        return 0 if run_demo(args.max_new_tokens, verify=not args.no_verify) else 1
    if args.command == "generate" and (args.input or args.output):
        return _batch_job(parser, args)
    if args.command == "generate":
        if args.prompt is None:
            parser.error("generate needs a prompt, or --input and --output")
        from .config import PagedCacheConfig
        from .defaults.models import load_default
        from .defaults.prompts import chat_inputs

        model, tokenizer = load_default(attn_implementation="hf_paged")
        model.hf_paged_cache_config = PagedCacheConfig(block_size=args.block_size)
        inputs = chat_inputs(tokenizer, [args.prompt])
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())
        return 0
    if args.command == "info":
        import torch
        import transformers

        from . import __version__
        from .integrations import SUPPORTED_TRANSFORMERS, is_installed

        low, high = SUPPORTED_TRANSFORMERS
        print(f"hf_paged {__version__}; transformers {transformers.__version__} (supported [{low}, {high})); "
              f"torch {torch.__version__}; generate patch active: {is_installed()}")
        return 0
    return 2


def _batch_job(parser, args) -> int:
    if not (args.input and args.output):
        parser.error("a batch job needs both --input and --output")
    if args.prompt is not None:
        parser.error("give either a prompt or --input, not both")
    from .engine import Engine
    from .integrations.jobs import done_indices
    from .worker.cpu_caches import bound_cpu_kernel_caches

    bound_cpu_kernel_caches()  # a long job: memory stays flat as step shapes vary

    try:
        done_indices(args.output)  # before loading anything: an --output that is some other file stops here
    except ValueError as exc:
        parser.error(str(exc))

    import torch

    tp = args.tensor_parallel_size
    if tp < 1:
        parser.error(f"--tensor-parallel-size must be a positive integer, got {tp}")
    if tp > 1:
        if args.dtype != "auto" or args.device is not None:
            parser.error("--tensor-parallel-size places the model itself: leave --dtype auto and --device unset")
        return _tensor_parallel_job(args, tp)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype, None)
    if dtype is None:
        parser.error(f"--dtype {args.dtype!r}: use auto, float32, bfloat16 or float16")
    if args.model == "default":
        from .defaults.models import load_default

        model, tokenizer = load_default(attn_implementation="hf_paged", device=device,
                                        **({} if dtype == "auto" else {"dtype": dtype}))
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .transformers_api import local_load_kwargs

        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="hf_paged", dtype=dtype,
                                                     **local_load_kwargs()).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    engine = Engine(model, tokenizer, **EngineConfig.from_cli_args(args).engine_kwargs(), show_progress=False)
    return _run_batch_job(engine, tokenizer, args)


def _tensor_parallel_job(args, tp: int) -> int:
    """A batch job with the model split over `tp` ranks: this process (rank 0) runs the job, the ranks it
    starts follow its steps until its engine shuts down."""
    from .engine import Engine
    from .model_source import ModelFromPath
    from .parallel.launch import start_ranks, stop_ranks

    engine_kwargs = EngineConfig.from_cli_args(args).engine_kwargs()
    ranks = start_ranks(args.model, tp, engine_kwargs)
    model, tokenizer = ModelFromPath(args.model, tp)()
    engine = Engine(model.eval(), tokenizer, **engine_kwargs, show_progress=False)
    try:
        return _run_batch_job(engine, tokenizer, args)
    finally:
        engine.shutdown(drain=False)  # the other ranks stop following
        stop_ranks(ranks)


def _run_batch_job(engine, tokenizer, args) -> int:
    from .integrations.jobs import read_rows, run_job
    from .sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    try:
        counts = run_job(engine, tokenizer, read_rows(args.input), args.output, params, column=args.column,
                         chat=args.chat, progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"interrupted; rerun the same command to resume ({args.output} keeps every finished row)")
        return 130
    print(f"{counts['written']} rows written, {counts['errors']} error records, {counts['skipped']} already done; "
          f"{counts['tokens']} tokens in {counts['seconds']:.1f} s -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
