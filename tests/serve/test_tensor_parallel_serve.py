"""`hf-paged serve --tensor-parallel-size 2`: the server starts its second rank itself (no torchrun), answers
the real openai client exactly as one single-process `Engine` does (greedy, streamed, stop strings, n > 1
with logprobs), ends a killed or hung rank's requests with a clear 503 (no hang), and leaves no process
behind when it stops. `--data-parallel-size 2` (with and without tensor-parallel replicas): the same
answers, and a shared system prompt is served from the prefix cache of the replica that computed it."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

from served import Served  # noqa: E402

TP = ("--tensor-parallel-size", "2")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def single(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged import Engine, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="hf_paged"), tok,
                    max_model_len=256)

    def run(prompt: str, **params):
        return engine.generate([tok(prompt)["input_ids"]], SamplingParams(**params))[0]

    return run


def test_tp2_server_answers_as_one_engine(model_dir, single):
    server = Served(model_dir, *TP)
    try:
        ranks = _children(server.proc.pid)
        assert len(ranks) == 1  # rank 1, started by the server
        client = server.client()
        prompt = "The capital of France is"
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        expected = single(prompt, max_new_tokens=12)
        assert out.choices[0].text == expected.text
        streamed = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
        stop = expected.text.split()[2] if len(expected.text.split()) > 2 else expected.text[-3:]
        stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
        assert stopped.choices[0].text == single(prompt, max_new_tokens=12, stop=[stop]).text
        assert stopped.choices[0].finish_reason == "stop"
        two = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=1.0, n=2, seed=3,
                                        logprobs=2)
        want = single("Hello", max_new_tokens=6, temperature=1.0, n=2, seed=3, logprobs=2)
        assert [c.text for c in two.choices] == [s.text for s in want.outputs]
        assert all(len(c.logprobs.tokens) == 6 for c in two.choices)
    finally:
        assert server.stop() == 0
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") for p in ranks)  # the rank stopped with the server


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_killed_or_hung_rank_ends_requests_with_a_clear_503_not_a_hang(model_dir, fault):
    # a hung (stopped) rank sends no heartbeat: the server ends it after 3 s rather than wait in a collective
    server = Served(model_dir, *TP, env={"HF_PAGED_RANK_HEARTBEAT_TIMEOUT": "3"})
    try:
        client = server.client()
        assert client.completions.create(model="tiny", prompt="Hi", max_tokens=4, temperature=0).choices[0].text
        for pid in _children(server.proc.pid):
            os.kill(pid, fault)
        began = time.monotonic()
        for _ in range(2):  # the request that finds the rank gone, and every later one
            with pytest.raises(openai.APIStatusError) as err:
                client.completions.create(model="tiny", prompt="Hi again", max_tokens=4, temperature=0)
            assert err.value.status_code == 503 and "tensor-parallel rank is gone" in str(err.value)
        assert time.monotonic() - began < 30
    finally:
        assert server.stop() == 0


def test_tp2_batch_job_writes_the_single_process_rows(model_dir, tmp_path):
    import json
    import sys

    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hello there", "The sky is", "One two three")))

    def job(out, *extra):
        cmd = [sys.executable, "-m", "hf_paged.cli", "generate", "--model", str(model_dir), "--input", str(rows),
               "--output", str(out), "--no-progress", "--max-new-tokens", "8", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return sorted((r["index"], r["token_ids"]) for r in map(json.loads, out.read_text().splitlines()))

    assert job(tmp_path / "tp2.jsonl", *TP) == job(tmp_path / "tp1.jsonl")


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = _children(todo.pop())
        found += children
        todo += children
    return found


def _prefix_hits(server) -> float:
    import httpx

    body = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10).text
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith("vllm:prefix_cache_hits"))


@pytest.mark.parametrize("extra", [(), TP], ids=["dp2", "dp2-tp2"])
def test_dp2_server_answers_as_one_engine_and_serves_a_shared_prompt_from_the_replica_that_cached_it(
        model_dir, single, extra):
    server = Served(model_dir, "--data-parallel-size", "2", *extra)
    try:
        tree = _descendants(server.proc.pid)
        ranks = [p for p in tree if "hf_paged.parallel.launch" in open(f"/proc/{p}/cmdline").read()]
        assert len(ranks) == (2 if extra else 0)  # each replica started its own second rank
        client = server.client()
        system = "You are a terse assistant. " * 12  # several full KV blocks, shared by every prompt below
        prompts = [system + q for q in ("The capital of France is", "Two plus two is", "My name is", "Hello")]
        for prompt in prompts:  # one at a time: affinity, not load, decides
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
            assert out.choices[0].text == single(prompt, max_new_tokens=8).text
        streamed = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == single(prompts[0], max_new_tokens=8).text
        deadline = time.monotonic() + 5
        while _prefix_hits(server) < 3 * 16 * 3 and time.monotonic() < deadline:  # the replicas' next heartbeats
            time.sleep(0.2)
        assert _prefix_hits(server) >= 3 * 16 * 3  # prompts 2-4 found the system prompt's blocks cached
    finally:
        assert server.stop() == 0
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tree if os.path.exists(f"/proc/{p}")]  # replicas and their ranks stopped too


def test_prefill_and_decode_pools_at_their_own_sizes_answer_as_one_engine(model_dir, single):
    # prefill at TP 2, decode at TP 1: each KV head moves once, from the prefill rank holding it
    server = Served(model_dir, "--num-prefill", "1", "--num-decode", "1", "--prefill-tensor-parallel-size", "2")
    try:
        tree = _descendants(server.proc.pid)
        ranks = [p for p in tree if "hf_paged.disagg.rank" in open(f"/proc/{p}/cmdline").read()]
        assert len(ranks) == 1  # the prefill worker started its second rank; the decode worker has none
        client = server.client()
        for prompt in ("The capital of France is", "Two plus two is"):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
            assert out.choices[0].text == single(prompt, max_new_tokens=8).text
        streamed = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == single("Hello", max_new_tokens=8).text
    finally:
        assert server.stop() == 0
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tree if os.path.exists(f"/proc/{p}")]


@pytest.mark.parametrize("flags, message", [
    (("--prefill-tensor-parallel-size", "2"), "size the pools of --num-prefill/--num-decode"),
    (("--num-decode", "2", "--decode-tensor-parallel-size", "0"), "must be a positive integer"),
    (("--num-decode", "2", "--data-parallel-size", "2"), "does not combine with --num-prefill/--num-decode"),
])
def test_pool_flags_that_cannot_work_are_refused_at_start(model_dir, flags, message, monkeypatch, capsys):
    # In this process (`hf-paged serve` is `hf_paged.cli.main`): the same parser and checks, without a
    # second interpreter's start-up. Flags the checks let through stop at the API-key check, the first
    # step after them, instead of loading the model.
    from hf_paged import cli
    from hf_paged.serve import launch

    def passed(_key):
        raise AssertionError(f"{flags} passed the flag checks")

    monkeypatch.setattr(launch, "check_api_key", passed)
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", str(model_dir), "--port", "9", *flags])
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err, err[-2000:]
