"""`response_format` and `tools` through the real openai client against `hf-paged serve default` (SmolLM2):
the answers parse and validate, streamed and not; bad schemas and tools are 400s that name the problem."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("openai")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(served_default):
    return served_default  # conftest's, shared with test_tools_first_hour.py


def _json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def _streamed(client, **kwargs):
    """The joined content, tool calls (merged by index, as the openai SDK's users do) and finish reason."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
                assert entry["id"] is None or call.id is None  # the id (and name) come once, first
                entry["id"] = call.id or entry["id"]
                entry["name"] += (call.function.name or "") if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
                entry["pieces"] += bool(call.function and call.function.arguments)
            reason = choice.finish_reason or reason
    return content, [calls[k] for k in sorted(calls)], reason


@pytest.mark.slow
def test_a_json_schema_response_format_parses_and_validates_streamed_and_not(server):
    client = server.client()
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Invent a person; answer as JSON."}],
                  response_format=_json_schema_format(PERSON), max_tokens=96, temperature=0)
    answer = client.chat.completions.create(**kwargs)
    text = answer.choices[0].message.content
    jsonschema_rs.validate(PERSON, json.loads(text))
    assert answer.choices[0].finish_reason == "stop"
    streamed, calls, reason = _streamed(client, **kwargs)
    assert streamed == text and calls == [] and reason == "stop"
    obj = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Describe a cat in JSON."}],
                                         response_format={"type": "json_object"}, max_tokens=96, temperature=0,
                                         seed=3)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_a_tools_call_returns_a_valid_tool_calls_entry_streamed_and_not(server, tool_choice):
    client = server.client()
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
                  tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=96, temperature=0)
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema_rs.validate(schema, json.loads(call.function.arguments))
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    content, calls, reason = _streamed(client, **kwargs)
    # Streamed as OpenAI streams calls: the arguments in pieces as they are generated, which join to
    # exactly the non-streamed arguments.
    assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert all(c["pieces"] >= 2 for c in calls), calls
    # The call goes back in the conversation with the tool's answer: the server takes it.
    follow = client.chat.completions.create(model="tiny", max_tokens=16, temperature=0, tools=[WEATHER, TIME], messages=[
        {"role": "user", "content": "What is the weather in Paris, in celsius?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}])
    assert follow.choices[0].message.content is not None or follow.choices[0].message.tool_calls


@pytest.mark.slow
def test_tool_choice_auto_answers_text_or_valid_calls(server):
    answer = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "What time is it in Tokyo? Use a tool."}],
        tools=[WEATHER, TIME], max_tokens=96, temperature=0)
    choice = answer.choices[0]
    if choice.message.tool_calls:  # the model chose to call: every call is well formed
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
            jsonschema_rs.validate(schema, json.loads(call.function.arguments))
    elif choice.finish_reason == "stop":  # text: no unparsed call left in it
        assert choice.message.content and "<tool_call>" not in choice.message.content


@pytest.mark.slow
@pytest.mark.parametrize("body,error", [
    ({"response_format": _json_schema_format({"type": "no-such-type"})}, "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "'name'"),
    ({"response_format": {"type": "yaml"}}, "'response_format'"),
    ({"response_format": _json_schema_format([1, 2])}, "JSON Schema object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools\\[0\\].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "given twice"),
    ({"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "JSON Schema of an object"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_bad_schemas_and_tools_are_400s_that_name_the_problem(server, body, error):
    r = server.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 8,
                                                  "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert __import__("re").search(error, r.json()["error"]["message"]), r.json()
    assert server.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}]}).status_code == 200


@pytest.mark.slow
def test_strict_keywords_the_grammar_cannot_enforce_are_a_400_and_best_effort_says_so(server):
    schema = {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 3, "uniqueItems": True}

    def ask(strict):
        return server.post("/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 24, "messages": [{"role": "user", "content": "Three digits."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": schema, "strict": strict}}})

    refused = ask(True)
    assert refused.status_code == 400 and "uniqueItems" in refused.json()["error"]["message"]
    served = ask(False)
    assert served.status_code == 200 and "uniqueItems" in served.headers["warning"]
    assert isinstance(json.loads(served.json()["choices"][0]["message"]["content"]), list)
