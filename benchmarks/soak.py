"""Soak `hf-paged serve` on loopback: many concurrent clients for a bounded time and count, checking
that nothing is lost.

The clients mix streaming and non-streaming, greedy and seeded sampling, `n` of 1 and 2, and stop
sequences. 10% of the clients disconnect mid-stream, and 5% of the requests are malformed. The
KV pool is small enough (`--num-blocks`) that the engine preempts.

Throughout, every well-formed request must get one complete response, exactly once: a 200 with
`n` choices, or a stream with one finish per choice and one `[DONE]`. Greedy responses must equal
an offline `Engine.generate` of the same prompts. After the run, the pool must be entirely free
(no request running, KV usage 0), and the server's RSS must grow by at most 5% between the first
and last quarter of the run after its warm-up (the first quarter of the time, at most 30 s, while
allocators and caches settle under the same load).

It prints p50/p99 time to first token and inter-token latency (streams), throughput and the error
counts. `run_soak` is what the test suite calls with a short budget.

    python benchmarks/soak.py [--model DIR|default] [--minutes 10] [--requests 1000] [--clients 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

PROMPTS = ["Tell me about the sea.", "Write a short poem about rain.", "What is a block table?",
           "List three colours.", "Explain caching in one sentence.", "Describe a lighthouse at night.",
           "Why is the sky blue?", "Name a fruit and say why you like it."]
BAD_BODIES = [b'{"model": "m", "prompt": ', b"[1, 2]", b'{"model": "m", "prompt": "x", "max_tokens": -1}',
              b'{"model": "m", "prompt": "x", "temperature": NaN}', b'{"model": "m", "prompt": "x", "n": 1000}',
              b'{"model": "nope", "prompt": "x"}', b'{"model": "m", "prompt": [999999999]}']


def save_llama_with_tokenizer(path, hidden_size: int = 64, intermediate_size: int = 128, num_hidden_layers: int = 2,
                              num_attention_heads: int = 4, num_key_value_heads: int = 2,
                              max_position_embeddings: int = 512) -> None:
    """A random-weight Llama with SmolLM2's tokenizer saved to `path`, as users serve a model folder."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_paged.defaults.models import load_default_tokenizer

    tok = load_default_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


STOPS = ["\n\n", ".", " the"]


def reference_texts(model: str, max_tokens: int) -> dict[tuple[str, str | None], str]:
    """What an offline `Engine.generate` answers to each prompt, greedily, with each stop or none (the
    oracle). `model` is what `hf-paged serve` takes: a folder, `module:callable` or "default"."""
    from hf_paged import Engine, SamplingParams
    from hf_paged.model_source import ModelFromPath

    model, tok = ModelFromPath(model)()
    engine = Engine(model.eval(), tok, max_model_len=256, show_progress=False)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    reference = {}
    for stop in [None, *STOPS]:
        outs = engine.generate(ids, SamplingParams(max_new_tokens=max_tokens, stop=[stop] if stop else None))
        reference.update({(p, stop): o.text for p, o in zip(PROMPTS, outs)})
    return reference


