"""Speculative decoding on SmolLM2-135M-Instruct (fp32): hf_paged's engine with prompt lookup and with a
layer-skip draft, against plain hf_paged decoding and, at batch 1, stock transformers' assisted
generation (prompt lookup and the same draft) and stock greedy generate. Greedy, so every method
must produce the same tokens (checked and printed).

Workloads:
  * lookup: "repeat / lightly edit this text or code" prompts, whose answers copy from the prompt
    (where prompt lookup shines);
  * chat: free-form questions (where it finds little to copy).

For each (workload, batch size, method) it prints wall seconds, output tokens/s, the speed-up over
plain hf_paged decoding, target forwards, tokens per target forward, and for speculative methods
the per-token acceptance alpha, the closed-form prediction (1 - alpha^(k+1)) / (1 - alpha) of tokens
per verification and the measured value.

    python benchmarks/speculative.py [--k 5] [--new-tokens 96] [--draft-layers 8] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import transformers

import hf_paged  # noqa: F401  (registers "hf_paged")
from hf_paged import Engine, SamplingParams
from hf_paged.defaults.models import load_default
from hf_paged.defaults.prompts import CHAT_PROMPTS, PASSAGE
from hf_paged.spec_decode import layer_skip_draft

CODE = '''def moving_average(values, window):
    """Return the moving averages of values over the given window size."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''

LOOKUP_TASKS = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE[:700]}",
    f"Rewrite this function with the parameter `values` renamed to `xs`. Output only the code.\n\n{CODE}",
    f"Copy this paragraph, changing 'lighthouse' to 'tower' everywhere:\n\n{PASSAGE[700:1400]}",
    f"Add type hints to this function and output the whole function.\n\n{CODE}",
]


def chat_ids(tokenizer, texts):
    out = []
    for text in texts:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        out.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return out


