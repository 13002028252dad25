"""Fine-tune SmolLM2-135M-Instruct for a few steps with `transformers.Trainer`, evaluating by
generation at every evaluation, once with `attn_implementation="sdpa"` and once with "hf_paged" (the
only change): the training losses, the evaluation generations and their exact-match scores must be
the same, and the evaluation generations run faster with hf_paged.

    python examples/finetune_eval.py [--steps 6] [--eval-every 3]

The data (`examples/data/capitals.jsonl`, 32 question/answer pairs) ships with the repository: the
first 24 rows train, the last 8 evaluate. The evaluation is a `TrainerCallback` that generates
greedily for the evaluation prompts (chat template, left-padded batch) with plain `model.generate`;
with hf_paged that call runs on the model's engine, whose prefix cache is dropped after every
optimizer step by the weight-change detection.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import hf_paged  # noqa: F401  (the "hf_paged" attention and the generate patch)
from hf_paged.defaults.models import load_default

DATA = Path(__file__).resolve().parent / "data" / "capitals.jsonl"


def load_rows():
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return rows[:24], rows[24:]


class ChatDataset(torch.utils.data.Dataset):
    """Prompt + answer in the chat template; the loss is on the answer tokens only."""

    def __init__(self, rows, tokenizer):
        self.items = []
        for row in rows:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                                   add_generation_prompt=True)
            prompt_ids = tokenizer(prompt)["input_ids"]
            answer_ids = tokenizer(row["answer"] + "<|im_end|>")["input_ids"]
            self.items.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(pad_id):
    def fn(batch):
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, (i, l) in enumerate(batch):  # right-padded for training, as usual
            ids[r, : len(i)], labels[r, : len(l)], mask[r, : len(i)] = torch.tensor(i), torch.tensor(l), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return fn


class GenerateOnEvaluate(TrainerCallback):
    """Greedy generations for the evaluation prompts at every evaluation, and their exact-match score."""

    def __init__(self, rows, tokenizer, max_new_tokens=8):
        self.rows, self.tokenizer, self.max_new_tokens = rows, tokenizer, max_new_tokens
        self.generations: list[list[str]] = []
        self.scores: list[float] = []
        self.seconds = 0.0

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                                    add_generation_prompt=True) for r in self.rows]
        inputs = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
        was_training = model.training
        model.eval()
        began = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        self.seconds += time.perf_counter() - began
        model.train(was_training)
        answers = [self.tokenizer.decode(o[inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
                   for o in out]
        self.generations.append(answers)
        self.scores.append(sum(a == r["answer"] for a, r in zip(answers, self.rows)) / len(self.rows))


def run(attn_implementation: str, steps: int, eval_every: int, output_dir: str, seed: int = 0) -> dict:
    """Train `steps` steps, evaluating every `eval_every`; returns the losses, generations, scores and
    the seconds spent generating."""
    torch.manual_seed(seed)
    model, tokenizer = load_default(attn_implementation=attn_implementation)
    train_rows, eval_rows = load_rows()
    callback = GenerateOnEvaluate(eval_rows, tokenizer)
    args = TrainingArguments(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=5e-5, eval_strategy="steps", eval_steps=eval_every, logging_steps=1,
                             save_strategy="no", report_to=[], seed=seed, data_seed=seed, use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=ChatDataset(train_rows, tokenizer),
                      eval_dataset=ChatDataset(eval_rows, tokenizer), data_collator=collate(tokenizer.pad_token_id),
                      callbacks=[callback])
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    eval_losses = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    hf_paged.release(model)
    return dict(losses=losses, eval_losses=eval_losses, generations=callback.generations, scores=callback.scores,
                seconds=callback.seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--output-dir", default="/tmp/hf_paged_finetune_eval")
    args = parser.parse_args()
    stock = run("sdpa", args.steps, args.eval_every, args.output_dir)
    ours = run("hf_paged", args.steps, args.eval_every, args.output_dir)
    for name, r in (("sdpa", stock), ("hf_paged", ours)):
        print(f"{name:>8}: losses {[round(x, 4) for x in r['losses']]}, exact match per evaluation {r['scores']}, "
              f"generating {r['seconds']:.2f} s")
    same_losses = max(abs(a - b) for a, b in zip(stock["losses"] + stock["eval_losses"],
                                                 ours["losses"] + ours["eval_losses"]))
    print(f"generations identical: {stock['generations'] == ours['generations']}; scores identical: "
          f"{stock['scores'] == ours['scores']}; largest loss difference {same_losses:.2e}; evaluation by generation "
          f"{ours['seconds'] / stock['seconds']:.3f}x the sdpa time")


if __name__ == "__main__":
    main()
