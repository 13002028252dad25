"""Tool calls and schemas in the OpenAI front, without a server: every malformed body is a 400 that
names the problem (type confusion, nesting at any depth), `strict` means enforced, tool calls are read
back along the grammar's structure in the model's own form, and the grammar built for each form holds
what the parser reads (checked with xgrammar's matcher on SmolLM2's tokenizer)."""

from __future__ import annotations

import json
import random

import pytest

from hf_paged.config import MAX_JSON_DEPTH
from hf_paged.serve import tool_calls, tools
from hf_paged.serve.api_error import APIError
from hf_paged.serve.openai_protocol import Limits, decode_body, parse
from hf_paged.structured_outputs import StructuredOutputs

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"], "additionalProperties": False}}}


def _chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def _parse(body: dict, fmt=tool_calls.HERMES):
    return parse("chat", body, ["m"], Limits(), 49152, fmt)


def _refused(body, match: str) -> APIError:
    with pytest.raises(APIError) as info:
        _parse(body)
    assert info.value.status == 400 and match in info.value.message, info.value.message
    return info.value


def _nested(depth: int, leaf=None):
    value = leaf if leaf is not None else 1
    for _ in range(depth):
        value = {"a": value}
    return value


# ------------------------------------------------------------------ 4xx for every malformed body
@pytest.mark.parametrize("name", [["get_weather"], {"x": 1}, 3, None])
def test_a_tool_choice_naming_a_non_string_is_a_400(name):
    _refused(_chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": name}}),
             "must be a string")


def test_deep_bodies_arguments_and_parameters_are_400s_naming_the_depth_limit():
    for depth in (MAX_JSON_DEPTH + 1, 980, 5000):
        raw = json.dumps(_chat(tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": _nested(MAX_JSON_DEPTH)}}}]))
        if depth >= 980:  # beyond what json.dumps nests: write the text by hand
            raw = '{"model": "m", "x": ' + "[" * depth + "]" * depth + "}"
        with pytest.raises(APIError) as info:
            decode_body(raw.encode())
        assert info.value.status == 400 and "nested deeper" in info.value.message
    # An assistant's call arguments are a JSON string inside a shallow body: checked on their own.
    deep_args = "[" * 5000 + "]" * 5000
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": deep_args}}
    _refused(_chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                                 "tool_calls": [call]}]), "nested deeper")
    # A body built in Python (not through decode_body) with deep parameters: still a 400, no RecursionError.
    _refused(_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": _nested(3000)}}}], tool_choice="required"), "nested deeper")


def test_python_api_deep_schemas_are_value_errors_not_recursion_errors():
    with pytest.raises(ValueError, match="nested deeper"):
        StructuredOutputs(json=_nested(5000)).validate()
    with pytest.raises(ValueError, match="nested deeper"):
        StructuredOutputs(json="[" * 5000 + "]" * 5000).validate()
    with pytest.raises(ValueError, match="MAX_GRAMMAR_BYTES"):
        StructuredOutputs(json={"enum": [f"value-{i}" for i in range(50_000)]}).validate()


# ------------------------------------------------------------------ strict means enforced
@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"enum": ["a"], "not": {"const": "a"}}, "not"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]},
      "then": {"required": ["b"]}}, "if"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "allOf"),
    ({"type": "object", "properties": {"deep": {"type": "array", "items": {"uniqueItems": True}}}}, "uniqueItems"),
])
def test_a_strict_schema_with_a_keyword_the_grammar_cannot_enforce_is_a_400_listing_it(schema, keyword):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    _refused(_chat(response_format=fmt), keyword)
    tool = {"type": "function", "function": {"name": "f", "strict": True,
                                             "parameters": {"type": "object", "properties": {"v": schema}}}}
    _refused(_chat(tools=[tool]), keyword)
    with pytest.raises(ValueError, match=keyword):
        StructuredOutputs(json=schema, strict=True).validate()
    # Not strict: held as far as the backend can, and the request says so.
    fmt["json_schema"]["strict"] = False
    p = _parse(_chat(response_format=fmt))
    assert p.structured is not None and keyword in " ".join(p.warnings)
    StructuredOutputs(json=schema).validate()


def test_a_strict_schema_of_enforced_keywords_passes_without_warnings():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "s": {"type": "string", "pattern": "^a+$", "format": "date"},
                                               "l": {"type": "array", "items": {"$ref": "#/$defs/x"}, "maxItems": 2}},
              "$defs": {"x": {"anyOf": [{"type": "boolean"}, {"const": 3}]}}, "required": ["n"],
              "additionalProperties": False}
    p = _parse(_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                             "strict": True}}))
    assert p.structured.strict and p.warnings == []


@pytest.mark.parametrize("ref", ["https://example.com/s.json", "other.json#/a", 3])
def test_a_remote_ref_is_a_400(ref):
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
    _refused(_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}), "$ref")
    _refused(_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}]), "$ref")
    with pytest.raises(ValueError, match=r"\$ref"):
        StructuredOutputs(json=schema).validate()


