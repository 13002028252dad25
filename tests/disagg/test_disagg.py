"""`DisaggregatedEngine` on the tiny Llama (gloo, CPU): output equal to one `Engine`, K/V bytes and
message counts per request, faults (a decode worker killed or hung, transfers lost), bad requests
and shutdown. Every run checks that each request completes exactly once with one engine's output
and that no worker process is left."""

from __future__ import annotations

import os
import threading
import time

import pytest

from hf_paged import Engine, SamplingParams
from hf_paged.disagg import AsyncDisaggregatedEngine, DataParallelEngine, DisaggregatedEngine
from tiny_models import VOCAB, tiny_paged_llama, tiny_paged_mla

pytestmark = pytest.mark.slow

PROMPTS = [[3 + (i * 7 + j) % (VOCAB - 3) for j in range(n)] for i, n in enumerate([5, 20, 37, 64, 16, 90, 1, 33])]
SYSTEM = list(range(100, 148))  # three full blocks shared by the second half
SHARED = PROMPTS[:4] + [SYSTEM + p for p in PROMPTS[4:]]
KV_BYTES_PER_TOKEN = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x fp32


def _reference(prompts, params):
    return [o.token_ids for o in Engine(tiny_paged_llama()).generate(prompts, params)]


def _gone(pids) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def _settled(engine, key: str, expected, timeout: float = 5.0):
    """`engine.metrics()[key]` once the workers' last heartbeats report it (they beat every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        value = engine.metrics()[key]
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_a_step_longer_than_the_heartbeat_timeout_is_not_taken_for_death():
    """The loop beats between steps; a pulse thread beats during a long one (before it, a worker whose
    one step outlasted `heartbeat_timeout` was killed as hung: a 2,048-token SmolLM2 prefill takes
    ~9 s on one slow core, past the default 10 s with three workers on two cores)."""
    greedy = SamplingParams(max_new_tokens=4)
    slow = {name: {"slow_step_seconds": 1.5} for name in ("prefill0", "decode0")}
    with DisaggregatedEngine(tiny_paged_llama, num_prefill=1, num_decode=1, heartbeat_timeout=0.8,
                             faults=slow) as engine:
        out = engine.generate(PROMPTS[:3], greedy)
        assert engine.metrics()["dead_workers"] == []
    assert [o.token_ids for o in out] == _reference(PROMPTS[:3], greedy)


@pytest.mark.parametrize("num_prefill, num_decode", [(1, 2), (2, 1)])
def test_greedy_and_seeded_outputs_equal_one_engine_with_exact_kv_accounting(num_prefill, num_decode):
    greedy = SamplingParams(max_new_tokens=12)
    seeded = [SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=100 + i) for i in range(len(SHARED))]
    with DisaggregatedEngine(tiny_paged_llama, num_prefill=num_prefill, num_decode=num_decode) as engine:
        pids = list(engine.worker_pids.values())
        out = engine.generate(SHARED, greedy)
        assert [o.token_ids for o in out] == _reference(SHARED, greedy)
        assert all(o.error is None and o.finish_reason == "length" for o in out)
        moved = sum(len(p) for p in SHARED)
        m = engine.metrics()
        assert m["kv_bytes_transferred"] == moved * KV_BYTES_PER_TOKEN  # exactly the prompts' K/V
        assert sum(t["count"] for t in m["transfers"].values()) == len(SHARED)
        assert _settled(engine, "tensor_sends", len(SHARED)) == len(SHARED)  # one message per request
        per_request = _settled(engine, "control_messages", 5 * len(SHARED)) / len(SHARED)
        assert per_request == 5  # prefill, first, kv, got, done: O(1) whatever the prompt's length
        out = engine.generate(SHARED, seeded)
        assert [o.token_ids for o in out] == _reference(SHARED, seeded)
        hits = sum(w["engine"].get("vllm:prefix_cache_hits", 0) for w in engine.metrics()["workers"].values())
        assert hits > 0  # the shared system prompt and the repeated prompts were served from prefix caches
    assert _gone(pids)


def test_a_latent_attention_model_moves_its_rows_and_decodes_as_one_engine():
    """DeepSeek V3 (MLA): a prompt's K/V move as its latent rows, (kv_lora_rank + qk_rope_head_dim) per
    token and layer, and the decode worker continues exactly as one engine does."""
    greedy = SamplingParams(max_new_tokens=8)
    config = tiny_paged_mla().config
    with DisaggregatedEngine(tiny_paged_mla, num_prefill=1, num_decode=1) as engine:
        out = engine.generate(SHARED[:5], greedy)
        moved = engine.metrics()["kv_bytes_transferred"]
    expected = [o.token_ids for o in Engine(tiny_paged_mla()).generate(SHARED[:5], greedy)]
    assert [o.token_ids for o in out] == expected
    per_token = config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    assert moved == sum(len(p) for p in SHARED[:5]) * per_token


@pytest.fixture(scope="module")
def pair():
    """One prefill and one decode worker with default settings, started once for the tests that inject no
    fault and read no cumulative counter (a worker start is most of such a test's time); their processes
    must be gone after it is closed."""
    with DisaggregatedEngine(tiny_paged_llama, num_prefill=1, num_decode=1) as engine:
        pids = list(engine.worker_pids.values())
        yield engine
    assert _gone(pids)


def test_streamed_tokens_join_to_the_outputs(pair):
    params = SamplingParams(max_new_tokens=6)
    events = list(pair.stream(PROMPTS[:4], params))
    expected = _reference(PROMPTS[:4], params)
    for i in range(4):
        mine = [e for e in events if e.index == i]
        assert [e.token_id for e in mine] == expected[i]
        assert [e.finish_reason for e in mine][-1] == "length" and all(e.finish_reason is None for e in mine[:-1])


def test_a_bad_request_fails_alone(pair):
    params = SamplingParams(max_new_tokens=5)
    prompts = [PROMPTS[0], [5, VOCAB + 7], [], PROMPTS[1]]
    out = pair.generate(prompts, params)
    [two] = pair.generate([PROMPTS[0]], SamplingParams(n=2, temperature=1.0))
    assert two.error is not None and "n=1" in str(two.error)
    assert out[1].error is not None and str(VOCAB + 7) in str(out[1].error)
    assert out[2].error is not None and "empty" in str(out[2].error)
    expected = _reference([PROMPTS[0], PROMPTS[1]], params)
    assert [out[0].token_ids, out[3].token_ids] == expected


def _generate_in_thread(engine, prompts, params):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", engine.generate(prompts, params)))
    thread.start()
    return thread, box


def _wait_running(engine, name: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = engine.metrics()["workers"].get(name, {})
        if status.get("running", 0) > 0 and status.get("engine", {}).get("vllm:generation_tokens", 0) > 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} never ran a request")


MANY = [PROMPTS[i % len(PROMPTS)] + [7 + i] for i in range(24)]
LONG = SamplingParams(max_new_tokens=48, ignore_eos=True)


def _fault_mid_run(prompts, params, running: str, fault, **engine_kwargs) -> None:
    """Start `generate(prompts)`, apply `fault(engine)` once `running` decodes, and check that every
    request is answered once with one engine's tokens, the faulty worker was dropped, and no worker
    process is left."""
    with DisaggregatedEngine(tiny_paged_llama, **engine_kwargs) as engine:
        pids = list(engine.worker_pids.values())
        thread, box = _generate_in_thread(engine, prompts, params)
        _wait_running(engine, running)
        victim = fault(engine)
        thread.join(120)
        assert not thread.is_alive()
        m = engine.metrics()
        assert m["dead_workers"] == [victim] and m["reroutes"] >= 1
    assert [o.token_ids for o in box["out"]] == _reference(prompts, params)
    assert len({o.request_id for o in box["out"]}) == len(prompts)  # each exactly once
    assert _gone(pids)


def _kill(name: str):
    def fault(engine):
        os.kill(engine.worker_pids[name], 9)
        return name
    return fault


def test_a_killed_decode_worker_has_its_requests_rerun_elsewhere():
    _fault_mid_run(MANY, LONG, "decode0", _kill("decode0"), num_prefill=1, num_decode=2, heartbeat_timeout=3.0)


def test_a_hung_decode_worker_is_detected_killed_and_its_requests_rerun():
    def freeze(engine):
        engine.send_control("decode1", {"op": "freeze"})
        return "decode1"

    _fault_mid_run(MANY, LONG, "decode1", freeze, num_prefill=1, num_decode=2, heartbeat_timeout=2.0,
                   faults={"decode1": {"freeze_on_request": True}})


def test_a_killed_prefill_worker_has_its_queued_requests_rerouted():
    """With the only prefill worker gone, the decode worker computes the re-routed requests whole."""
    prompts = [[3 + (i * 13 + j) % (VOCAB - 3) for j in range(300)] for i in range(40)]
    _fault_mid_run(prompts, SamplingParams(max_new_tokens=6), "decode0", _kill("prefill0"), num_prefill=1,
                   num_decode=1, heartbeat_timeout=3.0, engine_kwargs={"max_num_batched_tokens": 600})


@pytest.mark.parametrize("dropped, recomputed", [(1, 0), (2, 1)])
def test_a_lost_transfer_is_retried_once_then_recomputed(dropped, recomputed):
    """The first `dropped` sends of the prefill worker never happen: one loss is made good by the
    retry; two in a row (the same request's send and resend) make the decode worker recompute it."""
    faults = {"prefill0": {"drop_transfers": dropped}}
    params = SamplingParams(max_new_tokens=8)
    with DisaggregatedEngine(tiny_paged_llama, num_prefill=1, num_decode=1, transfer_timeout=1.0,
                             faults=faults) as engine:
        out = engine.generate(PROMPTS[:3], params)
        m = engine.metrics()
    assert [o.token_ids for o in out] == _reference(PROMPTS[:3], params)
    assert m.get("recomputed", 0) == recomputed


def test_the_first_token_ends_a_request_on_the_prefill_worker(pair):
    params = SamplingParams(max_new_tokens=1)
    moved = pair.metrics()["kv_bytes_transferred"]  # the shared workers' earlier requests'
    out = pair.generate(PROMPTS[:3], params)
    assert pair.metrics()["kv_bytes_transferred"] == moved
    assert [o.token_ids for o in out] == _reference(PROMPTS[:3], params)


def test_without_prefill_workers_decode_workers_run_whole_requests():
    params = SamplingParams(max_new_tokens=6)
    with DisaggregatedEngine(tiny_paged_llama, num_prefill=0, num_decode=1) as engine:
        out = engine.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in out] == _reference(PROMPTS[:3], params)


def test_bad_topologies_and_factories_are_refused():
    with pytest.raises(ValueError, match="num_decode >= 1"):
        DisaggregatedEngine(tiny_paged_llama, num_prefill=1, num_decode=0)
    with pytest.raises(TypeError, match="callable"):
        DisaggregatedEngine("not a factory")


def test_torchrun_runs_the_same_topology_across_processes(tmp_path):
    """`python -m torch.distributed.run --nproc-per-node 3 -m hf_paged.disagg.torchrun --prefill 1 --decode 1`:
    rank 0 routes and writes the outputs, rank 1 prefills, rank 2 decodes."""
    import json
    import subprocess
    import sys

    model_dir = tmp_path / "tiny"
    tiny_paged_llama().save_pretrained(model_dir)
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "hf_paged.disagg.torchrun", "--prefill", "1", "--decode", "1", "--model", str(model_dir),
           "--input", str(rows), "--output", str(out), "--max-new-tokens", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in records] == _reference(PROMPTS, SamplingParams(max_new_tokens=6))
    assert all(r["error"] is None for r in records)


