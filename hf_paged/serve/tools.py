"""Structured outputs in the OpenAI API: `response_format` and `tools` / `tool_choice`.

Both become the request's `StructuredOutputs` (`SamplingParams.structured`), so the engine masks every
token that would break them:

* `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object), or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (a value valid against it).
* `tools` with `tool_choice`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (the Hermes / Qwen form), the arguments held to the function's `parameters` schema by an xgrammar
  structural tag. `"auto"` lets the model write text or calls, `"required"` makes it call at least one
  tool, `{"type": "function", "function": {"name": ...}}` makes it call that one, `"none"` leaves the
  output free (and unparsed). The answer's `tool_calls` are parsed back out of the text.

The model's chat template renders the tools. A template that does not take `tools` gets them as a
system message in the same Hermes form (`tools_system_prompt`).
"""

from __future__ import annotations

import json
import re
import uuid

from ..structured_outputs import StructuredOutputs
from .api_error import APIError

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_CHOICES = ("none", "auto", "required")


def response_format(value) -> StructuredOutputs | None:
    """The constraint of a `response_format` (None: free text). APIError 400 names what is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "'response_format' must be an object whose 'type' is 'text', 'json_object' or "
                            "'json_schema'", param="response_format")
    kind = value["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    if set(value) - allowed:
        raise APIError(400, f"'response_format' has unknown field(s) {sorted(set(value) - allowed)}",
                       param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not _NAME.fullmatch(spec["name"]):
        raise APIError(400, "'response_format.json_schema' must be an object with a 'name' (letters, digits, "
                            "'_' or '-', at most 64)", param="response_format.json_schema")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise APIError(400, f"'response_format.json_schema' has unknown field(s) {sorted(unknown)}",
                       param="response_format.json_schema")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise APIError(400, "'response_format.json_schema.schema' must be a JSON Schema object",
                       param="response_format.json_schema.schema")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise APIError(400, "'response_format.json_schema.strict' must be a boolean",
                       param="response_format.json_schema.strict")
    return StructuredOutputs(json=schema)  # strict or not, the output is held to the schema


def tools(value) -> list[dict] | None:
    """The request's `tools`, checked: each `{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}`."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise APIError(400, "'tools' must be a non-empty array", param="tools")
    out, names = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise APIError(400, f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where)
        fn = tool.get("function")
        if not isinstance(fn, dict) or set(fn) - {"name", "description", "parameters", "strict"}:
            raise APIError(400, f"{where}.function must be an object with 'name', and optionally 'description', "
                                "'parameters' and 'strict'", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(400, f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'",
                           param=f"{where}.function.name")
        if name in names:
            raise APIError(400, f"{where}.function.name {name!r} is given twice", param=f"{where}.function.name")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise APIError(400, f"{where}.function.description must be a string", param=f"{where}.function.description")
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON Schema object",
                           param=f"{where}.function.parameters")
        out.append({"type": "function", "function": {**{k: fn[k] for k in ("name", "description") if k in fn},
                                                     "parameters": parameters}})
    return out


def tool_choice(value, given: list[dict] | None):
    """"none", "auto", "required", or the name of the one function to call."""
    if value is None:
        return "auto" if given else "none"
    if given is None:
        raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    if value in TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if name in {t["function"]["name"] for t in given}:
            return {"name": name}
        raise APIError(400, f"'tool_choice' names the function {name!r}, which is not in 'tools'", param="tool_choice")
    raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                        "{'name': ...}}", param="tool_choice")


def tool_constraint(given: list[dict], choice, parallel: bool) -> StructuredOutputs | None:
    """The structural tag that holds the output to the tools' call form (None for "none")."""
    if choice == "none":
        return None
    chosen = [t for t in given if not isinstance(choice, dict) or t["function"]["name"] == choice["name"]]
    tags = [{"type": "tag", "begin": f'<tool_call>{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": t["function"]["parameters"]},
             "end": "}</tool_call>"} for t in chosen]
    forced = choice != "auto"
    return StructuredOutputs(structural_tag={"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
        "at_least_one": forced, "stop_after_first": forced and not parallel}})


def message_fields(message: dict, where: str) -> dict:
    """A chat message's tool fields, checked: an assistant's `tool_calls` (each `{"id", "type": "function",
    "function": {"name", "arguments"}}` with `arguments` a JSON string, as the API returns them, parsed
    here into an object for the chat template), a tool message's `tool_call_id`."""
    out = {}
    if message["role"] == "tool" and "tool_call_id" not in message:
        raise APIError(400, f"{where}: a 'tool' message needs the 'tool_call_id' it answers", param=where)
    if "tool_call_id" in message:
        if message["role"] != "tool" or not isinstance(message["tool_call_id"], str):
            raise APIError(400, f"{where}.tool_call_id must be a string, on a 'tool' message", param=f"{where}.tool_call_id")
        out["tool_call_id"] = message["tool_call_id"]
    calls = message.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list) or not calls:
        raise APIError(400, f"{where}.tool_calls must be a non-empty array", param=f"{where}.tool_calls")
    checked = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        args = None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except ValueError:
                args = None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(args, dict):
            raise APIError(400, f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', 'function': "
                                "{'name', 'arguments': <a JSON object as a string>}}", param=f"{where}.tool_calls[{j}]")
        checked.append({"id": str(call.get("id", "")), "type": "function",
                        "function": {"name": fn["name"], "arguments": args}})
    out["tool_calls"] = checked
    return out


def plain_messages(messages: list[dict]) -> list[dict]:
    """The messages for a chat template that knows no tools: an assistant's calls become its
    `<tool_call>` text, a tool's result a `<tool_response>` block."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "".join("<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                                      ensure_ascii=False) + "</tool_call>" for c in calls)
            m["content"] = (m["content"] + "\n" if m["content"] else "") + text
        if m.pop("tool_call_id", None) is not None or m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    return out


def template_inputs(messages: list[dict], given: list[dict] | None, template) -> tuple[list[dict], dict]:
    """The messages and extra keywords for `apply_chat_template`: a template that takes `tools` gets them
    (and the messages' tool fields) as they are; another gets the Hermes system prompt and plain text."""
    source = json.dumps(template) if not isinstance(template, str) else template
    if "tool" in (source or ""):
        return messages, ({"tools": given} if given else {})
    messages = plain_messages(messages)
    return (with_tools(messages, given) if given else messages), {}


def answer(text: str, reason: str | None, choice) -> tuple[dict, str | None]:
    """An answer's chat `message` fields (content, and `tool_calls` when the model called tools under
    `choice`), and its finish reason ("tool_calls" for one that ended by calling)."""
    if choice == "none":
        return {"content": text}, reason
    content, calls = split_tool_calls(text)
    if not calls:
        return {"content": content}, reason
    return {"content": content, "tool_calls": calls}, ("tool_calls" if reason == "stop" else reason)


def tools_system_prompt(given: list[dict]) -> str:
    """The tools in the Hermes form, for a chat template that does not render `tools` itself."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in given)
    return ("You may call one or more functions to assist with the user query. The functions are listed "
            f"within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return a "
            'JSON object with the function name and arguments within <tool_call></tool_call> XML tags:\n'
            '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>')


def with_tools(messages: list[dict], given: list[dict]) -> list[dict]:
    """`messages` with the tools prepended to (or as) the system message."""
    prompt = tools_system_prompt(given)
    if messages and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The content and OpenAI `tool_calls` of an answer: each well-formed `<tool_call>` block becomes a
    call (arguments as a JSON string); the text around them is the content (None when empty)."""
    calls = []
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict):
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(call["arguments"],
                                                                                      ensure_ascii=False)}})
    if not calls:
        return text, []
    content = _CALL.sub("", text).strip()
    return content or None, calls
