"""Structured outputs in the OpenAI API: `response_format` and `tools` / `tool_choice`.

Both become the request's `StructuredOutputs` (`SamplingParams.structured`), so the engine masks every
token that would break them:

* `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any JSON object), or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (a value valid against it).
* `tools` with `tool_choice`: each call is written in the model's own form (`tool_calls.py`: Hermes /
  Qwen `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`), the arguments held to the function's
  `parameters` schema by an xgrammar structural tag. `"auto"` lets the model write text or calls,
  `"required"` makes it call at least one tool and nothing else (the grammar starts at the call, so
  `content` is null), `{"type": "function", "function": {"name": ...}}` makes it call that one (content
  null too), `"none"` leaves the output free (and unparsed); `parallel_tool_calls: false` allows
  one call at most under each of them. The answer's `tool_calls` are read back along the same
  structure (`tool_calls.ToolCallParser`), streamed as OpenAI streams them.

`strict: true` (on a `json_schema` response format or a function) means enforced: a schema with a
keyword the grammar backend cannot enforce is a 400 that lists them. Without it the schema is held as
far as the backend can, and the response says which keywords were not enforced (a `Warning` header).

The model's chat template renders the tools. A template that does not take `tools` gets them as a
system message in the Hermes form (`tools_system_prompt`).
"""

from __future__ import annotations

import json
import re

from ..structured_outputs import StructuredOutputs, check_refs, load_json, unenforced_keywords
from . import tool_calls
from .api_error import APIError

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")


def _checked_schema(schema: dict, strict: bool, where: str, warnings: list[str]) -> None:
    """A caller's JSON schema: a remote `$ref` is a 400; keywords the grammar cannot enforce are a 400
    when `strict`, else a warning in `warnings`."""
    try:
        check_refs(schema, where)
    except ValueError as exc:
        raise APIError(400, str(exc), param=where) from None
    unenforced = unenforced_keywords(schema)
    if unenforced and strict:
        raise APIError(400, f"{where} is strict, but the grammar backend cannot enforce {', '.join(unenforced)}; "
                            "drop them or set 'strict': false (best effort)", param=where)
    if unenforced:
        warnings.append(f"{where}: not enforced: {', '.join(unenforced)}")


def response_format(value, warnings: list[str] | None = None) -> StructuredOutputs | None:
    """The constraint of a `response_format` (None: free text). APIError 400 names what is wrong; the
    keywords a non-strict schema uses that are not enforced are added to `warnings`."""
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
    strict = bool(spec.get("strict"))
    _checked_schema(schema, strict, "response_format.json_schema.schema", warnings if warnings is not None else [])
    out = StructuredOutputs(json=schema, strict=strict)
    try:
        out.validate()  # its size and depth limits
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param="response_format.json_schema.schema") from None
    return out


def tools(value, warnings: list[str] | None = None) -> list[dict] | None:
    """The request's `tools`, checked: each `{"type": "function", "function": {"name", "description",
    "parameters", "strict"}}`, its `parameters` a JSON Schema of an object (the arguments)."""
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
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise APIError(400, f"{where}.function.parameters must be the JSON Schema of an object (its "
                                "'type' is 'object'): a call's arguments are a JSON object",
                           param=f"{where}.function.parameters")
        parameters = {"type": "object", **parameters}
        if "strict" in fn and not isinstance(fn["strict"], (bool, type(None))):
            raise APIError(400, f"{where}.function.strict must be a boolean", param=f"{where}.function.strict")
        _checked_schema(parameters, bool(fn.get("strict")), f"{where}.function.parameters",
                        warnings if warnings is not None else [])
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
        if not isinstance(name, str):
            raise APIError(400, "'tool_choice.function.name' must be a string", param="tool_choice.function.name")
        if name in {t["function"]["name"] for t in given}:
            return {"name": name}
        raise APIError(400, f"'tool_choice' names the function {name[:80]!r}, which is not in 'tools'",
                       param="tool_choice")
    raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                        "{'name': ...}}", param="tool_choice")


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
                args = load_json(fn["arguments"], f"{where}.tool_calls[{j}].function.arguments")
            except ValueError as exc:
                if "nested deeper" in str(exc):
                    raise APIError(400, str(exc), param=f"{where}.tool_calls[{j}].function.arguments") from None
                args = None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(args, dict) \
                or not isinstance(call.get("id"), str) or not call["id"] or call.get("type", "function") != "function":
            raise APIError(400, f"{where}.tool_calls[{j}] must be {{'id': <string>, 'type': 'function', 'function': "
                                "{'name', 'arguments': <a JSON object as a string>}}", param=f"{where}.tool_calls[{j}]")
        checked.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
    out["tool_calls"] = checked
    return out


def check_tool_answers(messages: list[dict]) -> None:
    """Each tool message answers a call an earlier assistant message made, once (OpenAI's rule: a
    'tool' message must respond to a preceding message with 'tool_calls')."""
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            open_calls = {c["id"] for c in m.get("tool_calls", ())}
        elif m["role"] == "tool":
            if m["tool_call_id"] not in open_calls:
                raise APIError(400, f"messages[{i}] answers tool_call_id {m['tool_call_id'][:80]!r}, which no "
                                    "preceding assistant message's 'tool_calls' holds (or that was answered already)",
                               param=f"messages[{i}].tool_call_id")
            open_calls.discard(m["tool_call_id"])


def plain_messages(messages: list[dict]) -> list[dict]:
    """The messages for a chat template that knows no tools: an assistant's calls become its
    `<tool_call>` text, a tool's result a `<tool_response>` block."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                                        ensure_ascii=False) + "\n</tool_call>" for c in calls)
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


def answer(text: str, reason: str | None, choice, fmt: tool_calls.ToolCallFormat) -> tuple[dict, str | None]:
    """An answer's chat `message` fields (content, and `tool_calls` when the model called tools under
    `choice`), and its finish reason ("tool_calls" for one that ended by calling). Under "required" or a
    named function the content is None; an answer cut short keeps no markup in its content
    (`tool_calls.ToolCallParser.finish`)."""
    if choice == "none":
        return {"content": text}, reason
    content, calls = tool_calls.split(text, fmt, tool_calls.forces_calls(choice), cut=reason != "stop")
    if not calls:
        return {"content": content}, reason
    return {"content": content, "tool_calls": calls}, ("tool_calls" if reason == "stop" else reason)


def tools_system_prompt(given: list[dict]) -> str:
    """The tools in the Hermes form, for a chat template that does not render `tools` itself."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in given)
    return ("You may call one or more functions to assist with the user query. The functions are listed "
            f"within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return a "
            'JSON object with the function name and arguments within <tool_call></tool_call> XML tags:\n'
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def with_tools(messages: list[dict], given: list[dict]) -> list[dict]:
    """`messages` with the tools prepended to (or as) the system message."""
    prompt = tools_system_prompt(given)
    if messages and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages
