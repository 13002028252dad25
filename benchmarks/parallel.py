"""Tensor parallelism on this machine: the same batch job at TP 1 and TP 2, tokens/s and each rank's KV bytes.

The model: a random-weight Llama (8 layers, width 512, 8 heads, 4 KV heads, vocabulary 8192, fp32) with
SmolLM2's tokenizer, saved to a temporary folder. The workload: `--num-requests` prompts of 16-128 words
(seeded), greedy, `--new-tokens` tokens each. Each method is one `hf-paged generate --input ... --output`
batch job (a fresh process: model load, engine, job), alternated `--repeats` times; the job's own
tokens/s line (generation only, not the load) is what is compared, as medians:

  * tp1: one process (all cores).
  * tp2: `--tensor-parallel-size 2`: this job's process is rank 0 and starts rank 1 (gloo on CPU).

It checks that both wrote the same tokens for every row, and prints the pool's K/V bytes per token per
rank from `hf-paged kv-size --tp` beside the model's.

`--dp` also serves `benchmarks/serve_load.py`'s workload (`--dp-requests` requests, half streamed, greedy,
`--dp-clients` concurrent clients) on the embedded SmolLM2-135M with `hf-paged serve` (DP 1: one engine
in the server's process, all cores) and `hf-paged serve --data-parallel-size 2` (two replica processes,
one core each, behind the same HTTP front, routed by prefix affinity then load), alternated
`--repeats` times: requests/s medians, the prefix-cache hits each reported, and whether every greedy
text is the same.

`--smollm2-tp3` also runs the parity check of `tests/parallel/tp_worker.py` on the embedded SmolLM2-135M
(9 heads, 3 KV heads) at TP 3 under torchrun (about a minute on 2 cores, too slow for the suite):
`Engine.generate` and drop-in `generate`, greedy and seeded, with and without preemption, on every rank
against the single-process model, and each rank's pool bytes against `kv-size --tp 3`.

On a 2-core CPU, TP 2 gives each rank one core (OMP_NUM_THREADS=1 per rank) and adds two all-reduces per
layer per step over loopback TCP: it is expected to be slower than TP 1 with both cores. Tensor
parallelism is for a model that does not fit one device, or for more memory bandwidth across devices;
GPU figures are printed only where a GPU is.

On 2 cores DP 2 cannot add compute either: each replica gets one core where DP 1's engine had two,
and the front (HTTP, tokenising, routing) takes its share of the same cores. Data parallelism is for
more devices than one replica uses.

    python benchmarks/parallel.py [--num-requests 32] [--new-tokens 32] [--repeats 3] [--smollm2-tp3] [--dp]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from soak import save_llama_with_tokenizer  # noqa: E402  (benchmarks/ is not a package)


def job(model: pathlib.Path, rows: pathlib.Path, out: pathlib.Path, new_tokens: int, tp: int) -> tuple[float, list]:
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "hf_paged.cli", "generate", "--model", str(model), "--input", str(rows),
           "--output", str(out), "--no-progress", "--max-new-tokens", str(new_tokens)]
    env = dict(os.environ)
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp)]
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // tp))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    line = proc.stdout.strip().splitlines()[-1]
    tokens, seconds = map(float, re.search(r"(\d+) tokens in ([\d.]+) s", line).groups())
    written = sorted((r["index"], r["token_ids"]) for r in map(json.loads, out.read_text().splitlines()))
    return tokens / seconds, written


def serve_run(folder: str, dp: int, reqs: list[dict], clients: int, max_tokens: int) -> dict:
    """`serve_load`'s client load against `hf-paged serve` (with `--data-parallel-size dp` when dp > 1)."""
    import httpx
    import signal

    from serve_load import run_load
    from soak import _free_port, start_server

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hf_paged.cli", "serve", folder, "--served-model-name", "m", "--port", str(port),
           "--max-num-seqs", str(clients), "--max-waiting", str(4 * clients)]
    if dp > 1:
        cmd += ["--data-parallel-size", str(dp)]
    env = {k: v for k, v in os.environ.items() if k != "HF_PAGED_API_KEY"}
    proc = start_server(cmd, url, env, timeout=300)
    try:
        result = run_load(url, "m", reqs, clients, max_tokens)
        time.sleep(0.5)  # replicas report their counters with their heartbeats
        metrics = httpx.get(url + "/metrics", timeout=30).text
        result["prefix_hits"] = sum(float(line.split()[-1]) for line in metrics.splitlines()
                                    if line.startswith("vllm:prefix_cache_hits"))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return result


