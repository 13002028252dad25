"""The drop-in `model.generate` paths on the default model (SmolLM2-135M-Instruct), stock beside
hf_paged in the same run, with ratios.

1. Engine reuse: 20 successive `generate` calls of 8 chat prompts that share a ~300-token system
   prompt (greedy, 16 new tokens). Stock sdpa + DynamicCache; hf_paged with its one engine per model
   (first call and the median later call, prefix-cache hits per call); hf_paged with a new engine
   per call (`hf_paged.release(model)` before each call: what every call cost before).
2. A `TextIteratorStreamer` consumed in a thread, batch 1 (64 new tokens).
3. `stop_strings` on a batch of 8 (stock's criteria called step by step on the engine's rows).
4. A returned cache: a three-turn conversation of 8 chats, each turn continuing from the previous
   turn's returned cache (`return_dict_in_generate=True`). Stock continues from its DynamicCache;
   hf_paged from its `ReturnedCache` (each row's K/V kept in the engine), and, for comparison,
   hf_paged re-sent the whole conversation without a cache (only the prefix cache's full blocks
   reused). Tokens fed to the model per turn are counted.
5. `pipeline("text-generation")` over 256 chats of mixed lengths at `batch_size` 8 and 64: the
   sdpa pipeline, the hf_paged pipeline (batches queued in the engine ahead of their turn), and
   `Engine.generate` on the same token ids with the same concurrency.

Every hf_paged output is checked token for token (or record for record) against stock's.

    python benchmarks/dropin.py [--calls 20] [--threads N] [--only reuse,streamer,stop,cache,pipeline]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import torch
from transformers import TextIteratorStreamer

import hf_paged
from hf_paged.defaults.models import load_default
from hf_paged.defaults.prompts import CHAT_PROMPTS, PASSAGE

SYSTEM = "You are a careful assistant. Use the notes below when they help.\n\n" + PASSAGE[:1100]


def _batch(tokenizer, call: int, lead: str = ""):
    prompts = CHAT_PROMPTS[call % 3:] + CHAT_PROMPTS[: call % 3]
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": lead + p}],
                                           tokenize=False, add_generation_prompt=True) for p in prompts]
    return tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def reuse(model, tokenizer, calls: int) -> None:
    gen = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    batches = [_batch(tokenizer, c) for c in range(calls)]
    system_tokens = len(tokenizer(tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                                                tokenize=False))["input_ids"])
    print(f"== {calls} generate calls of 8 prompts sharing a {system_tokens}-token system prompt, 16 new tokens ==")
    model.set_attn_implementation("sdpa")
    stock, stock_times = [], []
    for b in batches:
        out, t = _timed(lambda: model.generate(**b, **gen))
        stock.append(out)
        stock_times.append(t)
    model.set_attn_implementation("hf_paged")
    hf_paged.release(model)
    kept_times, hits, same = [], [], True
    for b, ref in zip(batches, stock):
        out, t = _timed(lambda: model.generate(**b, **gen))
        kept_times.append(t)
        hits.append(model.hf_paged_last_metrics["vllm:prefix_cache_hits"])
        same &= torch.equal(out, ref)
    fresh_times = []
    for b, ref in zip(batches, stock):
        hf_paged.release(model)
        out, t = _timed(lambda: model.generate(**b, **gen))
        fresh_times.append(t)
        same &= torch.equal(out, ref)
    hf_paged.release(model)
    model.set_attn_implementation("sdpa")
    total = sum(stock_times)
    print(f"{'':34}{'total s':>9}{'first s':>9}{'later median s':>16}{'total vs stock':>16}")
    for label, times in (("stock sdpa + DynamicCache", stock_times), ("hf_paged, one engine per model", kept_times),
                         ("hf_paged, a new engine per call", fresh_times)):
        print(f"{label:34}{sum(times):>9.2f}{times[0]:>9.2f}{statistics.median(times[1:]):>16.3f}"
              f"{sum(times) / total:>15.3f}x")
    print(f"prefix-cache hits per call (one engine): first {hits[0]}, later median {statistics.median(hits[1:])}; "
          f"identical to stock: {same}")


def streamer(model, tokenizer) -> None:
    chat = [{"role": "user", "content": CHAT_PROMPTS[6]}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)

    def run():
        s = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        worker = threading.Thread(target=model.generate, kwargs=dict(**inputs, max_new_tokens=64, min_new_tokens=64,
                                                                     do_sample=False, streamer=s))
        worker.start()
        text = "".join(s)
        worker.join()
        return text

    model.set_attn_implementation("sdpa")
    ref, t_stock = _timed(run)
    model.set_attn_implementation("hf_paged")
    run()  # the engine is built once per model: time the call a chat UI makes every turn
    out, t_ours = _timed(run)
    model.set_attn_implementation("sdpa")
    print(f"\n== TextIteratorStreamer, batch 1, 64 new tokens ==\nstock {t_stock:.2f} s, hf_paged {t_ours:.2f} s "
          f"({t_ours / t_stock:.3f}x); same text: {out == ref}")


def stop_strings(model, tokenizer) -> None:
    inputs = _batch(tokenizer, 0)
    gen = dict(max_new_tokens=48, do_sample=False, stop_strings=["\n", "."], tokenizer=tokenizer)
    model.set_attn_implementation("sdpa")
    ref, t_stock = _timed(lambda: model.generate(**inputs, **gen))
    model.set_attn_implementation("hf_paged")
    model.generate(**inputs, **gen)
    out, t_ours = _timed(lambda: model.generate(**inputs, **gen))
    model.set_attn_implementation("sdpa")
    print(f"\n== stop_strings ['\\n', '.'], batch 8, up to 48 new tokens ==\nstock {t_stock:.2f} s, hf_paged "
          f"{t_ours:.2f} s ({t_ours / t_stock:.3f}x); identical: {torch.equal(out, ref)}")


def returned_cache(model, tokenizer, turns: int = 3, new_tokens: int = 32) -> None:
    follow_ups = ["Say more about that.", "Now answer in one short sentence.", "Thank you! Anything else?"]

    def conversation(with_cache: bool, lead: str = ""):
        """Each turn: the previous turn's whole sequences, then the next user message (as the chat
        template renders it, its default system prompt included), continuing from the returned cache
        when `with_cache`."""
        gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
        inputs = _batch(tokenizer, 0, lead)
        ids, mask, cache = inputs["input_ids"], inputs["attention_mask"], None
        outs, fed, seconds = [], [], []
        for turn in range(turns):
            if turn:
                user = tokenizer.apply_chat_template([{"role": "user", "content": follow_ups[turn - 1]}], tokenize=False,
                                                     add_generation_prompt=True)
                user_ids = tokenizer([user] * ids.shape[0], return_tensors="pt")["input_ids"]
                ids = torch.cat([outs[-1].sequences, user_ids], dim=1)
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], ids.shape[1] - mask.shape[1])], dim=1)
            kwargs = {"cache": cache} if with_cache and cache is not None else {}
            out, t = _timed(lambda: model.generate(ids, attention_mask=mask, **gen, **kwargs))
            outs.append(out)
            seconds.append(t)
            cache = out.cache
            fed.append(getattr(model, "hf_paged_last_metrics", {}).get("num_forward_tokens"))
        return outs, fed, seconds

    model.set_attn_implementation("sdpa")
    conversation(True, lead="Briefly: ")  # warm, as for hf_paged below (the first forwards of a process are slow)
    ref, _, t_stock = conversation(True)
    model.set_attn_implementation("hf_paged")
    hf_paged.release(model)
    # Warm: the engine exists and holds the shared system prompt, as in a running chat service (other
    # chats, so that nothing of the timed conversation is in the prefix cache before it is computed).
    conversation(True, lead="Briefly: ")
    ours, fed, t_ours = conversation(True)
    hf_paged.release(model)
    conversation(False, lead="Briefly: ")
    again, fed_again, t_again = conversation(False)
    model.set_attn_implementation("sdpa")
    same = all(torch.equal(a.sequences, b.sequences) for a, b in zip(ref, ours))
    same_again = all(torch.equal(a.sequences, b.sequences) for a, b in zip(ref, again))
    print(f"\n== a {turns}-turn conversation of 8 chats, {new_tokens} new tokens a turn, continuing from the returned "
          "cache ==")
    print(f"{'turn':>4} {'columns':>8} {'stock s':>8} {'hf_paged s':>10} {'ratio':>6} {'fed':>6} "
          f"{'no cache s':>10} {'ratio':>6} {'fed':>6}")
    for t in range(turns):
        print(f"{t + 1:>4} {ref[t].sequences.shape[1]:>8} {t_stock[t]:>8.2f} {t_ours[t]:>10.2f} "
              f"{t_ours[t] / t_stock[t]:>6.3f} {fed[t]:>6} {t_again[t]:>10.2f} {t_again[t] / t_stock[t]:>6.3f} "
              f"{fed_again[t]:>6}")
    print(f"total: stock {sum(t_stock):.2f} s, hf_paged {sum(t_ours):.2f} s ({sum(t_ours) / sum(t_stock):.3f}x), "
          f"hf_paged without the cache {sum(t_again):.2f} s ({sum(t_again) / sum(t_stock):.3f}x); "
          f"identical to stock: {same} / {same_again}")


def pipelines(model, tokenizer, num_prompts: int = 256, new_tokens: int = 32) -> None:
    from transformers import pipeline

    from hf_paged import Engine, SamplingParams
    from hf_paged.integrations.pipeline import IN_FLIGHT_ROWS

    rng = random.Random(0)
    chats = []
    for i in range(num_prompts):  # 20-400 tokens: a question, after a slice of the passage of random length
        start, length = rng.randrange(0, 200), rng.choice([0, 40, 120, 300, 700, 1200])
        context = PASSAGE[start:start + length]
        question = CHAT_PROMPTS[i % len(CHAT_PROMPTS)]
        chats.append([{"role": "user", "content": f"{context}\n\n{question}" if context else question}])
    token_ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"]
                 for c in chats]
    lengths = sorted(len(t) for t in token_ids)
    print(f"\n== pipeline('text-generation') over {num_prompts} chats of {lengths[0]}-{lengths[-1]} tokens "
          f"(median {lengths[len(lengths) // 2]}), greedy, {new_tokens} new tokens ==")
    gen = dict(max_new_tokens=new_tokens, do_sample=False, return_full_text=False)
    print(f"{'batch':>5} {'sdpa pipe s':>11} {'hf_paged pipe s':>15} {'ratio':>6} {'Engine.generate s':>17} "
          f"{'pipe/engine':>11} {'same':>5}")
    for batch_size in (8, 64):
        model.set_attn_implementation("sdpa")
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
        ref, t_sdpa = _timed(lambda: pipe(chats, batch_size=batch_size, **gen))
        model.set_attn_implementation("hf_paged")
        hf_paged.release(model)  # a new engine each time: no prompt of this run is in its prefix cache yet
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
        ours, t_ours = _timed(lambda: pipe(chats, batch_size=batch_size, **gen))
        piped = model.hf_paged_last_metrics
        # A new engine with the pipeline's concurrency and the pool the pipeline's engine grew to.
        window = max(IN_FLIGHT_ROWS, 2 * batch_size)
        engine = Engine(model, tokenizer, max_num_seqs=window, num_blocks=piped["kv_num_blocks"])
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        outputs, t_engine = _timed(lambda: engine.generate(token_ids, params))
        direct = engine.metrics()
        del engine
        texts = [[{"generated_text": tokenizer.decode(o.token_ids, skip_special_tokens=True)}] for o in outputs]
        same = ours == ref and [[{"generated_text": r[0]["generated_text"]}] for r in ref] == texts
        print(f"{batch_size:>5} {t_sdpa:>11.2f} {t_ours:>15.2f} {t_ours / t_sdpa:>6.3f} {t_engine:>17.2f} "
              f"{t_ours / t_engine:>11.3f} {str(same):>5}   (pool {piped['kv_num_blocks']} blocks; preemptions "
              f"{piped['vllm:num_preemptions']} / {direct['vllm:num_preemptions']}; peak running "
              f"{piped['peak_num_running']} / {direct['peak_num_running']}; steps {piped['num_steps']} / "
              f"{direct['num_steps']})")
    model.set_attn_implementation("sdpa")


SECTIONS = {"reuse": None, "streamer": streamer, "stop": stop_strings, "cache": returned_cache, "pipeline": pipelines}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections to run")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    only = args.only.split(",")
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {sorted(SECTIONS)}")
    model, tokenizer = load_default()
    for name in SECTIONS:
        if name in only:
            if name == "reuse":
                reuse(model, tokenizer, args.calls)
            else:
                SECTIONS[name](model, tokenizer)


if __name__ == "__main__":
    main()
