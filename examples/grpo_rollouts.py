"""Two GRPO steps (TRL's `GRPOTrainer`) on SmolLM2-135M-Instruct, on the CPU, with a toy reward,
with the model loaded as `attn_implementation="hf_paged"` (the only change from plain TRL).

    python examples/grpo_rollouts.py [--steps 2] [--path default|continuous|both]

Both of TRL's transformers rollout paths run on hf_paged's engine:

* `default`: TRL left-pads the prompts (each repeated `num_generations` times) and calls
  `model.generate`; the copies of a prompt share its KV blocks;
* `continuous`: `use_transformers_continuous_batching=True` makes TRL call `model.generate_batch`,
  which hf_paged answers with its engine instead of transformers' manager (the model keeps its
  attention afterwards; each completion comes back with its tokens' logprobs).

The prompts are the capital-city questions of `examples/data/capitals.jsonl`; the reward is 1 when
the completion names the capital (the dataset's `answer` column, which TRL hands the reward
function), minus a small penalty per character.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_paged  # noqa: F401  (the "hf_paged" attention and the generate / generate_batch patches)
from hf_paged.optional import require

DATA = Path(__file__).resolve().parent / "data" / "capitals.jsonl"


def capital_reward(completions, answer, **kwargs) -> list[float]:
    """1 for naming the capital, minus 0.01 per character (shorter correct answers win)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(a.lower() in t.lower()) - 0.01 * len(t) for t, a in zip(texts, answer)]


def prompts_dataset(num_rows: int | None = None):
    datasets = require("datasets", "data")
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()][:num_rows]
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                       for r in rows])


class TimedRollouts:
    """Wraps a trainer's `_generate_single_turn` (TRL's one rollout call per step) to time it and keep
    its prompts (token ids, each repeated `num_generations` times)."""

    def __init__(self, trainer):
        self.seconds: list[float] = []
        self.prompts: list[list[list[int]]] = []
        original = trainer._generate_single_turn

        def timed(*args, **kwargs):
            self.prompts.append([list(p) for p in args[0]])
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - began)

        trainer._generate_single_turn = timed


def run(model, tokenizer, path: str = "default", steps: int = 2, num_generations: int = 4, prompts_per_step: int = 2,
        max_completion_length: int = 16, output_dir: str = "/tmp/hf_paged_grpo", seed: int = 0,
        dataset=None) -> dict:
    """Train `steps` GRPO steps; returns the trainer, the rollout seconds and prompts per step and the
    logged rewards."""
    trl = require("trl", "train")
    args = trl.GRPOConfig(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=num_generations * prompts_per_step,
        num_generations=num_generations, max_completion_length=max_completion_length, learning_rate=1e-5,
        logging_steps=1, save_strategy="no", report_to=[], seed=seed, use_cpu=True, bf16=False,
        dataloader_num_workers=0, disable_tqdm=True, use_transformers_continuous_batching=path == "continuous")
    trainer = trl.GRPOTrainer(model=model, reward_funcs=capital_reward, args=args,
                              train_dataset=dataset if dataset is not None else prompts_dataset(),
                              processing_class=tokenizer)
    timer = TimedRollouts(trainer)
    trainer.train()
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    return dict(trainer=trainer, rollout_seconds=timer.seconds, rollout_prompts=timer.prompts, rewards=rewards)


def main():
    from hf_paged.defaults.models import load_default

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--path", choices=("default", "continuous", "both"), default="both")
    args = parser.parse_args()
    for path in ("default", "continuous") if args.path == "both" else (args.path,):
        torch.manual_seed(0)
        model, tokenizer = load_default(attn_implementation="hf_paged")
        result = run(model, tokenizer, path=path, steps=args.steps)
        metrics = getattr(model, "hf_paged_last_metrics", {})
        print(f"[{path}] {args.steps} GRPO steps: rewards per step {[round(r, 3) for r in result['rewards']]}; "
              f"rollout seconds per step {[round(s, 2) for s in result['rollout_seconds']]}; last rollout on the "
              f"engine: {metrics.get('vllm:request_success', 0)} requests, {metrics.get('vllm:prompt_tokens', 0)} "
              f"prompt tokens computed, {metrics.get('vllm:generation_tokens', 0)} generated; attention after "
              f"training: {model.config._attn_implementation}")
        hf_paged.release(model)


if __name__ == "__main__":
    main()
