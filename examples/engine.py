"""Continuous batching with `hf_paged.Engine` on the embedded default model (SmolLM2-135M-Instruct).

    python examples/engine.py

Runs the chat prompts as one batch of requests (greedy), streams one sampled answer token by token,
and prints the engine's metrics.
"""

import torch

from hf_paged import Engine, SamplingParams
from hf_paged.defaults.models import load_default
from hf_paged.defaults.prompts import CHAT_PROMPTS


def main():
    model, tokenizer = load_default(dtype=torch.float32, attn_implementation="hf_paged")
    engine = Engine(model, tokenizer, max_num_seqs=16, max_num_batched_tokens=1024)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in CHAT_PROMPTS]
    for prompt, out in zip(CHAT_PROMPTS, engine.generate(prompts, SamplingParams(max_new_tokens=48))):
        print(f"> {prompt[:60]}\n  {out.text.strip()[:160]!r} ({out.finish_reason}, "
              f"TTFT {1e3 * out.metrics.time_to_first_token:.0f} ms)")
    print("\nstreamed, temperature 0.7, seed 0:")
    for event in engine.stream(prompts[2], SamplingParams(max_new_tokens=40, temperature=0.7, seed=0)):
        print(event.text, end="", flush=True)
    print("\n\n" + engine.metrics_summary())


if __name__ == "__main__":
    main()
