"""The first hour with `hf-paged serve default`, through the real openai client, as a newcomer meets it
(issue 53's acceptance): no `max_tokens`, temperature 0.

1. "What is the capital of France?" ends by itself (`finish_reason` "stop"), not at a default cap.
2. A `response_format` JSON schema answer parses and validates.
3. `tool_choice="required"`: `content` is None (the grammar starts at the call) and every call's
   arguments are JSON valid against the function's parameters.
4. With `tools` present, a text answer streams: its content arrives in more than one chunk.
5. A call cut short by `max_tokens` leaves no tool-call markup in `content`, streamed or not.

    python scripts/first_hour_check.py                       # starts `hf-paged serve default` itself
    python scripts/first_hour_check.py --base-url http://127.0.0.1:8000/v1 --model default

Prints each check PASS/FAIL with its time; exits 1 if one fails. `tests/serve/test_tools_first_hour.py`
runs the same checks against the suite's served model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def _valid(schema: dict, text: str | None) -> bool:
    import jsonschema_rs

    try:
        jsonschema_rs.validate(schema, json.loads(text))
        return True
    except Exception:  # noqa: BLE001 - any failure to parse or validate is the answer
        return False


def streamed(client, **kwargs) -> dict:
    """A streamed answer gathered as an openai-client user does: the content, the number of chunks that
    carried content, the calls (merged by index) and the finish reason."""
    out = {"content": "", "content_chunks": 0, "calls": {}, "finish_reason": None}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.delta.content:
                out["content"] += choice.delta.content
                out["content_chunks"] += 1
            for call in choice.delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += (call.function.name or "") if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


# ------------------------------------------------------------------ the checks: (passed, what was seen)
def capital(client, model: str) -> tuple[bool, str]:
    answer = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0)
    choice = answer.choices[0]
    return choice.finish_reason == "stop", (f"finish_reason {choice.finish_reason!r}, "
                                            f"{answer.usage.completion_tokens} tokens: {choice.message.content!r:.80}")


def json_schema(client, model: str) -> tuple[bool, str]:
    answer = client.chat.completions.create(
        model=model, temperature=0, messages=[{"role": "user", "content": "Invent a person; answer as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = answer.choices[0]
    return _valid(PERSON, choice.message.content), (f"finish_reason {choice.finish_reason!r}: "
                                                     f"{choice.message.content!r:.80}")


def required_call(client, model: str) -> tuple[bool, str]:
    answer = client.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=[WEATHER],
                                            tool_choice="required", temperature=0)
    choice = answer.choices[0]
    calls = choice.message.tool_calls or []
    ok = (choice.message.content is None and choice.finish_reason == "tool_calls" and bool(calls)
          and all(c.function.name == "get_weather" and _valid(WEATHER["function"]["parameters"], c.function.arguments)
                  for c in calls))
    return ok, (f"content {choice.message.content!r:.60}, finish_reason {choice.finish_reason!r}, "
                f"{answer.usage.completion_tokens} tokens, calls "
                f"{[(c.function.name, c.function.arguments) for c in calls]}")


def streamed_text_with_tools(client, model: str) -> tuple[bool, str]:
    got = streamed(client, model=model, messages=CAPITAL, tools=[WEATHER], temperature=0)
    ok = got["content_chunks"] > 1 and not got["calls"] and got["finish_reason"] == "stop"
    return ok, (f"{got['content_chunks']} content chunks, finish_reason {got['finish_reason']!r}: "
                f"{got['content']!r:.60}")


def cut_call(client, model: str) -> tuple[bool, str]:
    """Cut in the call's opening (6 tokens) and in its arguments (24): `content` stays None (no markup), a call
    whose name was whole comes back with the arguments it has, streamed and not alike."""
    seen, ok = [], True
    for max_tokens in (6, 24):
        kwargs = dict(model=model, messages=WEATHER_QUESTION, tools=[WEATHER], tool_choice="required",
                      temperature=0, max_tokens=max_tokens)
        choice = client.chat.completions.create(**kwargs).choices[0]
        got = streamed(client, **kwargs)
        names = [c.function.name for c in choice.message.tool_calls or []]
        ok &= (choice.message.content is None and not got["content"] and choice.finish_reason == "length"
               and got["finish_reason"] == "length" and set(names) <= {"get_weather"}
               and [c["name"] for c in got["calls"].values()] == names)
        seen.append(f"max_tokens={max_tokens}: content {choice.message.content!r} / streamed {got['content']!r}, "
                    f"calls {[(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]}")
    return ok, "; ".join(seen)


CHECKS = {"capital ends with stop": capital, "json_schema parses": json_schema,
          "required call: content None, valid arguments": required_call,
          "streamed text with tools: several chunks": streamed_text_with_tools,
          "cut call: no markup in content": cut_call}


def _serve() -> tuple[subprocess.Popen, str]:
    """`hf-paged serve default` with its defaults: structured_check's server start, its /v1 URL."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from structured_check import serve_default

    proc, url = serve_default()
    return proc, url + "/v1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="a running server's /v1 URL (default: start one)")
    parser.add_argument("--model", default="default", help="the served model id")
    parser.add_argument("--api-key", default=os.environ.get("HF_PAGED_API_KEY", "none"))
    args = parser.parse_args()
    import openai

    proc, url = (None, args.base_url) if args.base_url else _serve()
    failed = 0
    try:
        client = openai.OpenAI(base_url=url, api_key=args.api_key, max_retries=0, timeout=600)
        for name, check in CHECKS.items():
            start = time.perf_counter()
            try:
                ok, seen = check(client, args.model)
            except Exception as exc:  # noqa: BLE001 - a check that raises failed
                ok, seen = False, f"{type(exc).__name__}: {exc}"
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'}  {name:45s} {time.perf_counter() - start:6.2f} s  {seen}", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print(f"{len(CHECKS) - failed}/{len(CHECKS)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
