"""`serve.openai_protocol` on its own (torch-free, no server): every field's accepted values reach
`Parsed` unchanged, and every bad value is an `APIError` with the documented status, the offending
`param`, and OpenAI's error shape."""

from __future__ import annotations

import math

import pytest

from hf_paged.serve.openai_protocol import (CHAT_FIELDS, COMPLETION_FIELDS, SAMPLING_FIELDS, APIError, Limits, Parsed,
                                            parse)

VOCAB = 100
LIMITS = Limits(max_tokens=64, max_n=4, max_stop=2, max_logprobs=5)


def completion(**fields):
    return parse("completion", {"model": "m", "prompt": "hi", **fields}, ["m"], LIMITS, VOCAB)


def chat(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse("chat", body, ["m"], LIMITS, VOCAB)


def refused(call, **fields) -> APIError:
    with pytest.raises(APIError) as info:
        call(**fields)
    err = info.value
    body = err.body()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] == str(err) and err.message
    return err


def test_defaults_of_a_minimal_completion():
    p = completion()
    assert p == Parsed(kind="completion", model="m", prompt="hi", max_tokens=None)  # resolved with the prompt
    assert (p.temperature, p.top_p, p.n, p.stop, p.seed, p.logprobs, p.stream) == (1.0, 1.0, 1, [], None, None, False)


def test_every_accepted_field_reaches_parsed():
    p = completion(max_tokens=64, temperature=0, top_p=0.5, n=4, stop=["a", "b"], seed=-(2**63),
                   presence_penalty=-2, frequency_penalty=2.0, logit_bias={"7": -100, " 8": 100.0}, user="u",
                   stream=True, stream_options={"include_usage": True}, logprobs=5)
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.stop, p.seed) == (64, 0.0, 0.5, 4, ["a", "b"], -(2**63))
    assert (p.presence_penalty, p.frequency_penalty, p.user) == (-2.0, 2.0, "u")
    assert p.logit_bias == {7: -100.0, 8: 100.0}
    assert p.stream and p.include_usage and p.logprobs == 5
    assert isinstance(p.temperature, float) and isinstance(p.presence_penalty, float)


def test_a_string_stop_becomes_a_list_and_token_prompts_are_kept():
    assert completion(stop="\n").stop == ["\n"]
    assert parse("completion", {"model": "m", "prompt": [0, 5, VOCAB - 1]}, ["m"], LIMITS, VOCAB).prompt == [
        0, 5, VOCAB - 1]


def test_chat_fields():
    p = chat(max_completion_tokens=9, logprobs=True, top_logprobs=5, stop="x")
    assert (p.kind, p.max_tokens, p.logprobs, p.stop, p.prompt) == ("chat", 9, 5, ["x"], None)
    assert p.messages == [{"role": "user", "content": "hi"}]
    assert chat(logprobs=True).logprobs == 0  # the chosen token only
    assert chat(logprobs=False).logprobs is None
    named = chat(messages=[{"role": "system", "content": "", "name": "s"}, {"role": "user", "content": "q"}])
    assert named.messages == [{"role": "system", "content": ""}, {"role": "user", "content": "q"}]
    assert chat(max_tokens=3).max_tokens == 3


def test_the_field_sets_differ_only_where_the_apis_do():
    assert COMPLETION_FIELDS - CHAT_FIELDS == {"prompt"}
    assert CHAT_FIELDS - COMPLETION_FIELDS == {"messages", "top_logprobs", "max_completion_tokens", "tools",
                                               "tool_choice", "parallel_tool_calls"}


