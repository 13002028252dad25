"""`hf-paged serve` in a subprocess on a free loopback port, driven by the real `openai` client and by
raw HTTP: completions, chat, streaming, n, logprobs and stops equal to `Engine.generate`; the API
key on every endpoint but /health; 30+ malformed or hostile requests answered with OpenAI-shaped
4xx while the server keeps serving; a disconnect frees its request; 429 when full; SIGTERM drains.
The model: a tiny random Llama with SmolLM2's tokenizer (saved to a folder, as users serve)."""

from __future__ import annotations

import json
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

from served import KEY, Served  # noqa: E402


@pytest.fixture(scope="module")
def server(model_dir):
    s = Served(model_dir)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged import Engine, SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="hf_paged"), tok,
                    max_model_len=256)

    def run(prompt_ids, **params):
        return engine.generate([prompt_ids], SamplingParams(**params))[0]

    return tok, run


def test_completions_and_chat_equal_engine_generate(server, reference):
    tok, run = reference
    client = server.client()
    out = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0)
    expected = run(tok("The capital of France is")["input_ids"], max_new_tokens=12)
    assert out.choices[0].text == expected.text and out.usage.completion_tokens == len(expected.token_ids)
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert chat.choices[0].message.content == run(list(ids), max_new_tokens=10).text
    assert chat.usage.prompt_tokens == len(ids)