class ForwardCounter:
    """Counts forwards of a model (its decoder's calls), for stock methods' tokens per forward."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, *args):
        self.count += 1

    def close(self):
        self.handle.remove()


def run_engine(model, prompts, batch, new_tokens, **spec):
    engine = Engine(model, max_num_seqs=batch, max_num_batched_tokens=4096, show_progress=False, **spec)
    engine.generate([prompts[0][:8]], SamplingParams(max_new_tokens=2))  # warm-up
    engine.reset_metrics()
    # min_new_tokens = max_new_tokens masks EOS for every token, exactly like stock min_new_tokens.
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outputs += [o.token_ids for o in engine.generate(prompts[i:i + batch], params)]
    wall = time.perf_counter() - start
    m = engine.metrics()
    return dict(wall=wall, outputs=outputs, forwards=m["num_steps"], alpha=m.get("alpha"),
                measured=m.get("tokens_per_target_forward"), predicted=m.get("predicted_tokens_per_target_forward"),
                k=m.get("mean_num_speculative_tokens"))


def run_stock(model, prompts, new_tokens, **assist):
    """Stock generate at batch 1 (assisted generation only supports batch 1)."""
    model.set_attn_implementation("sdpa")
    counter = ForwardCounter(model)
    try:
        ids = torch.tensor([prompts[0][:8]])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, **assist)
        counter.count = 0
        outputs, start = [], time.perf_counter()
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, **assist)
            outputs.append(out[0, len(p):].tolist())
        wall = time.perf_counter() - start
    finally:
        counter.close()
        model.set_attn_implementation("hf_paged")
    return dict(wall=wall, outputs=outputs, forwards=counter.count)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--draft-layers", type=int, default=8, help="layers of the layer-skip draft (of 30)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-stock", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"env: torch={torch.__version__} transformers={transformers.__version__} python={platform.python_version()} "
          f"threads={torch.get_num_threads()} cpus={os.cpu_count()} k={args.k} new_tokens={args.new_tokens} "
          f"draft=first {args.draft_layers} of 30 layers (layer-skip)")
    model, tokenizer = load_default(dtype=torch.float32, attn_implementation="hf_paged")
    draft = layer_skip_draft(model, args.draft_layers)
    workloads = {
        "lookup": chat_ids(tokenizer, LOOKUP_TASKS * 4),
        "chat": chat_ids(tokenizer, (CHAT_PROMPTS * 2)[:16]),
    }
    summary, walls = {}, {}
    header = (f"{'workload':8} {'batch':>5} {'method':22} {'wall s':>8} {'tok/s':>8} {'vs plain':>8} {'fwds':>6} "
              f"{'tok/fwd':>8} {'alpha':>6} {'pred':>6} {'meas':>6} {'same':>5}")
    print(header)
    for wname, prompts in workloads.items():
        for batch in [int(b) for b in args.batches.split(",")]:
            ps = prompts[:4] if batch == 1 else prompts[:16]
            total = len(ps) * args.new_tokens
            results = {"hf_paged plain": run_engine(model, ps, batch, args.new_tokens)}
            results["hf_paged ngram"] = run_engine(model, ps, batch, args.new_tokens, speculative_method="ngram",
                                                   num_speculative_tokens=args.k)
            results["hf_paged layer-skip"] = run_engine(model, ps, batch, args.new_tokens, draft_model=draft,
                                                        num_speculative_tokens=args.k)
            if batch == 1 and not args.skip_stock:
                results["stock greedy"] = run_stock(model, ps, args.new_tokens)
                results["stock prompt lookup"] = run_stock(model, ps, args.new_tokens,
                                                           prompt_lookup_num_tokens=args.k)
                results["stock assisted"] = run_stock(model, ps, args.new_tokens, assistant_model=draft,
                                                      num_assistant_tokens=args.k,
                                                      num_assistant_tokens_schedule="constant")
            plain = results["hf_paged plain"]
            for name, r in results.items():
                tps = total / r["wall"]
                speedup = plain["wall"] / r["wall"]
                same = r["outputs"] == plain["outputs"]
                fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
                print(f"{wname:8} {batch:>5} {name:22} {r['wall']:8.2f} {tps:8.1f} {speedup:7.2f}x {r['forwards']:6d} "
                      f"{total / r['forwards']:8.2f} {fmt(r.get('alpha')):>6} {fmt(r.get('predicted')):>6} "
                      f"{fmt(r.get('measured')):>6} {str(same):>5}")
                summary[(wname, batch, name)] = (speedup, r.get("predicted"), r.get("measured"))
                walls[(wname, batch, name)] = r["wall"]
    print()
    gaps = [abs(m - p) / p for (_, _, _), (_, p, m) in summary.items() if p and m]
    if gaps:
        print(f"closed form vs measured tokens per verification: worst relative gap {100 * max(gaps):.1f}%, "
              f"median {100 * statistics.median(gaps):.1f}% (target: within 10%)")
    for wname in workloads:  # hf_paged against stock's own methods, same prompts, same run (batch 1)
        for ours, theirs in (("hf_paged plain", "stock greedy"), ("hf_paged ngram", "stock prompt lookup"),
                             ("hf_paged layer-skip", "stock assisted")):
            a, b = walls.get((wname, 1, ours)), walls.get((wname, 1, theirs))
            if a and b:
                verdict = f" (target <= 1.0: {'PASS' if a <= b else 'MISS'})" if ours == "hf_paged ngram" else ""
                print(f"{wname} batch 1: {ours} {a:.2f} s vs {theirs} {b:.2f} s = {a / b:.3f}x stock's time{verdict}")
    key = ("lookup", 1, "hf_paged ngram")
    if key in summary:
        s = summary[key][0]
        print(f"prompt lookup at batch 1 on the lookup workload: {s:.2f}x plain hf_paged decoding "
              f"(target >= 1.5x: {'PASS' if s >= 1.5 else 'MISS'})")


if __name__ == "__main__":
    main()