@pytest.mark.parametrize("field,value,param", [
    ("max_tokens", 0, "max_tokens"), ("max_tokens", -1, "max_tokens"), ("max_tokens", 65, "max_tokens"),
    ("max_tokens", 1e9, "max_tokens"), ("max_tokens", "8", "max_tokens"), ("max_tokens", True, "max_tokens"),
    ("max_tokens", 8.0, "max_tokens"),
    ("temperature", math.nan, "temperature"), ("temperature", math.inf, "temperature"),
    ("temperature", -0.1, "temperature"), ("temperature", 2.01, "temperature"), ("temperature", "1", "temperature"),
    ("temperature", False, "temperature"),
    ("top_p", 0, "top_p"), ("top_p", 1.5, "top_p"), ("top_p", -math.inf, "top_p"),
    ("n", 0, "n"), ("n", 5, "n"), ("n", 1000, "n"), ("n", 2.5, "n"),
    ("presence_penalty", 2.5, "presence_penalty"), ("frequency_penalty", -3, "frequency_penalty"),
    ("seed", 2**63, "seed"), ("seed", "1", "seed"),
    ("stop", "", "stop"), ("stop", [""], "stop"), ("stop", ["a", 1], "stop"), ("stop", {"a": 1}, "stop"),
    ("stop", ["a", "b", "c"], "stop"),
    ("logit_bias", [1, 2], "logit_bias"), ("logit_bias", {"x": 1}, "logit_bias"),
    ("logit_bias", {"-1": 1}, "logit_bias"), ("logit_bias", {str(VOCAB): 1}, "logit_bias"),
    ("logit_bias", {"1.0": 1}, "logit_bias"), ("logit_bias", {"01": 1}, "logit_bias"),
    ("logit_bias", {"1": 101}, "logit_bias"), ("logit_bias", {"1": math.nan}, "logit_bias"),
    ("logit_bias", {"1": "5"}, "logit_bias"), ("logit_bias", {"1": True}, "logit_bias"),
    ("user", 5, "user"), ("stream", "yes", "stream"), ("stream", 1, "stream"),
    ("stream_options", {"include_usage": True}, "stream_options"),  # without stream: true
    ("logprobs", 6, "logprobs"), ("logprobs", -1, "logprobs"), ("logprobs", True, "logprobs"),
    ("prompt", "", "prompt"), ("prompt", [], "prompt"), ("prompt", [VOCAB], "prompt"), ("prompt", [-1], "prompt"),
    ("prompt", [1, "2"], "prompt"), ("prompt", [True], "prompt"), ("prompt", None, "prompt"),
    ("prompt", {"text": "x"}, "prompt"), ("prompt", ["a", "b"], "prompt"),
    ("model", None, "model"), ("model", "", "model"), ("model", 3, "model"),
])
def test_bad_completion_values_are_400s_naming_their_field(field, value, param):
    err = refused(completion, **{field: value})
    assert (err.status, err.param, err.type) == (400, param, "invalid_request_error")


def test_stream_options_must_be_an_object_of_include_usage():
    for bad in ([], {"include_usage": True, "x": 1}, "yes"):
        assert refused(completion, stream=True, stream_options=bad).param == "stream_options"
    assert refused(completion, stream=True, stream_options={"include_usage": "yes"}).param == "include_usage"


def test_unknown_models_are_404_and_unknown_fields_400():
    err = refused(completion, model="other")
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    err = refused(completion, best_of=2, echo=True)
    assert (err.status, err.param) == (400, "best_of") and "best_of, echo" in err.message
    assert refused(chat, prompt="x").param == "prompt"  # a completion field in a chat body
    assert refused(completion, messages=[]).param == "messages"


@pytest.mark.parametrize("body", [[1, 2], "text", 3, None, True])
def test_a_body_that_is_not_an_object_is_refused(body):
    with pytest.raises(APIError) as info:
        parse("completion", body, ["m"], LIMITS, VOCAB)
    assert info.value.status == 400 and "JSON object" in info.value.message


@pytest.mark.parametrize("messages,param", [
    (None, "messages"), ([], "messages"), ("hi", "messages"), ([{"role": "user"}], "messages[0]"),
    ([{"role": "tool", "content": "x"}], "messages[0]"), ([{"role": "user", "content": 5}], "messages[0]"),
    ([{"role": "user", "content": "a"}, "b"], "messages[1]"),
    ([{"role": "user", "content": "a", "tool_calls": []}], "messages[0]"),
])
def test_bad_chat_messages_name_the_message(messages, param):
    assert refused(chat, messages=messages).param == param


def test_chat_logprob_rules():
    assert refused(chat, top_logprobs=2).param == "top_logprobs"  # needs logprobs: true
    assert refused(chat, logprobs=True, top_logprobs=6).param == "top_logprobs"
    assert refused(chat, logprobs=1).param == "logprobs"
    assert refused(chat, max_completion_tokens=0).param == "max_completion_tokens"


