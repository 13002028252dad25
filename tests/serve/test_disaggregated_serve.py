"""`hf-paged serve --num-prefill 1 --num-decode 2`: the OpenAI API over disaggregated workers (one
prefill and two decode processes, gloo on CPU) through `AsyncDisaggregatedEngine`, driven by the real
`openai` client: greedy completions (several at once, so both decode workers serve), a chat and
streams equal one `Engine`'s greedy output; /health, /metrics, the n > 1 refusal, and a SIGTERM that
leaves no worker behind."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

from served import Served  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fibonacci(n):",
           "A long time ago in a galaxy far, far away, there lived a"]


@pytest.fixture(scope="module")
def server(model_dir):
    s = Served(model_dir, "--num-prefill", "1", "--num-decode", "2", start_timeout=600)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged import Engine, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="hf_paged"), tok,
                    max_model_len=256, show_progress=False)

    def run(prompts_ids, max_new_tokens):
        return engine.generate(prompts_ids, SamplingParams(max_new_tokens=max_new_tokens))

    return tok, run


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def test_greedy_completions_chat_and_streams_equal_one_engine(server, reference):
    tok, run = reference
    client = server.client()
    expected = run([tok(p)["input_ids"] for p in PROMPTS], 12)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: both decode workers get requests
        outs = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=12,
                                                                 temperature=0), PROMPTS))
    for out, ref in zip(outs, expected):
        assert out.choices[0].text == ref.text
        assert out.usage.completion_tokens == len(ref.token_ids)
        assert out.choices[0].finish_reason == "length"

    messages = [{"role": "user", "content": "Say hello."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    chat_ref = run([ids], 10)[0]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == chat_ref.text and chat.usage.prompt_tokens == len(ids)

    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == expected[1].text
    assert len([t for t in texts if t]) > 1  # token by token, not one final chunk
    assert chunks[-1].usage.completion_tokens == len(expected[1].token_ids)
    parts = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == chat_ref.text


def test_health_metrics_and_what_the_workers_cannot_serve(server):
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count"):
        assert name in text
    r = server.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "n": 2})
    assert r.status_code == 400 and "n=1" in r.json()["error"]["message"]
    r = server.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_sigterm_stops_every_worker(model_dir):
    s = Served(model_dir, "--num-prefill", "1", "--num-decode", "1", start_timeout=600)
    workers = _children(s.proc.pid)
    assert s.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}).status_code == 200
    assert s.stop() == 0
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") and _alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}") and _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