# ---------------------------------------------------------------------- data parallelism (no prefill worker)
def _engine_counter(engine, worker: str, key: str):
    return engine.metrics()["workers"][worker]["engine"].get(key, 0)


def test_data_parallel_replicas_equal_one_engine_and_a_shared_prefix_goes_where_it_is_cached():
    greedy = SamplingParams(max_new_tokens=12)
    seeded = [SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=100 + i) for i in range(len(SHARED))]
    with DataParallelEngine(tiny_paged_llama, 2) as engine:
        pids = list(engine.worker_pids.values())
        assert sorted(engine.worker_pids) == ["replica0", "replica1"]
        out = engine.generate(SHARED, greedy)
        assert [o.token_ids for o in out] == _reference(SHARED, greedy)
        out = engine.generate(SHARED, seeded)
        assert [o.token_ids for o in out] == _reference(SHARED, seeded)
        m = engine.metrics()
        assert m["kv_bytes_transferred"] == 0 and m["tensor_sends"] == 0  # replicas move no K/V
        # The counters come with the workers' heartbeats: read them once both replicas report every request.
        names = ("replica0", "replica1")
        _await_successes(engine, names, 2 * len(SHARED))
        served = {name: _engine_counter(engine, name, "vllm:prompt_tokens") for name in names}
        assert all(served.values())  # a burst is spread over both replicas (load balance)

        # One at a time, so that load never decides: each later prompt with the system prompt goes to the
        # replica that computed it, and is served from its prefix cache.
        before = {name: _engine_counter(engine, name, "vllm:prefix_cache_hits") for name in served}
        system_prompts = [SYSTEM + [9, 8, 7, i] for i in range(4)]
        for prompt in system_prompts:
            [o] = engine.generate([prompt], greedy)
            assert o.token_ids == _reference([prompt], greedy)[0]
        _await_successes(engine, names, 2 * len(SHARED) + len(system_prompts))
        gained = {name: _engine_counter(engine, name, "vllm:prefix_cache_hits") - before[name] for name in served}
        assert sorted(gained.values()) == [0, len(SYSTEM) * len(system_prompts)], gained
        # Served, the replicas' KV usage counts each prefix-cached block once (twice before: below 0 here).
        assert 0.0 <= AsyncDisaggregatedEngine(engine).metrics()["vllm:kv_cache_usage_perc"] <= 1.0
    assert _gone(pids)