def test_caps_come_from_limits():
    wide = Limits(max_tokens=10_000, max_n=64, max_stop=8)
    p = parse("completion", {"model": "m", "prompt": "x", "max_tokens": 10_000, "n": 64, "stop": list("abcdefgh")},
              ["m"], wide, VOCAB)
    assert (p.max_tokens, p.n, len(p.stop)) == (10_000, 64, 8)
    # completions cap logprobs at 5 (OpenAI's limit) even when the server allows more for chat
    with pytest.raises(APIError):
        parse("completion", {"model": "m", "prompt": "x", "logprobs": 6}, ["m"], Limits(max_logprobs=20), VOCAB)


def test_api_error_body_shape():
    err = APIError(429, "busy", type="rate_limit_error")
    assert err.body() == {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": None}}
    assert err.status == 429


@pytest.mark.parametrize("fields, flag", [
    ({"stop": ["a", "b", "c"]}, "--max-stop"),
    ({"stop": "x" * 33}, "--max-stop-chars"),
    ({"stop": ["ok", "y" * 33]}, "--max-stop-chars"),
    ({"logit_bias": {str(i): 1 for i in range(9)}}, "--max-logit-bias"),
])
def test_each_cap_is_a_400_that_names_its_flag(fields, flag):
    limits = Limits(max_stop=2, max_stop_chars=32, max_logit_bias=8)
    with pytest.raises(APIError) as info:
        parse("completion", {"model": "m", "prompt": "x", **fields}, ["m"], limits, VOCAB)
    assert info.value.status == 400 and flag in info.value.message
    at_cap = {"stop": ["z" * 32] * 2, "logit_bias": {str(i): 1 for i in range(8)}}
    assert parse("completion", {"model": "m", "prompt": "x", **at_cap}, ["m"], limits, VOCAB).stop == ["z" * 32] * 2


def test_a_huge_stop_list_is_refused_before_its_items_are_looked_at():
    stops = ["a"] * 100_000 + [None]  # a bad item past the cap: the count is what is reported
    assert "--max-stop" in refused(completion, stop=stops).message


def test_every_cap_is_a_server_flag_with_its_default():
    flags = {flag: default for _, flag, default, _ in Limits.flags()}
    assert flags["--max-stop-chars"] == Limits().max_stop_chars and flags["--max-logit-bias"] == Limits().max_logit_bias
    assert "--max-model-len" not in flags  # the model's, not a request cap default
    with pytest.raises(ValueError, match="max_stop"):
        Limits(max_stop=0)


@pytest.mark.parametrize("raw, where", [
    (b'{"model": "m", "prompt": "a\\ud800"}', "body.prompt"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', "body.messages[0].content"),
    (b'{"model": "m", "\\udc80": 1}', "a key of body"),
])
def test_decode_body_refuses_lone_surrogates_and_names_where(raw, where):
    from hf_paged.serve.openai_protocol import decode_body

    with pytest.raises(APIError) as info:
        decode_body(raw)
    assert info.value.status == 400 and info.value.message.startswith(where)
    assert decode_body(b'{"p": "\\ud83d\\ude00"}') == {"p": "\U0001F600"}  # a valid pair is one character


@pytest.mark.parametrize("raw", [b"\xff", b'{"a": ' + b"9" * 5000 + b"}", b"[" * 100_000, b"{", b""])
def test_decode_body_turns_what_python_cannot_parse_into_400(raw):
    from hf_paged.serve.openai_protocol import decode_body

    with pytest.raises(APIError) as info:
        decode_body(raw)
    assert info.value.status == 400


def test_the_openapi_document_describes_every_field_and_cap():
    from hf_paged.serve.openapi import openapi_document

    limits = Limits(max_stop=3, max_stop_chars=50, max_logit_bias=7)
    doc = openapi_document("m", limits, VOCAB)
    completion = doc["components"]["schemas"]["CompletionRequest"]
    chat = doc["components"]["schemas"]["ChatRequest"]
    assert set(completion["properties"]) == COMPLETION_FIELDS | SAMPLING_FIELDS
    assert set(chat["properties"]) == CHAT_FIELDS | SAMPLING_FIELDS
    stop = completion["properties"]["stop"]["oneOf"]
    assert stop[0]["maxLength"] == 50 and stop[1]["maxItems"] == 3
    assert completion["properties"]["logit_bias"]["maxProperties"] == 7
    assert set(doc["paths"]) == {"/health", "/v1/models", "/metrics", "/openapi.json", "/v1/completions",
                                 "/v1/chat/completions"}
    assert doc["paths"]["/health"]["get"]["security"] == []
