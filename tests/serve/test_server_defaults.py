"""`hf-paged serve`'s defaults as a newcomer meets them (issue 53): a chat request without `max_tokens`
may use the rest of the context (OpenAI's and vLLM's default; completions keep 16); vLLM's sampling
extensions (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens`) are accepted, change the answer, and bad values are 400s naming the field; a
wrong model path or device or dtype is one line and exit 2 before anything loads; `--device` and
`--dtype` place the model; the start-up banner states what is served and how.

The requests go in process through the ASGI app (no server process to start), over the tiny random
Llama of `conftest.model_dir`."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")

from hf_paged.serve.openai_protocol import APIError, Limits, parse  # noqa: E402

CONTEXT = 64  # the served context: a default chat answer may take 64 - 31 prompt tokens
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "Once upon a time", "temperature": 0}
IM_START = 1  # "<|im_start|>": a special token that is not the end of sequence (SmolLM2's tokenizer)
EOS = 2  # "<|im_end|>"


@pytest.fixture(scope="module")
def client(model_dir):
    """The tiny model behind `Server` with the server's default caps, as `serve --max-model-len 64`."""
    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged import AsyncEngine, Engine
    from hf_paged.serve.api_server import Server

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="hf_paged")
    engine = AsyncEngine(Engine(model, tok, max_model_len=CONTEXT, show_progress=False))
    with TestClient(Server(engine, tok, "tiny", limits=Limits(max_model_len=CONTEXT)).app) as c:
        yield c
    asyncio.run(engine.shutdown(drain=False))


def _post(client, body, path="/v1/chat/completions"):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text[:500]
    return r.json()


def _text(client, **fields) -> str:
    return _post(client, {**COMPLETION, "max_tokens": 8, **fields}, "/v1/completions")["choices"][0]["text"]


def test_a_chat_request_without_max_tokens_may_use_the_rest_of_the_context(client):
    out = _post(client, CHAT)
    usage, reason = out["usage"], out["choices"][0]["finish_reason"]
    assert usage["completion_tokens"] > 16, usage  # before: cut at 16, mid-answer
    if reason == "length":  # the random model rarely ends: it ran to the end of the context
        assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT, usage
    streamed = client.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                          "stream_options": {"include_usage": True}})
    assert f'"completion_tokens":{usage["completion_tokens"]}' in streamed.text


def test_completions_keep_openais_default_of_16(client):
    out = _post(client, COMPLETION, "/v1/completions")
    assert out["usage"]["completion_tokens"] == 16 and out["choices"][0]["finish_reason"] == "length"


def test_the_max_tokens_defaults_and_the_cap_in_one_place():
    from hf_paged.serve.openai_protocol import max_tokens_for

    def resolved(kind, num_prompt_tokens, limits, **body):
        base = {"model": "m", **({"prompt": "x"} if kind == "completion" else
                                 {"messages": [{"role": "user", "content": "x"}]})}
        return max_tokens_for(parse(kind, {**base, **body}, ["m"], limits, 100), num_prompt_tokens, limits)

    open_ = Limits(max_model_len=100)
    assert open_.max_tokens == 100  # no --max-tokens: no cap but the context
    assert resolved("chat", 30, open_) == 70 and resolved("completion", 30, open_) == 16
    assert resolved("completion", 95, open_) == 5  # a default never asks more than the prompt leaves
    assert resolved("chat", 30, open_, max_tokens=70) == 70
    capped = Limits(max_model_len=100, max_tokens=20)  # --max-tokens 20
    assert resolved("chat", 30, capped) == 20 and resolved("completion", 30, capped) == 16
    assert resolved("chat", 30, Limits(max_model_len=100, default_max_tokens=8)) == 8  # --default-max-tokens
    assert resolved("completion", 30, Limits(max_model_len=100, default_max_tokens=8)) == 8
    for kind, prompt, limits, body, param, code in [
        ("chat", 30, open_, {"max_tokens": 71}, "messages", "context_length_exceeded"),
        ("completion", 100, open_, {}, "prompt", "context_length_exceeded"),
        ("chat", 30, capped, {"max_completion_tokens": 21}, "max_completion_tokens", None),
        ("chat", 30, capped, {"min_tokens": 21}, "min_tokens", None),
    ]:
        with pytest.raises(APIError) as info:
            resolved(kind, prompt, limits, **body)
        assert (info.value.status, info.value.param, info.value.code) == (400, param, code), info.value.message


def test_vllms_sampling_extensions_are_accepted_and_change_the_answer(client):
    greedy = _text(client)
    hot = dict(temperature=2.0, seed=7)
    assert _text(client, **hot) != greedy  # the precondition: sampling hot differs from greedy
    assert _text(client, **hot, top_k=1) == greedy  # only the most likely token is left
    assert _text(client, **hot, min_p=1.0) == greedy
    assert _text(client, **hot, top_k=-1) == _text(client, **hot) == _text(client, **hot, top_k=0)  # off
    # This random model never repeats a token within 8 (nothing for a penalty > 1 to act on); below 1
    # the penalty rewards what was seen, and the answer loops.
    assert _text(client, repetition_penalty=0.5) != greedy
    assert _text(client, repetition_penalty=1.0) == greedy


