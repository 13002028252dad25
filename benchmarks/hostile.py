"""Hostile load on `hf-paged serve`: request bodies as large as the server takes (`--max-body-bytes`,
1 MiB by default) made of stop strings, alone and 32 at a time, while `/health` is polled.

Before the stop-string caps and the linear stop matcher, one such body asked the detokenizer for
every prefix of every stop string (about 120 GiB for four 250k-character stops) on the event loop.
Now each must be refused with a 400 that names the cap, the loop must stay free, and memory flat.
It prints, for a 1 MiB body of four long stops and one of many short stops:

* the latency of each, sent alone (median and max of `--repeat` runs);
* with 32 such requests in flight for `--seconds`: their statuses, `/health`'s latency (p50, p99,
  max; polled every 10 ms from its own thread) and the server's RSS (before, peak, after);
* a verdict against the issue's bounds: 400 in < 100 ms, `/health` < 50 ms, RSS growth < 50 MiB.

    python benchmarks/hostile.py [--model DIR|default] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import _free_port, _pct, _rss_kib, save_llama_with_tokenizer, start_server  # noqa: E402  (benchmarks/ is not a package)

BODY_BYTES = 1 << 20


def hostile_bodies(model: str, size: int = BODY_BYTES) -> dict[str, bytes]:
    """Two bodies of about `size` bytes: four long stop strings, and as many short ones as fit."""
    head = {"model": model, "prompt": "hi", "max_tokens": 4}
    overhead = len(json.dumps({**head, "stop": ["", "", "", ""]}).encode())
    long = (size - overhead - 64) // 4
    four_long = json.dumps({**head, "stop": ["ab" * (long // 2)] * 4}).encode()
    short = "stop-str"
    count = (size - overhead - 64) // (len(short) + 4)
    many_short = json.dumps({**head, "stop": [short] * count}).encode()
    assert len(four_long) <= size and len(many_short) <= size
    return {"four long stops": four_long, "many short stops": many_short}


def run(model_dir: str, seconds: float = 5.0, in_flight: int = 32, repeat: int = 10) -> dict:
    """Start `hf-paged serve` on `model_dir` and `measure` it."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hf_paged.cli", "serve", model_dir, "--served-model-name", "m", "--port", str(port),
           "--max-model-len", "256", "--max-tokens", "16"]
    env = {k: v for k, v in os.environ.items() if k != "HF_PAGED_API_KEY"}
    proc = start_server(cmd, url, env)
    try:
        return measure(url, proc.pid, "m", seconds=seconds, in_flight=in_flight, repeat=repeat)
    finally:
        proc.terminate()
        proc.wait(60)


def measure(url: str, pid: int, model: str, api_key: str | None = None, seconds: float = 5.0, in_flight: int = 32,
            repeat: int = 10) -> dict:
    """The figures of a running server (`pid` for its RSS) serving `model`."""
    import httpx

    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: dict = {"bodies": {}}
    bodies = hostile_bodies(model)
    headers = {"Content-Type": "application/json", **auth}
    small = {"model": model, "prompt": "hi", "max_tokens": 4}
    with httpx.Client(timeout=120) as client:
        assert client.post(url + "/v1/completions", json=small, headers=auth).status_code == 200  # warm
        for name, body in bodies.items():
            times, statuses, messages = [], set(), set()
            for _ in range(repeat):
                began = time.perf_counter()
                r = client.post(url + "/v1/completions", content=body, headers=headers)
                times.append(time.perf_counter() - began)
                statuses.add(r.status_code)
                messages.add(r.json()["error"]["message"])
            results["bodies"][name] = {"bytes": len(body), "statuses": sorted(statuses),
                                       "message": sorted(messages)[0], "median_s": statistics.median(times),
                                       "max_s": max(times)}
    results["load"] = _under_load(url, pid, model, api_key, seconds, in_flight)
    with httpx.Client(timeout=60) as client:  # still serving afterwards
        results["served_after"] = client.post(url + "/v1/completions", json=small, headers=auth).status_code
    return results