# ------------------------------------------------------------------ tools checked
@pytest.mark.parametrize("parameters", [{"type": "integer"}, {"type": "array"}, {"type": "nonsense"}, [1]])
def test_non_object_parameters_are_a_400(parameters):
    _refused(_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}]),
             "JSON Schema of an object")


def test_a_tool_message_must_answer_a_call_of_the_conversation():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
    assert _parse(_chat(messages=ok, tools=[WEATHER])).messages[2]["tool_call_id"] == "call_1"
    _refused(_chat(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": "1"}]),
             "no preceding assistant")
    _refused(_chat(messages=ok[:2] + [{"role": "tool", "tool_call_id": "call_2", "content": "1"}]),
             "no preceding assistant")
    _refused(_chat(messages=ok + [{"role": "tool", "tool_call_id": "call_1", "content": "again"}]),
             "answered already")
    no_id = dict(call)
    del no_id["id"]
    _refused(_chat(messages=[ok[0], {"role": "assistant", "content": None, "tool_calls": [no_id]}]), "'id'")


# ------------------------------------------------------------------ calls read along the structure
def test_arguments_holding_the_close_tag_are_read_as_arguments():
    args = '{"city": "Paris </tool_call> {x} \\" ]", "n": [1, {"a": "\\\\"}]}'
    text = f'Sure.<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    content, calls = tool_calls.split(text, tool_calls.HERMES)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["function"]["arguments"] == args and json.loads(args)["city"].startswith("Paris </tool_call>")


@pytest.mark.parametrize("fmt", list(tool_calls.FORMATS.values()), ids=list(tool_calls.FORMATS))
def test_streamed_deltas_in_any_cut_join_to_the_whole_answer(fmt):
    def call(name, args):
        return fmt.begin + name + fmt.between + args + fmt.end

    text = "Let me check. " + call("get_weather", '{"city": "Rome {}", "d": [1, 2]}') + " " + call("get_time", "{}")
    whole_content, whole_calls = tool_calls.split(text, fmt)
    assert [c["function"]["name"] for c in whole_calls] == ["get_weather", "get_time"]
    rng = random.Random(0)
    for _ in range(50):
        parser, deltas, at = tool_calls.ToolCallParser(fmt), [], 0
        while at < len(text):
            step = rng.randint(1, 6)
            deltas += parser.feed(text[at:at + step])
            at += step
        deltas += parser.finish()
        names, args, ids = {}, {}, {}
        for d in deltas:
            for c in d.get("tool_calls", ()):
                if "id" in c:  # the opening comes first, with the whole name, before any argument
                    assert c["index"] not in names and c["index"] not in args
                    names[c["index"]], ids[c["index"]] = c["function"]["name"], c["id"]
                args[c["index"]] = args.get(c["index"], "") + c["function"]["arguments"]
        assert [names[k] for k in sorted(names)] == ["get_weather", "get_time"]
        assert [args[k] for k in sorted(args)] == [c["function"]["arguments"] for c in whole_calls]
        assert "".join(d.get("content", "") for d in deltas).strip() == whole_content


def test_text_that_only_looks_like_an_opening_stays_content():
    for text in ("a <tool_ca b", "<tool_call>\n{\"name\": \"bad name\"", "x <tool_call> y"):
        content, calls = tool_calls.split(text, tool_calls.HERMES)
        assert calls == [] and content == text


@pytest.mark.parametrize("template,expected", [
    ("{% for m in messages %}<|im_start|>{{ m.content }}{% if tools %}<tool_call>{% endif %}{% endfor %}", "hermes"),
    ("<|start_header_id|>ipython<|end_header_id|> Respond in the format {\"name\": function name, \"parameters\": "
     "dictionary of argument name and its value}", "llama3_json"),
    ("{{ bos_token }}[AVAILABLE_TOOLS] {{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS] {{ calls }}", "mistral"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]{{ name }}[ARGS]{{ args }}", "mistral_args"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    (None, "hermes"),
])
def test_the_format_follows_the_chat_template(template, expected):
    assert tool_calls.format_for_template(template).name == expected


# ------------------------------------------------------------------ the grammar holds what the parser reads
@pytest.fixture(scope="module")
def compiler():
    xgr = pytest.importorskip("xgrammar")
    from hf_paged.defaults.models import load_default_tokenizer

    tok = load_default_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152, stop_token_ids=[tok.eos_token_id])
    return xgr, tok, xgr.GrammarCompiler(info, cache_enabled=False)


def _accepts(compiler, spec: StructuredOutputs, text: str) -> bool:
    xgr, tok, c = compiler
    matcher = xgr.GrammarMatcher(c.compile_structural_tag(json.dumps(spec.structural_tag)))
    for token in tok.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return matcher.accept_token(tok.eos_token_id)


