"""`hf-paged` command line.

Its top level imports only light modules (no torch, no transformers), so `--help` and the planner's
subcommands start in a fraction of a second. Every command checks its arguments (the model, the input
file and column, the flags' ranges) before anything loads: a bad one is one line naming it on stderr
and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from .config import EngineConfig
from .model_source import DTYPES, ModelPathError, check_model_path
from .planner import cli as planner_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from .disagg import AsyncDisaggregatedEngine
        from .serve.launch import main as serve_main

        # serve and disagg never import each other: the server gets the disaggregated client here.
        from . import parallel

        return serve_main(argv[1:], disaggregated=AsyncDisaggregatedEngine.launch, tensor_parallel=parallel)
    if argv[:1] == ["lm-eval"]:  # every later argument is lm-eval's own
        from .integrations.lm_eval_cli import main as lm_eval_main

        return lm_eval_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if hasattr(args, "sizing_handler"):
        return planner_cli.run(args)
    if args.command == "demo":
        from .defaults.demo import run_demo

        return 0 if run_demo(args.max_new_tokens, verify=not args.no_verify) else 1
    if args.command == "generate":
        return _generate(args)
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-paged", description="Paged KV cache for transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate with the default model and check against stock transformers")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--no-verify", action="store_true", help="skip the comparison with stock transformers")
    gen = sub.add_parser("generate", help="answer one prompt, or every row of a dataset file (--input)")
    gen.add_argument("prompt", nargs="?", help="one prompt (without --input)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--model", default="default",
                     help="a model folder (holding config.json), 'module:callable', a Hub id already in the local "
                          "cache, or 'default' (SmolLM2-135M-Instruct)")
    gen.add_argument("--input", help="rows to complete: .jsonl, .json, .csv, .parquet, or a saved datasets folder")
    gen.add_argument("--column", default="prompt", help="the input column holding each prompt")
    gen.add_argument("--output", help="JSON lines written as rows finish; rows already there with a result are "
                                      "skipped, error records are retried")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the model's chat template to the prompt (default: on for a single prompt when "
                          "the model has one, off for --input rows)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed; row i of --input samples with seed + i")
    EngineConfig.add_cli_args(gen, ["max_num_seqs", "block_size"])  # the engine's knobs: one definition
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    gen.add_argument("--device", default=None, help="where the model runs, e.g. cpu, cuda, cuda:1 "
                                                    "(default: cuda if present, else cpu)")
    gen.add_argument("--dtype", default="auto", choices=DTYPES, help="the weights' dtype (auto: the checkpoint's on a GPU, float32 on the CPU)")
    gen.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="split the model over this many tensor-parallel ranks (processes it starts; with "
                          "--dtype auto and no --device)")
    sub.add_parser("info", help="versions and the supported transformers range")
    sub.add_parser("serve", help="an OpenAI-compatible HTTP server (hf-paged serve MODEL_DIR|default --help)")
    sub.add_parser("lm-eval", help="lm-evaluation-harness's command line (same arguments) with the hf_paged "
                                   "attention registered: --model hf --model_args ...,attn_implementation=hf_paged")
    planner_cli.add_subcommands(sub)
    return parser


class _UsageError(Exception):
    """A bad argument of `generate`: one line on stderr, exit status 2."""


def _generate(args) -> int:
    """`hf-paged generate`: one prompt, or a batch job (`--input`, `--output`)."""
    try:
        total = _check_generate_args(args)
        if args.tensor_parallel_size == 1:
            args.device, args.dtype = _placement(args)
    except _UsageError as exc:
        print(f"hf-paged generate: error: {exc}", file=sys.stderr)
        return 2
    engine, tokenizer, close = _open_engine(args)
    try:
        if total is not None:
            return _run_batch_job(engine, tokenizer, args, total)
        return _answer(engine, tokenizer, args)
    finally:
        close()


def _check_generate_args(args) -> int | None:
    """Everything `generate` can check before a model loads. Normalizes `args.model`; returns a batch
    job's number of input rows (None for a single prompt).

    Raises:
        _UsageError: the first bad argument.
    """
    batch = args.input is not None or args.output is not None
    if batch and not (args.input and args.output):
        raise _UsageError("a batch job needs both --input and --output")
    if batch and args.prompt is not None:
        raise _UsageError("give either a prompt or --input, not both")
    if not batch and args.prompt is None:
        raise _UsageError("generate needs a prompt, or --input and --output")
    if not batch and not args.prompt.strip():
        raise _UsageError("the prompt is empty")
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--block-size", args.block_size),
                        ("--tensor-parallel-size", args.tensor_parallel_size)):
        if value < 1:
            raise _UsageError(f"{flag} must be a positive integer, got {value}")
    if args.tensor_parallel_size > 1 and (args.dtype != "auto" or args.device is not None):
        raise _UsageError("--tensor-parallel-size places the model itself: leave --dtype auto and --device unset")
    try:
        _sampling_params(args).validate()
        args.model = check_model_path(args.model)
    except (ValueError, TypeError) as exc:  # a ModelPathError names the model
        raise _UsageError(str(exc) if isinstance(exc, ModelPathError) else f"sampling: {exc}") from None
    if not batch:
        return None
    from .integrations.jobs import done_indices, inspect_input

    try:
        total = inspect_input(args.input, args.column)
        done_indices(args.output)  # an --output that is some other file stops here
    except (ValueError, ImportError) as exc:
        raise _UsageError(str(exc)) from None
    return total


def _placement(args):
    from .model_source import resolve_placement

    try:
        return resolve_placement(args.device, args.dtype)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _sampling_params(args):
    from .sampling_params import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def _open_engine(args):
    """Load the model `args` names (the one loading path of single prompts and batch jobs) and start an
    engine on it: `(engine, tokenizer, close)`."""
    from .engine import Engine
    from .model_source import ModelFromPath
    from .worker.cpu_caches import bound_cpu_kernel_caches

    bound_cpu_kernel_caches()  # a long job: memory stays flat as step shapes vary
    engine_kwargs = EngineConfig.from_cli_args(args).engine_kwargs()
    tp = args.tensor_parallel_size
    if tp == 1:
        model, tokenizer = ModelFromPath(args.model, dtype=args.dtype)()
        engine = Engine(model.to(args.device).eval(), tokenizer, **engine_kwargs, show_progress=False)
        return engine, tokenizer, lambda: engine.shutdown(drain=False)
    from .parallel.launch import start_ranks, stop_ranks

    ranks = start_ranks(args.model, tp, engine_kwargs)
    model, tokenizer = ModelFromPath(args.model, tp)()
    engine = Engine(model.eval(), tokenizer, **engine_kwargs, show_progress=False)

    def close():
        engine.shutdown(drain=False)  # the other ranks stop following
        stop_ranks(ranks)

    return engine, tokenizer, close


def _answer(engine, tokenizer, args) -> int:
    """One prompt through the engine, sampled as a batch job's row 0 would be; the reply on stdout."""
    from .integrations.jobs import prompt_of

    if tokenizer is None:
        print(f"hf-paged generate: error: model {args.model!r} has no tokenizer", file=sys.stderr)
        return 2
    chat = args.chat if args.chat is not None else bool(getattr(tokenizer, "chat_template", None))
    try:
        ids = prompt_of({"prompt": args.prompt}, "prompt", tokenizer, chat)
    except (ValueError, TypeError) as exc:
        print(f"hf-paged generate: error: {exc}", file=sys.stderr)
        return 2
    sample = engine.generate([ids], _sampling_params(args), use_tqdm=False)[0].outputs[0]
    if sample.error is not None or sample.finish_reason == "error":
        print(f"hf-paged generate: error: {sample.error}", file=sys.stderr)
        return 1
    print(sample.text.strip())
    return 0


def _run_batch_job(engine, tokenizer, args, total: int) -> int:
    from .integrations.jobs import read_rows, run_job

    try:
        counts = run_job(engine, tokenizer, read_rows(args.input), args.output, _sampling_params(args),
                         column=args.column, chat=bool(args.chat), progress=not args.no_progress, total=total)
    except KeyboardInterrupt:
        print(f"interrupted; rerun the same command to resume ({args.output} keeps every finished row)")
        return 130
    retried = " (a rerun retries them)" if counts["errors"] else ""
    print(f"{counts['written']} rows written, {counts['errors']} error records{retried}, {counts['skipped']} "
          f"already done; {counts['tokens']} tokens in {counts['seconds']:.1f} s -> {args.output}")
    if counts["errors"] and not counts["written"]:
        print(f"hf-paged generate: error: every row failed; see the error records in {args.output}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
