"""Vision-language throughput: 64 image+text requests on a small random-weight LLaVA, stock `generate` in
static batches beside hf_paged's engine, in one run, with the ratio.

The model: a CLIP vision tower (4 layers, width 256, 112x112 images in 14-pixel patches: 64 image
tokens) and a Llama decoder (8 layers, width 512, 8 heads, 4 KV heads, vocabulary 8192), fp32, random
weights (no download). The workload (seeded): 64 requests, each a 24-token system prompt shared by
all, one of 16 images (each used by 4 requests, as a dataset of questions about the same pictures),
and a question of 8-48 tokens; output lengths uniform in 16-128, exactly n per request
(min_new_tokens = max_new_tokens = n, so EOS cannot stop a request early).

Methods (alternated, `--repeats` times each; medians reported):
  * static_bsB: stock `model.generate` (sdpa, DynamicCache) over consecutive batches of `--static-bs`
    requests in arrival order, left-padded, with their images; a batch runs for its longest output,
    and only each request's own n tokens count as useful.
  * hf_paged: `hf_paged.Engine.generate` of all 64 (continuous batching; each distinct image encoded
    once, image blocks shared through the prefix cache).

Prints seconds, useful output tokens/s, the ratio, the engine's image figures (encoder runs, image
placeholder tokens served by the prefix cache) and the greedy agreement of the engine with stock
(each request's n tokens against its row of the static batch: identical with min_new_tokens), with
stock's top-2 logit margin where a request parts (random weights and a 8192-token vocabulary make
near-ties, which fp32 noise of different batch shapes flips).

    python benchmarks/vlm.py [--num-requests 64] [--static-bs 8] [--repeats 3] [--threads N]
    python benchmarks/vlm.py --num-requests 8 --repeats 1     # smoke
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import hf_paged  # noqa: F401 - registers attn_implementation="hf_paged"
from hf_paged import Engine, SamplingParams

VOCAB = 8192
IMAGE_TOKEN = VOCAB - 1
IMAGE_SIZE, PATCH = 112, 14
PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2  # placeholders per image ("default" strategy drops the CLS token)


def build_model(attn: str):
    from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig

    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                       num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH,
                                       projection_dim=256),
        text_config=LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
        image_token_id=IMAGE_TOKEN, vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, attn_implementation=attn).eval()


def workload(num_requests: int, num_images: int, seed: int = 0):
    """[(prompt ids, image index, n)] and the images [num_images, 3, H, W]."""
    rng = random.Random(seed)
    system = [1] + [rng.randrange(3, VOCAB - 1) for _ in range(23)]
    images = torch.randn(num_images, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))
    order = [i % num_images for i in range(num_requests)]
    rng.shuffle(order)
    requests = []
    for image in order:
        question = [rng.randrange(3, VOCAB - 1) for _ in range(rng.randint(8, 48))]
        requests.append((system + [IMAGE_TOKEN] * PER_IMAGE + question, image, rng.randint(16, 128)))
    return requests, images


def run_static(model, requests, images, batch_size: int) -> tuple[float, list[list[int]]]:
    """Stock generate over consecutive left-padded batches; each request's first n tokens."""
    outs = []
    began = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        width = max(len(ids) for ids, _, _ in batch)
        steps = max(n for _, _, n in batch)
        ids = torch.tensor([[0] * (width - len(r)) + r for r, _, _ in batch])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r, _, _ in batch])
        pixels = images[[i for _, i, _ in batch]]
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, max_new_tokens=steps,
                                 min_new_tokens=steps, do_sample=False, pad_token_id=0)
        outs += [out[k, width:width + n].tolist() for k, (_, _, n) in enumerate(batch)]
    return time.perf_counter() - began, outs


def run_engine(model, requests, images) -> tuple[float, list[list[int]], dict]:
    engine = Engine(model, max_num_seqs=len(requests))
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"pixel_values": images[i:i + 1]}}
               for ids, i, _ in requests]
    params = [SamplingParams(max_new_tokens=n, min_new_tokens=n) for _, _, n in requests]
    began = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - began
    engine.shutdown()
    return seconds, [o.outputs[0].token_ids for o in outputs], engine.metrics()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-images", type=int, default=16)
    parser.add_argument("--static-bs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    requests, images = workload(args.num_requests, min(args.num_images, args.num_requests))
    useful = sum(n for _, _, n in requests)
    stock, ours = build_model("sdpa"), build_model("hf_paged")
    print(f"{len(requests)} requests, {images.shape[0]} distinct images ({PER_IMAGE} tokens each), prompts "
          f"{min(len(r) for r, _, _ in requests)}-{max(len(r) for r, _, _ in requests)} tokens, "
          f"{useful} output tokens; torch threads {torch.get_num_threads()}")
    times = {"static": [], "hf_paged": []}
    agree, metrics = None, {}
    for rep in range(args.repeats):  # alternated: the machine's noise falls on both
        seconds, static_out = run_static(stock, requests, images, args.static_bs)
        times["static"].append(seconds)
        seconds, engine_out, metrics = run_engine(ours, requests, images)
        times["hf_paged"].append(seconds)
        agree = sum(a == b for a, b in zip(static_out, engine_out))
        print(f"  repeat {rep + 1}: static_bs{args.static_bs} {times['static'][-1]:.2f} s, "
              f"hf_paged {times['hf_paged'][-1]:.2f} s")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'method':<14}{'median s':>10}{'tok/s':>10}")
    for name, key in ((f"static_bs{args.static_bs}", "static"), ("hf_paged", "hf_paged")):
        print(f"{name:<14}{med[key]:>10.2f}{useful / med[key]:>10.1f}")
    print(f"\nhf_paged / static_bs{args.static_bs}: {med['static'] / med['hf_paged']:.2f}x output tokens/s")
    print(f"image encoder runs {metrics.get('mm_encoder_runs')} for {metrics.get('vllm:mm_cache_queries')} images; "
          f"image tokens from the prefix cache {metrics.get('mm_prefix_cache_hits')}; "
          f"prefix-cache hit rate {100 * metrics.get('prefix_cache_hit_rate', 0):.1f}%")
    print(f"greedy agreement with stock: {agree}/{len(requests)} requests token for token")
    for k, (a, b) in enumerate(zip(static_out, engine_out)):
        if a != b:  # where they part: stock's own top-2 logit margin there (a near-tie flips on fp32 noise)
            ids, image, _ = requests[k]
            step = next(j for j in range(min(len(a), len(b))) if a[j] != b[j])
            with torch.inference_mode():
                logits = stock(input_ids=torch.tensor([ids + a[:step]]), pixel_values=images[image:image + 1]).logits
            top = logits[0, -1].topk(2).values
            print(f"  request {k} parts at token {step}: stock's top-2 logits {top[0]:.7f} / {top[1]:.7f} "
                  f"(margin {float(top[0] - top[1]):.1e})")


if __name__ == "__main__":
    main()