def test_streamed_deltas_join_to_the_non_streamed_text(server):
    client = server.client()
    full = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    messages = [{"role": "user", "content": "Count to five."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    parts = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == whole.choices[0].message.content


def test_n_logprobs_and_stop(server):
    client = server.client()
    two = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=1.0, n=2, seed=3)
    assert [c.index for c in two.choices] == [0, 1]
    lp = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    assert len(lp.choices[0].logprobs.token_logprobs) == lp.usage.completion_tokens
    assert all(len(t) <= 3 for t in lp.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert all(len(t.top_logprobs) <= 2 for t in chat.choices[0].logprobs.content)
    base = client.completions.create(model="tiny", prompt="Hello", max_tokens=16, temperature=0).choices[0].text
    if len(base) > 4:
        stop = base[2:4]
        cut = client.completions.create(model="tiny", prompt="Hello", max_tokens=16, temperature=0, stop=[stop])
        assert stop not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"
        assert base.startswith(cut.choices[0].text)


def test_streamed_logprobs_come_in_openais_chunk_format_and_equal_the_non_streamed_ones(server):
    client = server.client()
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert all(c.choices[0].logprobs is not None for c in chunks)  # before: every chunk said null
    joined = {key: [v for c in chunks for v in getattr(c.choices[0].logprobs, key)]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert joined == {key: getattr(whole, key) for key in joined}
    assert all(len(top) <= 2 for top in joined["top_logprobs"])
    messages = [{"role": "user", "content": "Count to five."}]
    chat = dict(model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**chat).choices[0].logprobs.content
    parts = [c for c in client.chat.completions.create(**chat, stream=True) if c.choices and c.choices[0].logprobs]
    streamed = [entry for c in parts for entry in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole] and len(whole) == 10


ENDPOINTS = [("get", "/v1/models", None), ("get", "/metrics", None),
             ("post", "/v1/completions", {"model": "tiny", "prompt": "hi"}),
             ("post", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
                         ids=["missing", "wrong", "not-bearer"])
def test_every_endpoint_but_health_needs_the_key(server, headers):
    for method, path, body in ENDPOINTS:
        r = httpx.request(method, server.url + path, headers=headers, json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    for method, path, body in ENDPOINTS:
        assert httpx.request(method, server.url + path, headers=server.headers, json=body,
                             timeout=30).status_code == 200, path


def test_the_start_up_banner_states_what_is_served_and_the_defaults(server):
    banner = [line for line in server.stderr().splitlines() if line.startswith("hf-paged serve: ")]
    assert len(banner) == 2, server.stderr()[-2000:]
    assert banner[0].startswith("hf-paged serve: tiny (") and " on " in banner[0]  # the device and dtype
    assert "KV pool " in banner[0] and " blocks x 16 tokens = " in banner[0] and "max_model_len 256" in banner[0]
    assert "chat: the rest of the context, completions: 16" in banner[1] and "at most 64 (--max-tokens)" in banner[1]
    assert f"http://127.0.0.1:{server.port}" in banner[1]


def test_metrics_use_vllms_names(server):
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "hf_paged:num_rope_recomputes_total"):
        assert name in text


GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [
    ("truncated json", "/v1/completions", b'{"model": "tiny", "prompt": "hi"', 400),
    ("not json", "/v1/completions", b"hello", 400),
    ("array body", "/v1/completions", b'[{"model": "tiny"}]', 400),
    ("string body", "/v1/completions", b'"tiny"', 400),
    ("empty body", "/v1/completions", b"", 400),
    ("invalid utf-8", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400),
    ("10 MB body", "/v1/completions", json.dumps({**GOOD, "prompt": "a" * 10_000_000}).encode(), 413),
    ("deep nesting", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400),
    ("max_tokens -1", "/v1/completions", {**GOOD, "max_tokens": -1}, 400),
    ("max_tokens 1e9", "/v1/completions", {**GOOD, "max_tokens": 1e9}, 400),
    ("max_tokens huge int", "/v1/completions", {**GOOD, "max_tokens": 10**9}, 400),
    ("max_tokens string", "/v1/completions", {**GOOD, "max_tokens": "4"}, 400),
    ("NaN temperature", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400),
    ("infinite temperature", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', 400),
    ("temperature 5", "/v1/completions", {**GOOD, "temperature": 5}, 400),
    ("top_p 0", "/v1/completions", {**GOOD, "top_p": 0}, 400),
    ("n 1000", "/v1/completions", {**GOOD, "n": 1000}, 400),
    ("n 0", "/v1/completions", {**GOOD, "n": 0}, 400),
    ("unknown field", "/v1/completions", {**GOOD, "frobnicate": True}, 400),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-9"}, 404),
    ("missing model", "/v1/completions", {"prompt": "hi"}, 400),
    ("empty prompt", "/v1/completions", {**GOOD, "prompt": ""}, 400),
    ("empty token list", "/v1/completions", {**GOOD, "prompt": []}, 400),
    ("ids out of vocabulary", "/v1/completions", {**GOOD, "prompt": [1, 2, 10**7]}, 400),
    ("negative id", "/v1/completions", {**GOOD, "prompt": [-5]}, 400),
    ("prompt object", "/v1/completions", {**GOOD, "prompt": {"a": 1}}, 400),
    ("prompt too long", "/v1/completions", {**GOOD, "prompt": [5] * 300}, 400),
    ("logit_bias bad key", "/v1/completions", {**GOOD, "logit_bias": {"abc": 1}}, 400),
    ("logit_bias id out of vocab", "/v1/completions", {**GOOD, "logit_bias": {"99999999": 1}}, 400),
    ("logit_bias value 1000", "/v1/completions", {**GOOD, "logit_bias": {"5": 1000}}, 400),
    ("logit_bias list", "/v1/completions", {**GOOD, "logit_bias": [1, 2]}, 400),
    ("stop too many", "/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("stop number", "/v1/completions", {**GOOD, "stop": 5}, 400),
    ("logprobs 50", "/v1/completions", {**GOOD, "logprobs": 50}, 400),
    ("stream_options without stream", "/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400),
    ("presence_penalty 9", "/v1/completions", {**GOOD, "presence_penalty": 9}, 400),
    ("seed float", "/v1/completions", {**GOOD, "seed": 1.5}, 400),
    ("user number", "/v1/completions", {**GOOD, "user": 5}, 400),
    ("chat no messages", "/v1/chat/completions", {"model": "tiny"}, 400),
    ("chat empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400),
    ("chat bad role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("chat content not string", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400),
    ("chat messages object", "/v1/chat/completions", {**CHAT, "messages": {"role": "user"}}, 400),
    ("chat top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400),
    ("unknown route", "/v1/embeddings", GOOD, 404),
]


def test_malformed_and_hostile_requests_get_openai_shaped_4xx_and_the_server_keeps_serving(server):
    assert len(BAD) >= 30
    for name, path, body, status in BAD:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(server.url + path, content=content, timeout=60,
                       headers={**server.headers, "Content-Type": "application/json"})
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert isinstance(error["message"], str) and "Traceback" not in r.text, name
    assert server.post("/v1/completions", json=GOOD).status_code == 200
    assert server.post("/v1/chat/completions", json=CHAT).status_code == 200


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_a_client_that_disconnects_mid_stream_frees_its_request(server):
    body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 64, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (_metric(server, "vllm:num_requests_running") > 0
                                           or _metric(server, "vllm:kv_cache_usage_perc") > 0):
        time.sleep(0.1)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0


def test_a_full_server_answers_429_with_retry_after(model_dir):
    import threading

    s = Served(model_dir, "--max-waiting", "1")
    try:
        long = {"model": "tiny", "prompt": "a", "max_tokens": 64, "temperature": 0}
        first = threading.Thread(target=lambda: s.post("/v1/completions", json=long))
        first.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _metric(s, "hf_paged:requests_in_flight") < 1:
            time.sleep(0.01)
        r = s.post("/v1/completions", json=long)
        first.join()
        assert r.status_code == 429 and r.headers["Retry-After"] == "1" and r.json()["error"]["type"]
    finally:
        assert s.stop() == 0


def test_sigterm_drains_in_flight_requests_and_exits_0(model_dir):
    import threading

    s = Served(model_dir)
    box = {}
    body = {"model": "tiny", "prompt": "a", "max_tokens": 64, "temperature": 0}
    t = threading.Thread(target=lambda: box.setdefault("r", s.post("/v1/completions", json=body)))
    t.start()
    time.sleep(0.3)
    assert s.stop() == 0
    t.join()
    assert box["r"].status_code == 200 and box["r"].json()["usage"]["completion_tokens"] >= 1


def test_no_key_on_a_public_host_warns_at_start(model_dir):
    s = Served(model_dir, key=None, host="0.0.0.0")
    try:
        assert httpx.post(s.url + "/v1/completions", json=GOOD, timeout=60).status_code == 200
    finally:
        s.stop()
    err = s.stderr()
    assert "WARNING" in err and "--api-key" in err