def test_min_tokens_ignore_eos_stop_token_ids_and_skip_special_tokens_do_what_vllm_does(client):
    def run(path="/v1/completions", **fields):
        body = {**(COMPLETION if path == "/v1/completions" else CHAT), "max_tokens": 6, **fields}
        out = _post(client, body, path)["choices"][0]
        return out, _post(client, body, path)["usage"]["completion_tokens"]

    to_eos = {"logit_bias": {str(EOS): 100}}  # the model would end at once
    assert run(**to_eos)[0]["finish_reason"] == "stop" and run(**to_eos)[1] == 1
    assert run(**to_eos, min_tokens=4)[1] == 5  # the end is masked for 4 tokens
    out, count = run(**to_eos, ignore_eos=True)
    assert (out["finish_reason"], count) == ("length", 6)
    to_start = {"logit_bias": {str(IM_START): 100}}  # a special token that does not end anything
    out, count = run(**to_start, stop_token_ids=[IM_START])
    assert (out["finish_reason"], count) == ("stop", 1)
    assert run(**to_start)[0]["text"] == ""  # special tokens are dropped from the text by default
    assert run(**to_start, skip_special_tokens=False)[0]["text"] == "<|im_start|>" * 6
    chat, _ = run("/v1/chat/completions", **to_start, skip_special_tokens=False, top_k=1, min_p=0.5,
                  repetition_penalty=1.0)
    assert chat["message"]["content"] == "<|im_start|>" * 6


@pytest.mark.parametrize("field, value", [
    ("top_k", -2), ("top_k", 1.5), ("top_k", "5"), ("top_k", True), ("top_k", 2**40),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", "0.1"),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", "2"),
    ("min_tokens", -1), ("min_tokens", 2.0),
    ("stop_token_ids", [100]), ("stop_token_ids", [-1]), ("stop_token_ids", 5), ("stop_token_ids", ["2"]),
    ("stop_token_ids", list(range(65))),
    ("ignore_eos", "yes"), ("skip_special_tokens", 1),
])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_bad_sampling_extensions_are_400s_naming_the_field(field, value, kind):
    body = {"model": "m", **({"prompt": "x"} if kind == "completion" else
                             {"messages": [{"role": "user", "content": "x"}]}), field: value}
    with pytest.raises(APIError) as info:
        parse(kind, body, ["m"], Limits(), 100)
    err = info.value
    assert (err.status, err.param) == (400, field) and "unknown field" not in err.message, err.message


def test_a_bad_extension_over_http_is_a_400_and_the_server_keeps_serving(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "repetition_penalty": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text
    assert _post(client, {**CHAT, "max_tokens": 2, "repetition_penalty": 1.2})["usage"]["completion_tokens"] == 2


@pytest.fixture
def nothing_loads(monkeypatch):
    from hf_paged.model_source import ModelFromPath

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(ModelFromPath, "__call__", refuse)


@pytest.mark.parametrize("argv, named", [
    (["/nonexistent/model"], "/nonexistent/model"),
    (["no-such-org/no-such-model"], "no-such-org/no-such-model"),  # a Hub id: refused offline, no download
    (["default", "--device", "tpu"], "--device"),
    (["default", "--device", "cuda:99"], "--device"),
    (["default", "--dtype", "float8"], "--dtype"),
    (["default", "--device", "cpu", "--tensor-parallel-size", "2"], "--device"),
    (["default", "--attention-backend", "cuda-magic"], "--attention-backend"),
])
def test_a_wrong_model_device_or_dtype_is_one_line_and_exit_2_before_loading(argv, named, capsys, nothing_loads):
    from hf_paged import parallel
    from hf_paged.serve.launch import main

    with pytest.raises(SystemExit) as info:
        main(argv, tensor_parallel=parallel)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and named in err and "Traceback" not in err, err


def test_device_and_dtype_place_the_model_and_the_banner_says_so(model_dir):
    from hf_paged.serve import launch

    launched = launch.prepare([str(model_dir), "--served-model-name", "tiny", "--device", "cpu", "--dtype",
                               "bfloat16", "--max-model-len", "64", "--num-blocks", "8", "--max-tokens", "32"])
    try:
        param = next(launched.client.engine.model.parameters())
        assert (param.device.type, param.dtype) == ("cpu", torch.bfloat16)
        first, second = launched.banner.splitlines()
        assert f"tiny ({model_dir}) on cpu, bfloat16" in first
        assert "KV pool 8 blocks x 16 tokens = 128 tokens (" in first and "max_model_len 64" in first
        assert "max_num_seqs 64" in first
        assert "max_tokens when not given: chat: the rest of the context, completions: 16" in second
        assert "at most 32 (--max-tokens)" in second and "http://127.0.0.1:8000" in second
        answer = launched.client.engine.generate([[5, 6, 7]])[0]  # it serves in bfloat16
        assert len(answer.token_ids) == 16
    finally:
        launched.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is the GPU there")
def test_the_default_placement_is_cpu_float32_and_the_banner_comes_before_serving(model_dir, monkeypatch, capsys):
    import uvicorn

    from hf_paged.serve.launch import main

    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: served.append(capsys.readouterr().err))
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main([str(model_dir), "--max-model-len", "64", "--num-blocks", "8", "--port", "8123"]) == 0
    finally:
        signal.signal(signal.SIGTERM, before)
    assert len(served) == 1 and "on cpu, float32" in served[0] and "no cap but the context" in served[0], served
    assert "http://127.0.0.1:8123" in served[0]