async def _client(cid: int, url: str, model: str, deadline: float, budget: dict, stats: dict, rng: random.Random,
                  disconnects: bool, max_tokens: int):
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        # Both minimums (the time and the count) are met before the clients stop; twice the time bounds it.
        while (time.monotonic() < deadline or budget["left"] > 0) and time.monotonic() < budget["hard_deadline"]:
            budget["left"] -= 1
            rid = budget["next"]
            budget["next"] += 1
            if rng.random() < 0.05:  # a malformed request: a 4xx, and nothing else changes
                r = await http.post("/v1/completions", content=rng.choice(BAD_BODIES),
                                    headers={"Content-Type": "application/json"})
                stats["malformed"] += 1
                stats["malformed_4xx"] += 400 <= r.status_code < 500
                continue
            prompt = rng.choice(PROMPTS)
            greedy = rng.random() < 0.5
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0 if greedy else 0.9}
            if not greedy:
                body["seed"] = rng.randrange(1 << 30)
                body["n"] = rng.choice([1, 2])
            if rng.random() < 0.2:
                body["stop"] = [rng.choice(STOPS)]
            stream = rng.random() < 0.5
            n = body.get("n", 1)
            if stream:
                body["stream"] = True
                cut = disconnects and rng.random() < 0.5
                await _stream(http, body, rid, n, cut, stats)
            else:
                r = await http.post("/v1/completions", json=body)
                if r.status_code != 200:
                    stats["failed"].append((rid, r.status_code, r.text[:200]))
                    continue
                choices = r.json()["choices"]
                stats["done"][rid] = stats["done"].get(rid, 0) + 1
                if len(choices) != n or any(c["finish_reason"] is None for c in choices):
                    stats["failed"].append((rid, "incomplete", choices))
                if greedy:
                    stats["greedy"].append(((prompt, body.get("stop", [None])[0]), choices[0]["text"]))
                stats["tokens"] += r.json()["usage"]["completion_tokens"]


