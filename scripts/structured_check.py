"""Structured outputs on `hf-paged serve default` (SmolLM2-135M-Instruct) through the real openai client.

1. `response_format` with a JSON schema, greedy, 24 varied prompts (six schemas, four prompts each, some
   of which ask for nothing like the schema) at `max_tokens=60`: each answer must parse and validate
   (jsonschema_rs). With `--any-whitespace-too`, the same prompts are also sent with the schema's
   whitespace unbounded (the old default), for comparison, through the Python API.
2. A tool call streamed with `tool_choice` naming the function: the arguments arrive in at least two
   deltas, and their concatenation equals the non-streamed call's arguments.

    python scripts/structured_check.py

Prints one line per prompt and a summary; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "temperature_c": {"type": "number"},
           "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]}},
           "required": ["city", "temperature_c", "conditions"], "additionalProperties": False}
SENTIMENT = {"type": "object", "properties": {
    "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["sentiment", "confidence"],
    "additionalProperties": False}
LIST = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                   "maxItems": 3}}, "required": ["items"], "additionalProperties": False}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 80}, "is_sure": {"type": "boolean"}},
          "required": ["answer", "is_sure"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40}, "year": {"type": "integer"}},
         "required": ["title", "year"], "additionalProperties": False}
CASES = [
    ("Maria Lopez is 34 and lives in Madrid. Give her name and age.", "person", PERSON),
    ("Extract the person: Tom, aged 71, retired teacher.", "person", PERSON),
    ("Who is the main character of Hamlet, and how old might he be?", "person", PERSON),
    ("Describe a fictional hero for a fantasy novel.", "person", PERSON),
    ("What's the weather like in Lisbon today? It is sunny and 24 degrees.", "weather", WEATHER),
    ("Report: heavy rain in Bergen, 9 C.", "weather", WEATHER),
    ("Tell me about the climate of Cairo.", "weather", WEATHER),
    ("Is it snowing in Oslo? Guess the temperature.", "weather", WEATHER),
    ("I absolutely loved this movie, the acting was superb!", "sentiment", SENTIMENT),
    ("The delivery was late and the box was damaged.", "sentiment", SENTIMENT),
    ("The meeting is at 3 pm.", "sentiment", SENTIMENT),
    ("Rate the sentiment: 'meh, it was okay I guess'", "sentiment", SENTIMENT),
    ("List three fruits.", "list", LIST),
    ("Name some programming languages.", "list", LIST),
    ("What should I pack for a beach holiday?", "list", LIST),
    ("Give me ideas for a birthday party.", "list", LIST),
    ("What is the capital of France?", "answer", ANSWER),
    ("How many legs does a spider have?", "answer", ANSWER),
    ("Why is the sky blue?", "answer", ANSWER),
    ("Write a haiku about autumn.", "answer", ANSWER),
    ("When did the first moon landing happen?", "event", EVENT),
    ("Tell me about a famous battle in history.", "event", EVENT),
    ("What is a memorable event from the 1990s?", "event", EVENT),
    ("Hello! How are you today?", "event", EVENT),
]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}}


def _valid(schema: dict, text: str) -> bool:
    import jsonschema_rs

    try:
        jsonschema_rs.validate(schema, json.loads(text))
        return True
    except Exception:  # noqa: BLE001 - counted as a failure
        return False


def serve_default(*flags: str) -> tuple[subprocess.Popen, str]:
    """`hf-paged serve default [flags]` on a free loopback port, once healthy: the process and its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged.cli", "serve", "default", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={k: v for k, v in os.environ.items() if k != "HF_PAGED_API_KEY"})
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise TimeoutError("the server did not start")


def schemas(client) -> int:
    ok = 0
    for prompt, name, schema in CASES:
        answer = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": prompt}], max_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        text, reason = answer.choices[0].message.content, answer.choices[0].finish_reason
        good = _valid(schema, text)
        ok += good
        print(f"  {'ok ' if good else 'BAD'} {name:9s} {reason:6s} {answer.usage.completion_tokens:2d} tokens  {text!r:.90}")
    print(f"response_format json_schema, SmolLM2, greedy, max_tokens=60: {ok}/{len(CASES)} parse and validate")
    return ok


def streamed_tool_call(client) -> bool:
    kwargs = dict(model="default", messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
                  tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    deltas, name, reason = [], None, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function and call.function.name:
                    name = call.function.name
                if call.function and call.function.arguments:
                    deltas.append(call.function.arguments)
            reason = choice.finish_reason or reason
    joined = "".join(deltas)
    good = len(deltas) >= 2 and joined == whole.function.arguments and name == whole.function.name
    print(f"streamed tool call: name {name!r} first, {len(deltas)} argument deltas {deltas[:6]}...; joined == "
          f"non-streamed arguments {joined == whole.function.arguments} ({whole.function.arguments!r}); "
          f"finish_reason {reason!r}")
    return good


def any_whitespace_baseline() -> int:
    """The same 24 prompts through the Python API with unbounded whitespace (the old default)."""
    from hf_paged import Engine, SamplingParams, StructuredOutputs
    from hf_paged.defaults.models import load_default

    model, tok = load_default()
    engine = Engine(model, tok, max_model_len=2048)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p, _, _ in CASES]
    ok = 0
    for any_ws in (True, False):
        outs = engine.generate(prompts, [SamplingParams(max_new_tokens=60, structured=StructuredOutputs(
            json=s, any_whitespace=any_ws)) for _, _, s in CASES])
        good = sum(_valid(s, o.outputs[0].text) for o, (_, _, s) in zip(outs, CASES))
        print(f"Python API, any_whitespace={any_ws}: {good}/{len(CASES)} parse and validate")
        ok = good if any_ws else ok
    engine.shutdown()
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--any-whitespace-too", action="store_true")
    args = parser.parse_args()
    import openai

    proc, url = serve_default("--served-model-name", "default", "--max-model-len", "2048")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        ok = schemas(client)
        tool_ok = streamed_tool_call(client)
    finally:
        proc.terminate()
        proc.wait(60)
    if args.any_whitespace_too:
        any_whitespace_baseline()
    return 0 if ok == len(CASES) and tool_ok else 1


if __name__ == "__main__":
    sys.exit(main())
