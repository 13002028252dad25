"""GRPO rollout time per step (TRL's `GRPOTrainer`, SmolLM2-135M-Instruct, CPU), four ways in one run:

1. stock: sdpa model, TRL's default path (`model.generate` on the left-padded, repeated prompts);
2. transformers' continuous batching: sdpa model, `use_transformers_continuous_batching=True`
   (TRL calls `model.generate_batch`, served by transformers' manager);
3. hf_paged, default path (the same `model.generate` call, on the engine; repeated prompts share blocks);
4. hf_paged, `use_transformers_continuous_batching=True` (`generate_batch` answered by the engine).

Each trains `--steps` real GRPO steps (the weights change between rollouts, so no prefix survives
from one step to the next), timing TRL's rollout call (`_generate_single_turn`) in every step.
Sampling differs between runs, so the generated tokens per step are printed beside the time, and the
ratios are also given per generated token. fp32 throughout: on the CPU transformers' continuous
batching fails under TRL's default bf16 autocast (accelerate's output conversion meets its cache).

    python benchmarks/grpo_rollout.py [--steps 3] [--prompts 4] [--generations 8] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path

import torch

import hf_paged
from hf_paged.defaults.models import load_default

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_rollouts.py"


def _example():
    spec = importlib.util.spec_from_file_location("grpo_rollouts", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="distinct prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="num_generations (completions per prompt)")
    parser.add_argument("--new-tokens", type=int, default=24, help="max_completion_length")
    args = parser.parse_args()
    example = _example()
    dataset = example.prompts_dataset(args.prompts * args.steps)
    runs = [("stock generate (sdpa)", "sdpa", "default"),
            ("transformers generate_batch (sdpa)", "sdpa", "continuous"),
            ("hf_paged generate", "hf_paged", "default"),
            ("hf_paged generate_batch", "hf_paged", "continuous")]
    print(f"== GRPO on SmolLM2-135M-Instruct, CPU fp32, torch threads {torch.get_num_threads()}: {args.steps} steps of "
          f"{args.prompts} prompts x {args.generations} generations, max_completion_length {args.new_tokens} ==")
    results = {}
    for label, attn, path in runs:
        torch.manual_seed(0)
        model, tokenizer = load_default(attn_implementation=attn)
        out = example.run(model, tokenizer, path=path, steps=args.steps, num_generations=args.generations,
                          prompts_per_step=args.prompts, max_completion_length=args.new_tokens,
                          output_dir=f"/tmp/hf_paged_grpo_bench/{attn}-{path}", dataset=dataset)
        history = out["trainer"].state.log_history
        tokens = [e["completions/mean_length"] * args.prompts * args.generations for e in history
                  if "completions/mean_length" in e]
        results[label] = (out["rollout_seconds"], tokens)
        if attn == "hf_paged":
            assert model.config._attn_implementation == "hf_paged"
            hf_paged.release(model)
        del model
    stock_s = statistics.median(results[runs[0][0]][0])
    stock_tps = statistics.median(t / s for s, t in zip(*results[runs[0][0]]))
    print(f"{'':36}{'first s':>9}{'median s':>10}{'tokens/step':>13}{'vs stock':>10}{'per token vs stock':>20}")
    for label, (seconds, tokens) in results.items():
        median = statistics.median(seconds)
        tps = statistics.median(t / s for s, t in zip(seconds, tokens))
        print(f"{label:36}{seconds[0]:>9.2f}{median:>10.2f}{statistics.median(tokens):>13.0f}"
              f"{median / stock_s:>9.3f}x{stock_tps / tps:>19.3f}x")


if __name__ == "__main__":
    main()