async def _stream(http, body: dict, rid: int, n: int, cut: bool, stats: dict) -> None:
    began = time.perf_counter()
    last, chunks, finishes, done, text = None, 0, 0, 0, ""
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            stats["failed"].append((rid, r.status_code, (await r.aread())[:200]))
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if line == "data: [DONE]":
                done += 1
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                stats["failed"].append((rid, "stream error", payload))
                return
            for choice in payload["choices"]:
                chunks += 1
                text += choice.get("text", "") if choice["index"] == 0 else ""
                finishes += choice["finish_reason"] is not None
            if last is None:
                stats["ttft"].append(now - began)
            else:
                stats["itl"].append(now - last)
            last = now
            if cut and chunks >= 3:  # this client goes away mid-stream
                stats["disconnected"] += 1
                return
    stats["done"][rid] = stats["done"].get(rid, 0) + 1
    stats["tokens"] += chunks - finishes
    if finishes != n or done != 1:
        stats["failed"].append((rid, "stream incomplete", finishes, done))
    elif body["temperature"] == 0:
        stats["greedy"].append(((body["prompt"], body.get("stop", [None])[0]), text))


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def start_server(cmd: list[str], url: str, env: dict, timeout: float = 180) -> subprocess.Popen:
    """Start a server process and wait until `url`/health answers 200. Its stderr is kept in a temporary
    file (a pipe nobody reads would fill and stall it); a server that exits or never answers raises
    RuntimeError with the end of that stderr."""
    import tempfile

    import httpx

    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env)
    proc.log = log
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0)
            raise RuntimeError(f"the server did not start ({' '.join(cmd[:4])} ...): {log.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def run_soak(model_dir: str, seconds: float, requests: int, clients: int, num_blocks: int = 48, max_tokens: int = 24,
             seed: int = 0) -> dict:
    """Start the server, soak it, stop it (SIGTERM); returns the measurements and the checks' inputs."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hf_paged.cli", "serve", model_dir, "--served-model-name", "m", "--port", str(port),
           "--max-model-len", "256", "--max-tokens", "64", "--num-blocks", str(num_blocks), "--max-num-seqs", "32"]
    env = {k: v for k, v in os.environ.items() if k != "HF_PAGED_API_KEY"}
    proc = start_server(cmd, url, env)
    try:
        rss: list[int] = []
        stop_sampling = threading.Event()

        warmup = min(30.0, seconds / 4)  # allocators and caches settle under load first: RSS counts after

        def sample():
            if stop_sampling.wait(warmup):
                return
            while not stop_sampling.wait(0.5):
                rss.append(_rss_kib(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        stats = {"done": {}, "failed": [], "greedy": [], "ttft": [], "itl": [], "tokens": 0, "malformed": 0,
                 "malformed_4xx": 0, "disconnected": 0}
        rng = random.Random(seed)
        began = time.monotonic()
        end = began + seconds
        budget = {"left": requests, "next": 0, "hard_deadline": began + 2 * seconds + 60}

        async def main():
            tasks = [_client(c, url, "m", end, budget, stats, random.Random(rng.random()), c % 10 == 0, max_tokens)
                     for c in range(clients)]
            await asyncio.gather(*tasks)

        asyncio.run(main())
        elapsed = time.monotonic() - began
        settle = time.monotonic() + 20
        while time.monotonic() < settle and (_metric(url, "vllm:num_requests_running") > 0
                                             or _metric(url, "vllm:kv_cache_usage_perc") > 0):
            time.sleep(0.2)
        stats.update(seconds=elapsed, running_after=_metric(url, "vllm:num_requests_running"),
                     kv_usage_after=_metric(url, "vllm:kv_cache_usage_perc"),
                     preemptions=_metric(url, "vllm:num_preemptions_total"), rss=list(rss))
        stop_sampling.set()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        stats_exit = proc.wait(60) if proc.poll() is None else proc.returncode
    stats["exit_code"] = stats_exit
    return stats


def check(stats: dict, reference: dict[str, str]) -> list[str]:
    """The soak's failures (empty: it passed)."""
    problems = []
    if stats["failed"]:
        problems.append(f"{len(stats['failed'])} well-formed requests failed: {stats['failed'][:3]}")
    twice = [rid for rid, n in stats["done"].items() if n != 1]
    if twice:
        problems.append(f"requests answered more than once: {twice[:5]}")
    wrong = [(p, t) for p, t in stats["greedy"] if t != reference[p]]
    if wrong:
        problems.append(f"{len(wrong)} greedy responses differ from the offline run, e.g. {wrong[0]}")
    if stats["malformed"] != stats["malformed_4xx"]:
        problems.append("a malformed request did not get a 4xx")
    if stats["running_after"] != 0 or stats["kv_usage_after"] != 0:
        problems.append(f"after the run: {stats['running_after']} running, KV usage {stats['kv_usage_after']}")
    rss = stats["rss"]
    q = max(1, len(rss) // 4)
    if len(rss) >= 8 and statistics.fmean(rss[-q:]) > 1.05 * statistics.fmean(rss[:q]):
        problems.append(f"RSS grew from {statistics.fmean(rss[:q]):.0f} to {statistics.fmean(rss[-q:]):.0f} KiB")
    if stats["exit_code"] != 0:
        problems.append(f"the server exited with {stats['exit_code']} on SIGTERM")
    return problems


def report(stats: dict) -> None:
    ttft, itl = stats["ttft"], stats["itl"]
    rss = stats["rss"]
    q = max(1, len(rss) // 4)
    print(f"{len(stats['done'])} complete responses in {stats['seconds']:.1f} s "
          f"({len(stats['done']) / stats['seconds']:.2f} requests/s, {stats['tokens'] / stats['seconds']:.1f} tokens/s); "
          f"{stats['malformed']} malformed (all 4xx: {stats['malformed'] == stats['malformed_4xx']}), "
          f"{stats['disconnected']} disconnected mid-stream, {len(stats['failed'])} failed, "
          f"{stats['preemptions']:.0f} preemptions")
    print(f"TTFT p50 {_pct(ttft, .5) * 1e3:.1f} ms, p99 {_pct(ttft, .99) * 1e3:.1f} ms; ITL p50 {_pct(itl, .5) * 1e3:.1f} ms, "
          f"p99 {_pct(itl, .99) * 1e3:.1f} ms; greedy responses checked: {len(stats['greedy'])}; RSS first/last quarter "
          f"{statistics.fmean(rss[:q]) / 1024:.1f} / {statistics.fmean(rss[-q:]) / 1024:.1f} MiB")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="what hf-paged serve takes: a model folder with its tokenizer, "
                                                       "module:callable, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=48)
    args = parser.parse_args()
    reference = reference_texts(args.model, 24)
    stats = run_soak(args.model, args.minutes * 60, args.requests, args.clients, args.num_blocks)
    report(stats)
    problems = check(stats, reference)
    print("PASS" if not problems else "FAIL:\n  " + "\n  ".join(problems))
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