def data_parallel(args) -> None:
    from serve_load import requests_for

    from hf_paged.defaults.models import ensure_default_checkpoint

    folder = str(ensure_default_checkpoint())
    reqs = requests_for(args.dp_requests, 0)
    rates, hits, texts, errors = {1: [], 2: []}, {1: [], 2: []}, {}, {1: 0, 2: 0}
    for _ in range(args.repeats):
        for dp in (1, 2):  # alternated
            r = serve_run(folder, dp, reqs, args.dp_clients, args.dp_max_tokens)
            rates[dp].append(len(r["texts"]) / r["seconds"])
            hits[dp].append(r["prefix_hits"])
            texts[dp] = r["texts"]
            errors[dp] += len(r["errors"])
    med = {dp: statistics.median(v) for dp, v in rates.items()}
    print(f"serve workload on SmolLM2-135M: {args.dp_requests} requests (half streamed, greedy, max_tokens "
          f"{args.dp_max_tokens}) from {args.dp_clients} clients, {args.repeats} alternated runs each, "
          f"{os.cpu_count()} CPU cores")
    for dp in (1, 2):
        print(f"  dp{dp}: median {med[dp]:6.2f} requests/s  (runs {', '.join(f'{x:.2f}' for x in rates[dp])}); "
              f"prefix-cache hit tokens {', '.join(f'{h:,.0f}' for h in hits[dp])}; errors {errors[dp]}")
    same = sum(texts[1].get(i) == texts[2].get(i) for i in texts[1])
    print(f"  dp2 / dp1 requests/s: {med[2] / med[1]:.2f}x; greedy texts equal: {same}/{len(texts[1])}")


def smollm2_tp3() -> None:
    from hf_paged.defaults.models import ensure_default_checkpoint

    folder = ensure_default_checkpoint()
    worker = pathlib.Path(__file__).resolve().parents[1] / "tests" / "parallel" / "tp_worker.py"
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "out.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        str(worker), str(folder), str(out)], capture_output=True, text=True, check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        single = json.loads(out.read_text())
        ranks = [json.loads((pathlib.Path(tmp) / f"out.json.rank{r}").read_text()) for r in range(3)]
    planned = subprocess.run([sys.executable, "-m", "hf_paged.cli", "kv-size", str(folder), "--tp", "3",
                              "--kv-dtype", "float32", "--json"], capture_output=True, text=True, check=True)
    print("SmolLM2-135M at TP 3 (torchrun, gloo), every rank against the single process:")
    for key in ("greedy", "sampled", "preempted_greedy", "preempted_sampled", "dropin_greedy", "dropin_sampled"):
        print(f"  {key:18s} equal on all 3 ranks: {all(r[key] == single[key] for r in ranks)}")
    print(f"  drop-in greedy equals stock generate: {ranks[0]['dropin_greedy'] == single['stock_greedy']}; "
          f"preemptions: {ranks[0]['preemptions']}")
    print(f"  K/V bytes per token: single {single['bytes_per_token']:,}, per rank "
          f"{[r['bytes_per_token'] for r in ranks]}, kv-size --tp 3: "
          f"{json.loads(planned.stdout)['rows'][0]['bytes_per_token']:,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smollm2-tp3", action="store_true", help="also check SmolLM2 at TP 3 (about a minute)")
    parser.add_argument("--dp", action="store_true", help="also serve the serve workload at DP 1 and DP 2")
    parser.add_argument("--dp-requests", type=int, default=96)
    parser.add_argument("--dp-clients", type=int, default=16)
    parser.add_argument("--dp-max-tokens", type=int, default=32)
    parser.add_argument("--only-dp", action="store_true", help="skip the TP runs")
    args = parser.parse_args()
    if args.smollm2_tp3:
        smollm2_tp3()
    if args.dp or args.only_dp:
        data_parallel(args)
    if args.only_dp:
        return
    rng = random.Random(0)
    words = "the of and a to in is was he for it with as his on be at by had are but from or have an".split()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        model = tmp / "model"
        save_llama_with_tokenizer(model, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
        rows = tmp / "rows.jsonl"
        rows.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(16, 128)))})
                                + "\n" for _ in range(args.num_requests)))
        speeds = {1: [], 2: []}
        outputs = {}
        for _ in range(args.repeats):
            for tp in (1, 2):  # alternated
                speed, outputs[tp] = job(model, rows, tmp / f"out{tp}.jsonl", args.new_tokens, tp)
                speeds[tp].append(speed)
        kv = {}
        for tp in (1, 2):
            planned = subprocess.run([sys.executable, "-m", "hf_paged.cli", "kv-size", str(model), "--tp", str(tp),
                                      "--kv-dtype", "float32", "--json"], capture_output=True, text=True, check=True)
            kv[tp] = json.loads(planned.stdout)["rows"][0]["bytes_per_token"]
    med = {tp: statistics.median(v) for tp, v in speeds.items()}
    print(f"{args.num_requests} requests x {args.new_tokens} tokens, {args.repeats} alternated runs each, "
          f"{os.cpu_count()} CPU cores")
    for tp in (1, 2):
        print(f"  tp{tp}: median {med[tp]:8.1f} tokens/s  (runs {', '.join(f'{s:.1f}' for s in speeds[tp])}); "
              f"K/V bytes per token per rank {kv[tp]:,}")
    print(f"  tp2 / tp1 tokens/s: {med[2] / med[1]:.2f}x; per-rank K/V bytes: {kv[2] / kv[1]:.2f}x")
    print(f"  same tokens for every row: {outputs[1] == outputs[2]}")


if __name__ == "__main__":
    main()
