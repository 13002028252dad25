"""Fine-tune SmolLM2-135M-Instruct for a few steps, evaluating by generation at every evaluation,
once with `attn_implementation="sdpa"` and once with "hf_paged" (the only change): the training
losses, the evaluation generations and their exact-match scores must be the same, and the
evaluation generations run faster with hf_paged.

    python examples/finetune_eval.py [--steps 6] [--eval-every 3] [--style callback|seq2seq|both]

The data (`examples/data/capitals.jsonl`, 32 question/answer pairs) ships with the repository: the
first 24 rows train, the last 8 evaluate. Two ways to evaluate by generation, both plain
transformers:

* `callback`: `transformers.Trainer` with a `TrainerCallback` that generates greedily for the
  evaluation prompts (chat template, left-padded batch) with `model.generate`;
* `seq2seq`: `Seq2SeqTrainer(predict_with_generate=True)` with a `compute_metrics`, which generates
  inside the evaluation loop (its batch, `labels` included, goes to `model.generate`).

With hf_paged both generate calls run on the model's engine, whose prefix cache is dropped after
every optimizer step by the weight-change detection.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import (GenerationConfig, Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainerCallback,
                          TrainingArguments)

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


class PromptDataset(torch.utils.data.Dataset):
    """For `predict_with_generate`: the prompt alone (chat template) and the reference answer's ids."""

    def __init__(self, rows, tokenizer):
        self.items = []
        for row in rows:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                                   add_generation_prompt=True)
            self.items.append({"prompt_ids": tokenizer(prompt)["input_ids"],
                               "answer_ids": tokenizer(row["answer"])["input_ids"]})
        self.width = max(len(item["prompt_ids"]) for item in self.items)  # every batch is padded to it

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def prompt_collate(pad_id, width):
    """Prompts left-padded to `width` (generation); `labels` carries the reference answer, -100 around it,
    in the prompt's shape, as the loss `Seq2SeqTrainer` also computes needs (its value is not a metric)."""
    def fn(batch):
        ids = torch.full((len(batch), width), pad_id)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        for r, item in enumerate(batch):
            p, a = item["prompt_ids"], item["answer_ids"]
            ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
            labels[r, : len(a)] = torch.tensor(a)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return fn


class ExactMatch:
    """`compute_metrics` for `predict_with_generate`: decodes what follows the prompt width, records it."""

    def __init__(self, tokenizer, width):
        self.tokenizer, self.width = tokenizer, width
        self.generations: list[list[str]] = []

    def __call__(self, prediction):
        pad = self.tokenizer.pad_token_id
        preds = [[t if t >= 0 else pad for t in row[self.width:]] for row in prediction.predictions.tolist()]
        refs = [[t for t in row if t >= 0] for row in prediction.label_ids.tolist()]
        answers = [self.tokenizer.decode(p, skip_special_tokens=True).strip() for p in preds]
        self.generations.append(answers)
        references = [self.tokenizer.decode(r, skip_special_tokens=True).strip() for r in refs]
        return {"exact_match": sum(a == r for a, r in zip(answers, references)) / len(answers)}


class TimedSeq2SeqTrainer(Seq2SeqTrainer):
    """Seq2SeqTrainer that adds up the seconds its evaluation steps take (the generate calls)."""

    generate_seconds = 0.0

    def prediction_step(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return super().prediction_step(*args, **kwargs)
        finally:
            self.generate_seconds += time.perf_counter() - began


def run(attn_implementation: str, steps: int, eval_every: int, output_dir: str, seed: int = 0,
        style: str = "callback") -> dict:
    """Train `steps` steps, evaluating every `eval_every` in the given `style` ("callback" or
    "seq2seq"); returns the losses, generations, scores and the seconds spent generating."""
    torch.manual_seed(seed)
    model, tokenizer = load_default(attn_implementation=attn_implementation)
    train_rows, eval_rows = load_rows()
    common = dict(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4, per_device_eval_batch_size=8,
                  learning_rate=5e-5, eval_strategy="steps", eval_steps=eval_every, logging_steps=1,
                  save_strategy="no", report_to=[], seed=seed, data_seed=seed, use_cpu=True,
                  dataloader_num_workers=0, disable_tqdm=True)
    train_set = ChatDataset(train_rows, tokenizer)
    if style == "callback":
        callback = GenerateOnEvaluate(eval_rows, tokenizer)
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=train_set,
                          eval_dataset=ChatDataset(eval_rows, tokenizer), data_collator=collate(tokenizer.pad_token_id),
                          callbacks=[callback])
        trainer.train()
        generations, scores, seconds = callback.generations, callback.scores, callback.seconds
    elif style == "seq2seq":
        eval_set = PromptDataset(eval_rows, tokenizer)
        metric = ExactMatch(tokenizer, eval_set.width)
        generation = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                      eos_token_id=model.generation_config.eos_token_id)
        args = Seq2SeqTrainingArguments(**common, predict_with_generate=True, generation_config=generation,
                                        remove_unused_columns=False)
        pad = tokenizer.pad_token_id
        training, evaluating = collate(pad), prompt_collate(pad, eval_set.width)
        trainer = TimedSeq2SeqTrainer(  # training items are tuples, evaluation items dicts
            model=model, args=args, train_dataset=train_set, eval_dataset=eval_set, compute_metrics=metric,
            data_collator=lambda batch: evaluating(batch) if isinstance(batch[0], dict) else training(batch))
        trainer.train()
        generations, seconds = metric.generations, trainer.generate_seconds
        scores = [e["eval_exact_match"] for e in trainer.state.log_history if "eval_exact_match" in e]
    else:
        raise ValueError(f"style must be 'callback' or 'seq2seq', not {style!r}")
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    eval_losses = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    hf_paged.release(model)
    return dict(losses=losses, eval_losses=eval_losses, generations=generations, scores=scores, seconds=seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--output-dir", default="/tmp/hf_paged_finetune_eval")
    parser.add_argument("--style", choices=("callback", "seq2seq", "both"), default="both")
    args = parser.parse_args()
    for style in ("callback", "seq2seq") if args.style == "both" else (args.style,):
        stock = run("sdpa", args.steps, args.eval_every, args.output_dir, style=style)
        ours = run("hf_paged", args.steps, args.eval_every, args.output_dir, style=style)
        for name, r in (("sdpa", stock), ("hf_paged", ours)):
            print(f"[{style}] {name:>8}: losses {[round(x, 4) for x in r['losses']]}, exact match per evaluation "
                  f"{r['scores']}, generating {r['seconds']:.2f} s")
        same_losses = max(abs(a - b) for a, b in zip(stock["losses"] + stock["eval_losses"],
                                                     ours["losses"] + ours["eval_losses"]))
        print(f"[{style}] generations identical: {stock['generations'] == ours['generations']}; scores identical: "
              f"{stock['scores'] == ours['scores']}; largest loss difference {same_losses:.2e}; evaluation by "
              f"generation {ours['seconds'] / stock['seconds']:.3f}x the sdpa time")


if __name__ == "__main__":
    main()
