"""The same client load against `hf-paged serve` and `transformers serve --continuous-batching`,
one after the other on this machine, printed side by side.

Each server gets the identical request list: `--clients` concurrent clients draw from it until
`--requests` are answered; half stream, half do not; every request is greedy (`temperature: 0`)
with `max_tokens` fixed, on `/v1/completions`. The common subset of the two APIs: `transformers
serve` ignores `n`, `logprobs` and `presence_penalty` on this endpoint. Printed per server: requests/s,
completion tokens/s (from each response's `usage`), time to first token and inter-token latency
(streams), end-to-end latency, errors and how many greedy texts the two servers agree on.

`transformers serve` starts on the same model folder, offline (`HF_HUB_OFFLINE=1`), on the same
device and threads. When it cannot start, the table says why in its place (the end of its stderr).

    python benchmarks/serve_load.py [--model default|DIR] [--requests 256] [--clients 32] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak import _free_port, _pct, start_server  # noqa: E402  (benchmarks/ is not a package)

PROMPTS = ["Tell me about the sea.", "Write a short poem about rain.", "What is a block table?",
           "List three colours.", "Explain caching in one sentence.", "Describe a lighthouse at night.",
           "Why is the sky blue?", "Name a fruit and say why you like it.",
           "Summarise the plot of a detective story in which the butler is innocent and the gardener is not.",
           "Give me a recipe for pancakes, with the quantities, the steps and a tip for flipping them.",
           "Explain to a child why the moon changes shape over a month, with an example.",
           "Write the opening paragraph of a letter to a friend who moved to another country last year."]


def model_folder(model: str) -> str:
    """A folder both servers can load: `default` is hf_paged's cached safetensors copy of SmolLM2."""
    if model != "default":
        return model
    from hf_paged.defaults.models import ensure_default_checkpoint

    return str(ensure_default_checkpoint())


