"""`hf-paged` command line."""

from __future__ import annotations

import argparse
import sys

from .config import DEFAULT_BLOCK_SIZE
from .planner import cli as planner_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-paged", description="Paged KV cache for transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate with the default model and check against stock transformers")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--no-verify", action="store_true", help="skip the comparison with stock transformers")
    gen = sub.add_parser("generate", help="answer one chat prompt with the default model")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    sub.add_parser("info", help="versions and the supported transformers range")
    planner_cli.add_subcommands(sub)
    args = parser.parse_args(argv)
    if hasattr(args, "sizing_handler"):
        return planner_cli.run(args)

    if args.command == "demo":
        from .defaults.demo import run_demo

        return 0 if run_demo(args.max_new_tokens, verify=not args.no_verify) else 1
    if args.command == "generate":
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


if __name__ == "__main__":
    sys.exit(main())