@pytest.mark.parametrize("fmt", list(tool_calls.FORMATS.values()), ids=list(tool_calls.FORMATS))
def test_each_forms_grammar_accepts_its_calls_and_the_parser_reads_them_back(compiler, fmt):
    given = [WEATHER, TIME]
    one = fmt.begin + "get_weather" + fmt.between + '{"city": "Oslo"}' + fmt.end
    two = one + fmt.separator + fmt.begin + "get_time" + fmt.between + '{"zone": "CET"}' + fmt.end
    for choice in ("auto", "required"):
        spec = tool_calls.constraint(fmt, given, choice, parallel=True)
        assert _accepts(compiler, spec, one) and _accepts(compiler, spec, two)
        assert not _accepts(compiler, spec, fmt.begin + "get_weather" + fmt.between + '{"town": "Oslo"}' + fmt.end)
    named = tool_calls.constraint(fmt, given, {"name": "get_time"}, parallel=True)
    assert not _accepts(compiler, named, one)
    assert [c["function"]["arguments"] for c in tool_calls.split(two, fmt)[1]] == ['{"city": "Oslo"}', '{"zone": "CET"}']


@pytest.mark.parametrize("choice", ["auto", "required", {"name": "get_weather"}])
def test_parallel_tool_calls_false_allows_one_call_under_every_choice(compiler, choice):
    fmt = tool_calls.HERMES
    call = fmt.begin + "get_weather" + fmt.between + '{"city": "Oslo"}' + fmt.end
    spec = tool_calls.constraint(fmt, [WEATHER, TIME], choice, parallel=False)
    two = call + fmt.separator + call
    assert _accepts(compiler, spec, call)
    assert not _accepts(compiler, spec, call + call) and not _accepts(compiler, spec, two)
    # With parallel calls, "auto" and "required" take two; a named function is called once whatever.
    assert _accepts(compiler, tool_calls.constraint(fmt, [WEATHER, TIME], choice, parallel=True),
                    two) != isinstance(choice, dict)
    body = _chat(tools=[WEATHER, TIME], parallel_tool_calls=False,
                 tool_choice={"type": "function", "function": choice} if isinstance(choice, dict) else choice)
    assert _parse(body).structured == spec


# ------------------------------------------------------------------ issue 53: calls only, cut calls, streamed text
@pytest.mark.parametrize("fmt", list(tool_calls.FORMATS.values()), ids=list(tool_calls.FORMATS))
def test_required_and_named_choices_start_the_grammar_at_the_call(compiler, fmt):
    """A prose preamble (or text after the calls) is refused from the first token: `content` is null."""
    call = fmt.begin + "get_weather" + fmt.between + '{"city": "Oslo"}' + fmt.end
    for choice in ("required", {"name": "get_weather"}):
        spec = tool_calls.constraint(fmt, [WEATHER, TIME], choice, parallel=True)
        assert _accepts(compiler, spec, call)
        assert not _accepts(compiler, spec, "Sure. " + call) and not _accepts(compiler, spec, call + " Done.")
        message, reason = tools.answer(call, "stop", choice, fmt)
        assert message["content"] is None and reason == "tool_calls"
    # "auto" still lets the model answer in text first.
    assert _accepts(compiler, tool_calls.constraint(fmt, [WEATHER, TIME], "auto", parallel=True), "Sure. " + call)


@pytest.mark.parametrize("fmt", list(tool_calls.FORMATS.values()), ids=list(tool_calls.FORMATS))
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_call_cut_short_never_leaves_markup_in_content(fmt, choice):
    """Cut at every character: the content is the text before the call (or None), never a piece of the
    markup; a call whose name is whole comes back with the arguments it has, streamed and not alike."""
    before = "Let me check. " if choice == "auto" else ""
    args = '{"city": "Oslo"}'
    text = before + fmt.begin + "get_weather" + fmt.between + args + fmt.end
    name_end = len(before + fmt.begin + "get_weather" + fmt.between)
    for cut in range(len(before) + 1, len(text)):
        message, reason = tools.answer(text[:cut], "length", choice, fmt)
        assert reason == "length"
        content = message["content"]
        assert content is None or before.startswith(content), (cut, content)
        calls = message.get("tool_calls", [])
        if cut >= name_end:
            assert [c["function"]["name"] for c in calls] == ["get_weather"]
            assert args.startswith(calls[0]["function"]["arguments"])
        else:
            assert calls == []
        parser = tool_calls.ToolCallParser(fmt, tool_calls.forces_calls(choice))
        deltas = [d for k in range(cut) for d in parser.feed(text[k])] + parser.finish(cut=True)
        streamed = "".join(d.get("content", "") for d in deltas)
        assert streamed.strip() == (content or "").strip(), (cut, streamed)
        assert not (choice == "required" and streamed)


def test_text_streams_as_it_arrives_and_only_a_possible_opening_waits():
    parser = tool_calls.ToolCallParser(tool_calls.HERMES)
    for piece in ("The", " capital", " is", " Paris", "."):
        assert parser.feed(piece) == [{"content": piece}]
    assert parser.feed(" <tool") == [{"content": " "}]  # "<tool" may open a call: held
    assert parser.feed("box>") == [{"content": "<toolbox>"}]
    assert parser.feed(" <tool_call>\n{") == [{"content": " "}]
    assert parser.feed('"name": "get_time", "arguments": ')[0]["tool_calls"][0]["function"]["name"] == "get_time"
    assert parser.finish(cut=True) == [] and parser.content == "The capital is Paris. <toolbox> "