def requests_for(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": rng.choice(PROMPTS), "stream": rng.random() < 0.5} for _ in range(count)]


async def _one(http, model: str, req: dict, max_tokens: int, out: dict, index: int) -> None:
    body = {"model": model, "prompt": req["prompt"], "max_tokens": max_tokens, "temperature": 0}
    began = time.perf_counter()
    try:
        if not req["stream"]:
            r = await http.post("/v1/completions", json=body)
            if r.status_code != 200:
                out["errors"].append((index, r.status_code, r.text[:200]))
                return
            payload = r.json()
            out["texts"][index] = payload["choices"][0]["text"]
            out["tokens"] += payload["usage"]["completion_tokens"]
        else:
            body.update(stream=True, stream_options={"include_usage": True})
            text, last, tokens = "", None, None
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    out["errors"].append((index, r.status_code, (await r.aread())[:200]))
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        out["errors"].append((index, "stream error", payload))
                        return
                    if payload.get("usage"):
                        tokens = payload["usage"]["completion_tokens"]
                    piece = "".join(c.get("text") or "" for c in payload.get("choices") or [])
                    if not piece:
                        continue
                    now = time.perf_counter()
                    (out["ttft"] if last is None else out["itl"]).append(now - (began if last is None else last))
                    last, text = now, text + piece
            if tokens is None:
                out["errors"].append((index, "no usage in the stream", text[:80]))
                return
            out["texts"][index] = text
            out["tokens"] += tokens
    except Exception as exc:  # a benchmark counts failures; it does not stop at the first one
        out["errors"].append((index, type(exc).__name__, str(exc)[:200]))
        return
    out["e2e"].append(time.perf_counter() - began)


def run_load(url: str, model: str, reqs: list[dict], clients: int, max_tokens: int) -> dict:
    import httpx

    out = {"texts": {}, "tokens": 0, "ttft": [], "itl": [], "e2e": [], "errors": []}
    queue = list(enumerate(reqs))

    async def client(http):
        while queue:
            index, req = queue.pop(0)
            await _one(http, model, req, max_tokens, out, index)

    async def main():
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            # one request first, alone: both servers load lazily or warm up on their first request
            await _one(http, model, {"prompt": PROMPTS[0], "stream": False}, 4, {"texts": {}, "tokens": 0, "ttft": [],
                                                                                 "itl": [], "e2e": [], "errors": []}, -1)
            began = time.perf_counter()
            await asyncio.gather(*[client(http) for _ in range(clients)])
            out["seconds"] = time.perf_counter() - began

    asyncio.run(main())
    return out


def serve(name: str, cmd: list[str], url: str, env: dict, model: str, reqs, clients, max_tokens) -> dict:
    try:
        proc = start_server(cmd, url, env, timeout=300)
    except (RuntimeError, OSError) as exc:
        return {"name": name, "skipped": str(exc)}
    try:
        result = run_load(url, model, reqs, clients, max_tokens)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:
            proc.kill()
    result["name"] = name
    return result


def table(results: list[dict], reqs: list[dict]) -> None:
    ran = [r for r in results if "skipped" not in r]
    cols = [("requests/s", lambda r: f"{len(r['texts']) / r['seconds']:.2f}"),
            ("tokens/s", lambda r: f"{r['tokens'] / r['seconds']:.1f}"),
            ("TTFT p50 ms", lambda r: f"{_pct(r['ttft'], .5) * 1e3:.0f}"),
            ("TTFT p99 ms", lambda r: f"{_pct(r['ttft'], .99) * 1e3:.0f}"),
            ("ITL p50 ms", lambda r: f"{_pct(r['itl'], .5) * 1e3:.1f}"),
            ("ITL p99 ms", lambda r: f"{_pct(r['itl'], .99) * 1e3:.1f}"),
            ("E2E p50 s", lambda r: f"{_pct(r['e2e'], .5):.2f}"),
            ("E2E p99 s", lambda r: f"{_pct(r['e2e'], .99):.2f}"),
            ("errors", lambda r: str(len(r["errors"])))]
    print("| server | " + " | ".join(c for c, _ in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for r in ran:
        print(f"| {r['name']} | " + " | ".join(f(r) for _, f in cols) + " |")
    for r in results:
        if "skipped" in r:
            print(f"\n{r['name']}: not run. {r['skipped']}")
        elif r["errors"]:
            print(f"\n{r['name']}: first errors {r['errors'][:3]}")
    if len(ran) == 2:
        ours, theirs = ran
        print(f"\nhf_paged / transformers: throughput {ours['tokens'] / ours['seconds'] / (theirs['tokens'] / theirs['seconds']):.2f}x"
              f" (tokens/s), TTFT p50 {_pct(ours['ttft'], .5) / _pct(theirs['ttft'], .5):.2f}x, "
              f"ITL p50 {_pct(ours['itl'], .5) / _pct(theirs['itl'], .5):.2f}x, "
              f"E2E p50 {_pct(ours['e2e'], .5) / _pct(theirs['e2e'], .5):.2f}x")
        both = set(ours["texts"]) & set(theirs["texts"])
        same = sum(ours["texts"][i] == theirs["texts"][i] for i in both)
        print(f"greedy texts equal between the two servers: {same}/{len(both)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a model folder, or 'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["hf_paged", "transformers"], default=None)
    args = parser.parse_args()
    folder = model_folder(args.model)
    reqs = requests_for(args.requests, args.seed)
    env = {k: v for k, v in os.environ.items() if k != "HF_PAGED_API_KEY"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    results = []
    import torch

    print(f"model {folder}; {args.requests} requests (half streamed, greedy, max_tokens {args.max_tokens}) from "
          f"{args.clients} clients; torch threads {torch.get_num_threads()}", flush=True)
    if args.only in (None, "hf_paged"):
        port = _free_port()
        cmd = [sys.executable, "-m", "hf_paged.cli", "serve", folder, "--served-model-name", "m", "--port", str(port),
               "--max-num-seqs", str(args.clients), "--max-waiting", str(4 * args.clients)]
        results.append(serve("hf-paged serve", cmd, f"http://127.0.0.1:{port}", env, "m", reqs, args.clients,
                             args.max_tokens))
    if args.only in (None, "transformers"):
        port = _free_port()
        exe = shutil.which("transformers", path=os.path.dirname(sys.executable)) or "transformers"
        cmd = [exe, "serve", folder, "--continuous-batching", "--port", str(port), "--host", "127.0.0.1",
               "--device", "cpu", "--log-level", "warning"]
        results.append(serve("transformers serve --continuous-batching", cmd, f"http://127.0.0.1:{port}", env,
                             folder, reqs, args.clients, args.max_tokens))
    table(results, reqs)


if __name__ == "__main__":
    main()
