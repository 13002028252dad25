"""Hostile and careless requests against `hf-paged serve` (a review's findings, each reproduced):
stop strings as large as the body cap, an empty API key, bodies Python cannot parse or encode, chat
templates that refuse the messages, requests the KV pool can never hold, and a stream that fails
after its first byte. The server answers each with an OpenAI-shaped 4xx (or an error event and
`[DONE]` in a stream), stays responsive, and keeps serving others."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

from served import KEY, Served  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# Gemma's rule, as its template states it: no system turn, and user/assistant strictly alternating.
STRICT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def strict_dir(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("strict") / "model"
    shutil.copytree(model_dir, path)
    (path / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(strict_dir):
    # A pool of 4 blocks of 16 tokens: a request that may grow past 64 tokens can never be held.
    s = Served(strict_dir, "--num-blocks", "4", "--block-size", "16")
    yield s
    assert s.stop() == 0


def _post(server, body, path="/v1/completions"):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={**server.headers, "Content-Type": "application/json"})


def _error(r) -> dict:
    error = json.loads(r.content)["error"]  # the body is valid JSON, whatever the request held
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    return error


GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_stop_strings_over_their_caps_are_refused_fast_and_named(server):
    bodies = _benchmark("hostile").hostile_bodies("tiny")
    for name, flag in (("four long stops", "--max-stop-chars"), ("many short stops", "--max-stop")):
        began = time.perf_counter()
        r = _post(server, bodies[name])
        took = time.perf_counter() - began
        assert len(bodies[name]) > 1_000_000 and r.status_code == 400, (name, r.status_code)
        assert flag in _error(r)["message"], name
        assert took < 2.0, (name, took)  # before the caps: minutes, and ~120 GiB for the long stops
    assert flag in _error(_post(server, {**GOOD, "stop": ["x"] * 5}))["message"]
    r = _post(server, {**GOOD, "stop": ["y" * 1025]})
    assert r.status_code == 400 and "--max-stop-chars" in _error(r)["message"]
    r = _post(server, {**GOOD, "logit_bias": {str(i): 1 for i in range(1025)}})
    assert r.status_code == 400 and "--max-logit-bias" in _error(r)["message"]
    # At the caps, it serves.
    assert _post(server, {**GOOD, "stop": ["z" * 1024] * 4, "logit_bias": {str(i): 1 for i in range(1024)}}
                 ).status_code == 200


def test_health_answers_and_memory_stays_flat_while_hostile_bodies_are_in_flight(server):
    hostile = _benchmark("hostile")
    results = hostile.measure(server.url, server.proc.pid, "tiny", api_key=KEY, seconds=3.0, in_flight=32, repeat=3)
    hostile.report(results)
    load = results["load"]
    assert set(load["statuses"]) == {"400"} and load["requests"] >= 32
    # benchmarks/hostile.py measures the bounds (400 < 100 ms, /health < 50 ms) on a quiet
    # machine; here, beside other tests, bounds that still fail by orders of magnitude before the fix.
    assert max(b["median_s"] for b in results["bodies"].values()) < 1.0
    assert load["health_p50_s"] < 0.1 and load["health_max_s"] < 1.0
    assert load["rss_growth_mib"] < 50
    assert results["served_after"] == 200


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_an_empty_api_key_is_refused_at_start(model_dir, how):
    cmd = [sys.executable, "-m", "hf_paged.cli", "serve", str(model_dir), "--port", "9"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "HF_PAGED_API_KEY"}
    if how == "flag":
        cmd += ["--api-key", ""]
    else:
        env["HF_PAGED_API_KEY"] = ""
    began = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "API key is empty" in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - began < 60  # refused before the model loads


def test_bodies_python_cannot_parse_or_encode_get_400_with_a_valid_json_error(server):
    cases = {
        "5,000-digit integer": b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        "surrogate in prompt": b'{"model": "tiny", "prompt": "a\\ud800b"}',
        "surrogate in chat content": b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
        "surrogate as a field name": b'{"model": "tiny", "prompt": "hi", "\\ud800": 1}',
        "surrogate in a stop": b'{"model": "tiny", "prompt": "hi", "stop": ["\\udc80"]}',
    }
    for name, body in cases.items():
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        r = _post(server, body, path)
        assert r.status_code == 400, (name, r.status_code, r.text[:200])
        _error(r)
    # A valid surrogate pair is one character: served.
    assert _post(server, b'{"model": "tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 2}').status_code == 200


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}],
], ids=["system-user", "user-user"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_template_that_refuses_the_messages_is_a_400(server, messages, stream):
    r = _post(server, {**CHAT, "messages": messages, "stream": stream}, "/v1/chat/completions")
    assert r.status_code == 400, r.text[:300]
    assert "chat template" in _error(r)["message"] and _error(r)["param"] == "messages"
    assert _post(server, CHAT, "/v1/chat/completions").status_code == 200


def test_a_request_the_pool_can_never_hold_gets_the_same_400_streamed_or_not(server):
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 64}  # may grow to 66 tokens > 4 x 16
    plain = _post(server, body)
    streamed = _post(server, {**body, "stream": True})
    assert plain.status_code == streamed.status_code == 400, (plain.text[:200], streamed.text[:200])
    assert _error(plain)["message"] == _error(streamed)["message"]
    assert "KV blocks" in _error(plain)["message"]
    assert _post(server, GOOD).status_code == 200


def test_a_stream_that_fails_after_its_first_byte_ends_with_an_error_event_and_done(model_dir, monkeypatch):
    """In process: the engine's sampler starts failing mid-stream, so the request ends with an error
    after its first tokens went out (a 200 already sent)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged import AsyncEngine, Engine
    from hf_paged.serve.api_server import Server
    from hf_paged.worker import sampler as sampler_module

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="hf_paged")
    engine = Engine(model, tok, max_model_len=256, num_blocks=32, show_progress=False)
    real, calls = sampler_module.Sampler.__call__, []

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected sampler failure")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(sampler_module.Sampler, "__call__", flaky)

    async def main():
        server = Server(AsyncEngine(engine), tok, "tiny", api_key=KEY)
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            r = await client.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                  json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 32,
                                        "temperature": 0, "stream": True}, timeout=60)
        await server.engine.shutdown()
        return r, server

    r, server = asyncio.run(main())
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]", r.text[-500:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(c.get("choices") and c["choices"][0]["text"] for c in chunks)  # tokens went out first
    assert chunks[-1]["error"]["type"] == "server_error"
    assert server.in_flight == 0