def _await_successes(engine, workers, count: int, timeout: float = 10.0) -> None:
    """Wait until the workers' reported counters include `count` finished requests in all."""
    deadline = time.monotonic() + timeout
    while sum(_engine_counter(engine, w, "vllm:request_success") for w in workers) < count:
        assert time.monotonic() < deadline, {w: _engine_counter(engine, w, "vllm:request_success") for w in workers}
        time.sleep(0.05)


def test_a_killed_replica_has_its_requests_rerun_on_the_other():
    # replica0's steps are slowed, so that it still holds requests when it is killed
    _fault_mid_run(MANY, LONG, "replica0", _kill("replica0"), num_prefill=0, num_decode=2, heartbeat_timeout=3.0,
                   faults={"replica0": {"slow_step_seconds": 0.2}})


def test_a_data_parallel_engine_needs_a_positive_size():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="data_parallel_size"):
            DataParallelEngine(tiny_paged_llama, bad)


def test_shutdown_leaves_no_semaphore_behind(tmp_path):
    """Loading from a folder makes a multiprocessing lock in each worker (tqdm's, for `from_pretrained`'s
    first progress bar). Workers end with `os._exit`, which skipped its cleanup: Python's resource tracker
    then reported "2 leaked semaphore objects" when a two-replica engine shut down."""
    import subprocess
    import sys

    model_dir = tmp_path / "tiny"
    tiny_paged_llama().save_pretrained(model_dir)
    script = ("from hf_paged import SamplingParams\n"
              "from hf_paged.disagg import DataParallelEngine\n"
              "from hf_paged.model_source import ModelFromPath\n"
              "if __name__ == '__main__':\n"
              f"    with DataParallelEngine(ModelFromPath({str(model_dir)!r}), 2) as engine:\n"
              "        [out] = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=2))\n"
              "    assert out.error is None and len(out.token_ids) == 2\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]
