"""The server's OpenAPI 3 document (`GET /openapi.json`), built from the same field lists and
`Limits` that `openai_protocol` checks, so the schema a client (or a fuzzer) reads is the contract
the server enforces. Torch-free.
"""

from __future__ import annotations

from .openai_protocol import CHAT_FIELDS, COMPLETION_FIELDS, ROLES, SAMPLING_FIELDS, Limits, sampling_schema

_ERROR = {"$ref": "#/components/schemas/Error"}
_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
_TOOL = {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": _NAME, "description": {"type": "string"}, "parameters": {"type": "object"},
        "strict": {"type": "boolean", "nullable": True}}}}}


def openapi_document(model_name: str, limits: Limits, vocab_size: int) -> dict:
    """OpenAPI 3.0 for `hf-paged serve`: every route, every request field with its caps, and every
    status a route answers (with OpenAI's error body for each 4xx/5xx)."""
    completion = _request_schema(COMPLETION_FIELDS | SAMPLING_FIELDS, model_name, limits, vocab_size, chat=False)
    chat = _request_schema(CHAT_FIELDS | SAMPLING_FIELDS, model_name, limits, vocab_size, chat=True)
    return {
        "openapi": "3.0.3",
        "info": {"title": "hf-paged serve", "version": "1",
                 "description": "OpenAI-compatible completions and chat over hf_paged's engine."},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": _error_schema(), "CompletionRequest": completion, "ChatRequest": chat},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/health": {"get": {"operationId": "health", "security": [], "responses": {
                "200": _json_response("the engine runs", {"type": "object"}),
                "503": _json_response("the engine stopped", {"type": "object"})}}},
            "/v1/models": {"get": {"operationId": "models", "responses": {
                "200": _json_response("the served model", {"type": "object", "required": ["object", "data"]}),
                **_errors(401)}}},
            "/metrics": {"get": {"operationId": "metrics", "responses": {
                "200": {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}},
                **_errors(401)}}},
            "/openapi.json": {"get": {"operationId": "openapi", "responses": {
                "200": _json_response("this document", {"type": "object"}), **_errors(401)}}},
            "/v1/completions": {"post": _generation("completions", "CompletionRequest")},
            "/v1/chat/completions": {"post": _generation("chat_completions", "ChatRequest")},
        },
    }


def _generation(operation: str, schema: str) -> dict:
    return {
        "operationId": operation,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {
            "200": {"description": "the completion (JSON), or Server-Sent Events with `stream`",
                    "content": {"application/json": {"schema": {"type": "object", "required": ["id", "choices"]}},
                                # each Server-Sent Event: `data:` a JSON chunk (or [DONE])
                                "text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                                 "properties": {"data": {"type": "string"}}}}}},
            **_errors(400, 401, 404, 408, 413, 429, 503),
        },
    }


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": "OpenAI's error body", "content": {"application/json": {"schema": _ERROR}}}
            for s in statuses}


def _json_response(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error_schema() -> dict:
    nullable = {"type": "string", "nullable": True}
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": nullable,
                       "code": nullable}}}}


def _request_schema(names: set[str], model_name: str, limits: Limits, vocab_size: int, chat: bool) -> dict:
    stop = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    max_tokens = {"type": "integer", "minimum": 1, "maximum": limits.max_tokens}
    props = {
        "model": {"type": "string", "enum": [model_name]},
        "max_tokens": max_tokens,
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_n},
        "stop": {"oneOf": [stop, {"type": "array", "items": stop, "maxItems": limits.max_stop}]},
        "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
        "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
        "logit_bias": {"type": "object", "maxProperties": limits.max_logit_bias,
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
        "user": {"type": "string"},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "additionalProperties": False,
                           "properties": {"include_usage": {"type": "boolean"}}},
        "response_format": {"oneOf": [
            {"type": "object", "required": ["type"], "additionalProperties": False,
             "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
             "properties": {"type": {"const": "json_schema"}, "json_schema": {
                 "type": "object", "required": ["name"], "additionalProperties": False,
                 "properties": {"name": _NAME, "description": {"type": "string"}, "schema": {"type": "object"},
                                "strict": {"type": "boolean", "nullable": True}}}}}]},
        **sampling_schema(limits, vocab_size),  # vLLM's extensions (`extra_body`), with the ranges parse checks
    }
    if chat:
        props["messages"] = {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {"role": {"type": "string", "enum": list(ROLES)}, "content": {"oneOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": {"oneOf": [
                    {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                     "properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
                    {"type": "object", "required": ["type", "image_url"], "additionalProperties": False,
                     "properties": {"type": {"const": "image_url"}, "image_url": {
                         "type": "object", "required": ["url"], "additionalProperties": False,
                         "properties": {"url": {"type": "string", "pattern": "^data:image/"},
                                        "detail": {"type": "string"}}}}}]}}], "nullable": True},  # null: calls
                "name": {"type": "string"},
                "tool_calls": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["function"], "properties": {
                        "id": {"type": "string"}, "type": {"const": "function"},
                        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                            "name": {"type": "string"}, "arguments": {"type": "string"}}}}}},
                "tool_call_id": {"type": "string"}}}}
        props["tools"] = {"type": "array", "minItems": 1, "items": _TOOL}
        props["tool_choice"] = {"oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "required": ["name"], "properties": {"name": _NAME}}}}]}
        props["parallel_tool_calls"] = {"type": "boolean"}
        props["logprobs"] = {"type": "boolean"}
        props["top_logprobs"] = {"type": "integer", "minimum": 0, "maximum": limits.max_logprobs}
        props["max_completion_tokens"] = max_tokens
        required = ["model", "messages"]
    else:
        props["prompt"] = {"oneOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "items": token, "minItems": 1,
                                      "maxItems": limits.max_model_len - 1}]}
        props["logprobs"] = {"type": "integer", "minimum": 0, "maximum": min(5, limits.max_logprobs)}
        required = ["model", "prompt"]
    differ = set(names) ^ set(props)
    if differ:  # a field added to openai_protocol must be described here too
        raise RuntimeError(f"the OpenAPI schema and openai_protocol disagree on {sorted(differ)}")
    for name in set(props) - set(required):  # an optional field may be null: the server reads it as absent
        props[name] = {**props[name], "nullable": True}
    return {"type": "object", "required": required, "additionalProperties": False,
            "properties": {name: props[name] for name in sorted(props)}}