def test_a_large_body_that_never_arrives_gets_408_and_holds_nothing_else_up(model_dir, monkeypatch):
    """In process, through the ASGI interface: a client that announces a large body and never sends
    it holds one reading slot until the deadline (408), while small requests are served meanwhile."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged import AsyncEngine, Engine
    from hf_paged.serve import api_server

    monkeypatch.setattr(api_server, "BODY_TIMEOUT_SECONDS", 0.5)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="hf_paged")
    engine = Engine(model, tok, max_model_len=256, num_blocks=32, show_progress=False)

    async def main():
        server = api_server.Server(AsyncEngine(engine), tok, "tiny", api_key=KEY)
        sent: list[dict] = []

        async def never():  # the body never comes
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "server": ("test", 80), "client": ("test", 1),
                 "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-length", b"500000"),
                             (b"content-type", b"application/json")]}
        stuck = [asyncio.ensure_future(server.app(scope, never, send)) for _ in range(api_server.MAX_LARGE_BODIES)]
        await asyncio.sleep(0.1)
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            began = time.perf_counter()
            small = await client.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=GOOD)
            health = await client.get("/health")
            took = time.perf_counter() - began
        await asyncio.wait_for(asyncio.gather(*stuck), 30)
        await server.engine.shutdown()
        return small, health, took, sent

    small, health, took, sent = asyncio.run(main())
    assert small.status_code == 200 and health.status_code == 200 and took < 5.0
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [408] * len(starts) and len(starts) >= 4
