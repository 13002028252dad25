"""lm-evaluation-harness on a local task, SmolLM2-135M-Instruct with `attn_implementation="sdpa"`
and with "hf_paged" (the only change): the scores must be equal, and the wall time is printed with
its ratio.

    python examples/lm_eval_capitals.py [--batch-size 8]

The task is written next to its data under a temporary folder (nothing is downloaded): the capital
questions of `examples/data/capitals.jsonl` as a `generate_until` task (exact match, stopping at a
newline or a full stop) and as a 4-way `multiple_choice` task (loglikelihood: acc, acc_norm). From
the shell, `hf-paged lm-eval --model hf --model_args pretrained=DIR,attn_implementation=hf_paged
--include_path DIR --tasks hfp_capitals_gen,hfp_capitals_mc` runs the same (see
`hf_paged.integrations.lm_eval_cli` for why the plain `lm_eval` command cannot).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import hf_paged  # noqa: F401  (registers "hf_paged" before lm-eval loads the model)
from hf_paged.optional import require

DATA = Path(__file__).resolve().parent / "data" / "capitals.jsonl"
TASKS = ["hfp_capitals_gen", "hfp_capitals_mc"]
GEN_TASK = """task: hfp_capitals_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""
MC_TASK = """task: hfp_capitals_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""




def write_tasks(root: Path) -> Path:
    """The capitals data as an lm-eval dataset (four choices per question, the right one at every
    position in turn) and the two task configs, in `root`."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    answers = [r["answer"] for r in rows]
    docs = []
    for i, r in enumerate(rows):
        choices = [answers[(i + k) % len(answers)] for k in (0, 5, 11, 17)]
        shift = i % 4
        choices = choices[-shift:] + choices[:-shift] if shift else choices
        docs.append({"prompt": r["prompt"], "answer": r["answer"], "choices": choices,
                     "label": choices.index(r["answer"])})
    root.mkdir(parents=True, exist_ok=True)
    data = root / "capitals.json"
    data.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    (root / "gen.yaml").write_text(GEN_TASK.format(data=data))
    (root / "mc.yaml").write_text(MC_TASK.format(data=data))
    return root


def evaluate(checkpoint, task_dir, attn: str, batch_size: int = 8, limit: int | None = None) -> dict:
    """`lm_eval.simple_evaluate` with the `hf` backend, every sample logged (the first `limit` documents of
    each task, or all); adds "seconds"."""
    lm_eval = require("lm_eval", "eval")
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    began = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={checkpoint},attn_implementation={attn},dtype=float32", tasks=TASKS,
        task_manager=TaskManager(include_path=str(task_dir)), batch_size=batch_size, device="cpu",
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, limit=limit)
    results["seconds"] = time.perf_counter() - began
    return results


def scores(results) -> dict:
    return {task: {k: v for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k}
            for task, metrics in results["results"].items()}


def main():
    from hf_paged.defaults.models import ensure_default_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    checkpoint = ensure_default_checkpoint()
    with tempfile.TemporaryDirectory() as tmp:
        task_dir = write_tasks(Path(tmp))
        stock = evaluate(checkpoint, task_dir, "sdpa", args.batch_size)
        ours = evaluate(checkpoint, task_dir, "hf_paged", args.batch_size)
    for name, r in (("sdpa", stock), ("hf_paged", ours)):
        print(f"{name:>8}: {scores(r)}; {r['seconds']:.2f} s")
    print(f"scores identical: {scores(stock) == scores(ours)}; wall time {ours['seconds'] / stock['seconds']:.3f}x "
          f"the sdpa run (batch size {args.batch_size}, both tasks, model loading included)")


if __name__ == "__main__":
    main()