def _under_load(url: str, pid: int, model: str, api_key: str | None, seconds: float, in_flight: int) -> dict:
    """`in_flight` attackers in a process of their own (so that their work does not slow the
    poller's clock), `/health` polled from this one, the server's RSS sampled."""
    import subprocess

    import httpx

    attack = subprocess.Popen([sys.executable, __file__, "--attack", url, "--seconds", str(seconds),
                               "--in-flight", str(in_flight), "--served-model-name", model],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_PAGED_API_KEY": api_key or ""})
    before = _rss_kib(pid)
    if attack.stdout.readline().strip() != "go":  # its threads are ready: the window starts now
        raise RuntimeError("the attacking process did not start")
    health, rss = [], []
    with httpx.Client(timeout=60) as client:
        while attack.poll() is None:
            began = time.perf_counter()
            assert client.get(url + "/health").status_code == 200
            health.append(time.perf_counter() - began)
            rss.append(_rss_kib(pid))
            time.sleep(0.01)
    attacked = json.loads(attack.stdout.read())
    time.sleep(0.5)
    after = _rss_kib(pid)
    latencies = attacked.pop("latencies")
    return {**attacked, "requests": len(latencies), "request_p50_s": _pct(latencies, 0.5),
            "request_max_s": max(latencies), "health_polls": len(health), "health_p50_s": _pct(health, 0.5),
            "health_p99_s": _pct(health, 0.99), "health_max_s": max(health), "rss_before_mib": before / 1024,
            "rss_peak_mib": max(rss) / 1024, "rss_after_mib": after / 1024,
            "rss_growth_mib": (max(rss + [after]) - before) / 1024}


def attack(url: str, seconds: float, in_flight: int, model: str, api_key: str | None) -> dict:
    """Keep `in_flight` hostile bodies in flight for `seconds`; statuses and latencies."""
    import httpx

    bodies = list(hostile_bodies(model).values())
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    statuses: dict[int, int] = {}
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = [0.0]

    def open_window() -> None:  # run once every attacker holds its connection: a slow start costs no window
        deadline[0] = time.monotonic() + seconds

    ready = threading.Barrier(in_flight + 1, action=open_window)

    def attacker(i: int) -> None:
        with httpx.Client(timeout=120) as client:
            ready.wait()
            while True:  # at least one request each, however loaded the machine
                began = time.perf_counter()
                r = client.post(url + "/v1/completions", content=bodies[i % len(bodies)], headers=headers)
                with lock:
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    latencies.append(time.perf_counter() - began)
                if time.monotonic() >= deadline[0]:
                    break

    threads = [threading.Thread(target=attacker, args=(i,)) for i in range(in_flight)]
    for t in threads:
        t.start()
    ready.wait()
    print("go", flush=True)
    for t in threads:
        t.join()
    return {"in_flight": in_flight, "seconds": seconds, "statuses": statuses, "latencies": latencies}


def verdict(results: dict) -> list[str]:
    """The issue's bounds that the run missed (empty: all met)."""
    misses = []
    for name, b in results["bodies"].items():
        if b["statuses"] != [400]:
            misses.append(f"{name}: statuses {b['statuses']}, not [400]")
        if b["median_s"] >= 0.1:
            misses.append(f"{name}: answered in {b['median_s'] * 1e3:.1f} ms (median), not < 100 ms")
    load = results["load"]
    if set(load["statuses"]) != {"400"}:
        misses.append(f"under load: statuses {load['statuses']}")
    if load["health_max_s"] >= 0.05:
        misses.append(f"/health took up to {load['health_max_s'] * 1e3:.1f} ms, not < 50 ms")
    if load["rss_growth_mib"] >= 50:
        misses.append(f"RSS grew by {load['rss_growth_mib']:.1f} MiB, not < 50 MiB")
    if results["served_after"] != 200:
        misses.append(f"an ordinary request afterwards got {results['served_after']}")
    return misses


def report(results: dict) -> None:
    for name, b in results["bodies"].items():
        print(f"{name:>17}: {b['bytes']:,} bytes -> {b['statuses']} in {b['median_s'] * 1e3:.1f} ms median, "
              f"{b['max_s'] * 1e3:.1f} ms max  ({b['message'][:90]})")
    load = results["load"]
    print(f"{load['in_flight']} in flight for {load['seconds']:.0f} s: {load['requests']} requests, statuses "
          f"{load['statuses']}, p50 {load['request_p50_s'] * 1e3:.1f} ms, max {load['request_max_s'] * 1e3:.1f} ms")
    print(f"/health: {load['health_polls']} polls, p50 {load['health_p50_s'] * 1e3:.1f} ms, p99 "
          f"{load['health_p99_s'] * 1e3:.1f} ms, max {load['health_max_s'] * 1e3:.1f} ms")
    print(f"RSS: {load['rss_before_mib']:.1f} MiB before, {load['rss_peak_mib']:.1f} peak, {load['rss_after_mib']:.1f} "
          f"after (growth {load['rss_growth_mib']:.1f} MiB)")
    misses = verdict(results)
    print("PASS" if not misses else "FAIL: " + "; ".join(misses))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or 'default' (SmolLM2); default: a tiny "
                        "random Llama with SmolLM2's tokenizer")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--attack", default=None, help=argparse.SUPPRESS)  # the attackers' own process
    parser.add_argument("--served-model-name", default="m", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attack:
        print(json.dumps(attack(args.attack, args.seconds, args.in_flight, args.served_model_name,
                                os.environ.get("HF_PAGED_API_KEY") or None)))
        return 0
    model = args.model
    if model is None:
        import tempfile

        model = tempfile.mkdtemp(prefix="hf_paged-hostile-")
        save_llama_with_tokenizer(model)
    results = run(model, args.seconds, args.in_flight)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if not verdict(results) else 1


if __name__ == "__main__":
    sys.exit(main())
