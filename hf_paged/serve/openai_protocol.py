"""OpenAI request bodies checked field by field, and OpenAI-shaped errors. Torch-free.

Every malformed or hostile body ends here as an `APIError` with OpenAI's status and error shape
(`{"error": {"message", "type", "param", "code"}}`); nothing reaches the engine unchecked:
`decode_body` turns the raw bytes into JSON (invalid UTF-8, invalid JSON, number literals Python
refuses and lone surrogates are 400s), `parse` checks every field against `Limits`, whose caps bound
what one request can cost (each cap is a server flag, and its 400 names the flag).

`max_tokens` defaults as OpenAI's and vLLM's do: a chat request that gives none may generate the rest
of the context (`max_model_len` minus its prompt), a completion request 16 tokens (`max_tokens_for`,
the one definition, resolved once the prompt is tokenised). vLLM's sampling extensions that the engine
has (`SAMPLING_FIELDS`: `top_k`, `min_p`, `repetition_penalty`, ..., what openai-client users send in
`extra_body`) are accepted on both routes, with vLLM's ranges.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields

from ..structured_outputs import StructuredOutputs, load_json
from ..text import refuse_lone_surrogates
from . import tool_calls, tools
from .api_error import APIError


def _cap(default: int | None, help: str):
    return field(default=default, metadata={"help": help})


# OpenAI's default max_tokens of a legacy completions request (vLLM's too); chat's is the rest of the context.
COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True)
class Limits:
    """What one request may ask for. Every field but `max_model_len` (the model's) is also a flag of
    `hf-paged serve` (`max_stop_chars` -> `--max-stop-chars`), with the default given here, and a
    request over a cap gets a 400 that names the flag.

    `max_tokens` None means the context: it becomes `max_model_len` (a request may ask up to what its
    prompt leaves). `default_max_tokens` None means OpenAI's defaults (`max_tokens_for`)."""

    max_body_bytes: int = _cap(1 << 20, "largest request body in bytes (413 above)")
    max_model_len: int = 2048
    max_tokens: int | None = _cap(None, "most tokens one request may generate: a larger max_tokens is a 400, and "
                                        "a request that gives none gets at most this (default: no cap but the "
                                        "context, --max-model-len)")
    default_max_tokens: int | None = _cap(None, "max_tokens of a request that gives none (default: OpenAI's and "
                                                "vLLM's: the rest of the context, max_model_len minus the prompt, "
                                                f"for chat; {COMPLETION_MAX_TOKENS} for completions); never more "
                                                "than the prompt leaves, nor than --max-tokens")
    max_n: int = _cap(8, "most samples (n) per request")
    max_stop: int = _cap(4, "most stop strings per request (OpenAI's 4)")
    max_stop_chars: int = _cap(1024, "longest stop string, in characters")
    max_logit_bias: int = _cap(1024, "most logit_bias entries per request")
    max_logprobs: int = _cap(20, "most top_logprobs per token (completions: at most 5, OpenAI's)")
    max_stop_token_ids: int = _cap(64, "most stop_token_ids per request")

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("max_tokens", "default_max_tokens"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{f.name} must be a positive integer, got {value!r}")
        if self.max_tokens is None:  # no cap but the context (the OpenAPI document reads a number)
            object.__setattr__(self, "max_tokens", self.max_model_len)

    @staticmethod
    def flags() -> list[tuple[str, str, int, str]]:
        """`(field, flag, default, help)` of every cap that is a server flag."""
        return [(f.name, _flag(f.name), f.default, f.metadata["help"]) for f in fields(Limits) if "help" in f.metadata]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class Parsed:
    """A checked request: what the server passes on to the engine."""

    kind: str  # "completion" or "chat"
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    # As asked (None: not given); the server sets what the request may generate once the prompt is
    # tokenised (`max_tokens_for`).
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    # vLLM's sampling extensions (`SAMPLING_FIELDS`), with the engine's "off" values.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None  # top alternatives per token (0: the chosen token only)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    user: str | None = None
    stream: bool = False
    include_usage: bool = False
    structured: StructuredOutputs | None = None  # from `response_format` or `tools` (`tools.py`)
    tools: list[dict] | None = None
    tool_choice: str | dict = "none"  # "none", "auto", "required" or {"name": ...}
    tool_format: tool_calls.ToolCallFormat = tool_calls.HERMES  # how the model writes a call
    warnings: list[str] = field(default_factory=list)  # schema keywords held only as far as the backend can


_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
           "frequency_penalty", "logit_bias", "user", "stream", "stream_options", "logprobs", "response_format"}
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                         "parallel_tool_calls"}
# vLLM's sampling parameters beyond OpenAI's (`extra_body` of the openai client), on both routes: those
# `SamplingParams` has. vLLM's others (best_of, beam search, bad_words, allowed_token_ids, prompt_logprobs,
# include_stop_str_in_output, ...) stay unknown fields (400).
SAMPLING_FIELDS = {"top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
                   "skip_special_tokens"}
ROLES = ("system", "user", "assistant", "tool")


# A JSON escape of a UTF-16 surrogate: the only way a lone surrogate gets into a parsed body (valid
# pairs are joined into one character by the parser; strict UTF-8 decoding refuses raw ones).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def decode_body(raw: bytes):
    """The JSON value of a request body.

    Raises:
        APIError: 400 for invalid UTF-8, invalid JSON (a number literal longer than Python converts),
            nesting deeper than `config.MAX_JSON_DEPTH`, or a string or key holding a lone surrogate (not Unicode text: it cannot be
            tokenised, nor even written back in an error message).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8") from None
    try:
        body = load_json(text, "the request body")  # a ValueError for invalid JSON or nesting too deep
    except ValueError as exc:  # JSONDecodeError is a ValueError; so is a 5,000-digit int
        raise APIError(400, str(exc)[:300]) from None
    if _SURROGATE_ESCAPE.search(text):
        try:
            refuse_lone_surrogates(body, "body")
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
    return body


def parse(kind: str, body, models: list[str], limits: Limits, vocab_size: int,
          tool_format: tool_calls.ToolCallFormat = tool_calls.HERMES) -> Parsed:
    """Check an OpenAI `completions` (kind "completion") or `chat/completions` ("chat") body;
    `tool_format`: how the served model writes tool calls (`tool_calls.format_for_template`)."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_json_type(body)}")
    allowed = (COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS) | SAMPLING_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required: a string", param="model")
    if model not in models:
        raise APIError(404, f"the model {model!r} does not exist (this server serves {models})", param="model",
                       code="model_not_found")
    p = Parsed(kind=kind, model=model, tool_format=tool_format)
    key = "max_completion_tokens" if kind == "chat" and "max_completion_tokens" in body else "max_tokens"
    p.max_tokens = _int(body, key, None, 1, limits.max_tokens)
    p.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    p.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if p.top_p == 0.0:
        raise APIError(400, "'top_p' must be greater than 0", param="top_p")
    _sampling(p, body, limits, vocab_size)
    p.n = _int(body, "n", 1, 1, limits.max_n)
    p.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    p.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    p.seed = _int(body, "seed", None, -(2**63), 2**63 - 1)
    p.stop = _stop(body.get("stop"), limits)
    p.logit_bias = _logit_bias(body.get("logit_bias"), vocab_size, limits)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError(400, "'user' must be a string", param="user")
    p.user = user
    p.stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not p.stream:
            raise APIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise APIError(400, "'stream_options' must be an object with 'include_usage'", param="stream_options")
        p.include_usage = _bool(options, "include_usage", False)
    if kind == "completion":
        p.logprobs = _int(body, "logprobs", None, 0, min(5, limits.max_logprobs))
        p.prompt = _prompt(body.get("prompt"), vocab_size, limits.max_model_len)
    else:
        if _bool(body, "logprobs", False):
            p.logprobs = _int(body, "top_logprobs", 0, 0, limits.max_logprobs)
        elif body.get("top_logprobs") is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        p.messages = _messages(body.get("messages"))
    _structured(p, body)
    return p


def max_tokens_for(p: Parsed, num_prompt_tokens: int, limits: Limits) -> int:
    """The most tokens a request generates: the one definition of `max_tokens` and its defaults.

    Asked for (`max_tokens`, `max_completion_tokens`): that, if the prompt leaves room for it (else a
    400, as OpenAI and vLLM answer). Not asked for: `--default-max-tokens` if the server sets one, else
    OpenAI's and vLLM's defaults, the rest of the context for chat and `COMPLETION_MAX_TOKENS` for
    completions; either way at most what the prompt leaves and `--max-tokens`.

    Raises:
        APIError: 400 when the prompt leaves too little room, or `min_tokens` is more than the result.
    """
    room = limits.max_model_len - num_prompt_tokens
    where = "messages" if p.kind == "chat" else "prompt"
    if p.max_tokens is not None and p.max_tokens > room:
        raise APIError(400, f"this model's context is {limits.max_model_len} tokens; the prompt has "
                            f"{num_prompt_tokens} and max_tokens asks for {p.max_tokens} more",
                       param=where, code="context_length_exceeded")
    if room < 1:
        raise APIError(400, f"this model's context is {limits.max_model_len} tokens; the prompt has "
                            f"{num_prompt_tokens}, which leaves no room to generate", param=where,
                       code="context_length_exceeded")
    if p.max_tokens is not None:
        max_tokens = p.max_tokens
    else:
        default = limits.default_max_tokens or (room if p.kind == "chat" else COMPLETION_MAX_TOKENS)
        max_tokens = min(default, limits.max_tokens, room)
    if p.min_tokens > max_tokens:
        raise APIError(400, f"'min_tokens' ({p.min_tokens}) must be at most max_tokens ({max_tokens})",
                       param="min_tokens")
    return max_tokens


def describe_defaults(limits: Limits) -> str:
    """`max_tokens`' policy in words (the server's start-up banner)."""
    if limits.default_max_tokens is None:
        default = f"chat: the rest of the context, completions: {COMPLETION_MAX_TOKENS}"
    else:
        default = f"{limits.default_max_tokens} (--default-max-tokens)"
    cap = ("no cap but the context" if limits.max_tokens >= limits.max_model_len
           else f"at most {limits.max_tokens} (--max-tokens)")
    return f"max_tokens when not given: {default}; {cap}"


def _sampling(p: Parsed, body: dict, limits: Limits, vocab_size: int) -> None:
    """vLLM's sampling extensions, with vLLM's ranges: top_k -1 or 0 is off, min_p in [0, 1],
    repetition_penalty > 0 (1 is off), min_tokens at most max_tokens (`max_tokens_for`)."""
    top_k = _int(body, "top_k", 0, -1, 2**31 - 1)
    p.top_k = 0 if top_k == -1 or top_k >= vocab_size else top_k  # every token kept: off
    p.min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    p.repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, math.inf)
    if p.repetition_penalty == 0.0:
        raise APIError(400, "'repetition_penalty' must be greater than 0 (1 is off)", param="repetition_penalty")
    p.min_tokens = _int(body, "min_tokens", 0, 0, limits.max_model_len)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "'stop_token_ids' must be an array of token ids", param="stop_token_ids")
        if len(ids) > limits.max_stop_token_ids:
            raise APIError(400, f"'stop_token_ids' takes at most {limits.max_stop_token_ids} ids (the server's "
                                f"{_flag('max_stop_token_ids')}), got {len(ids)}", param="stop_token_ids")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"'stop_token_ids' holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                           param="stop_token_ids")
        p.stop_token_ids = list(dict.fromkeys(ids))
    p.ignore_eos = _bool(body, "ignore_eos", False)
    p.skip_special_tokens = _bool(body, "skip_special_tokens", True)


def sampling_schema(limits: Limits, vocab_size: int) -> dict:
    """The OpenAPI properties of `SAMPLING_FIELDS`, with the ranges `parse` checks."""
    return {"top_k": {"type": "integer", "minimum": -1, "maximum": 2**31 - 1},
            "min_p": {"type": "number", "minimum": 0, "maximum": 1},
            "repetition_penalty": {"type": "number", "exclusiveMinimum": True, "minimum": 0},
            "min_tokens": {"type": "integer", "minimum": 0, "maximum": limits.max_model_len},
            "stop_token_ids": {"type": "array", "maxItems": limits.max_stop_token_ids,
                               "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}},
            "ignore_eos": {"type": "boolean"},
            "skip_special_tokens": {"type": "boolean"}}


def _structured(p: Parsed, body: dict) -> None:
    """`response_format`, `tools` and `tool_choice` as the request's constraint (`tools.py`)."""
    p.structured = tools.response_format(body.get("response_format"), p.warnings)
    if p.kind != "chat":
        return
    p.tools = tools.tools(body.get("tools"), p.warnings)
    p.tool_choice = tools.tool_choice(body.get("tool_choice"), p.tools)
    parallel = _bool(body, "parallel_tool_calls", True)
    if p.tools is not None and p.tool_choice != "none":
        if p.structured is not None:
            raise APIError(400, "'response_format' cannot be combined with 'tools' (unless 'tool_choice' is "
                                "'none')", param="response_format")
        p.structured = tool_calls.constraint(p.tool_format, p.tools, p.tool_choice, parallel)
        try:
            p.structured.validate()  # the size limit of what will be compiled
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), param="tools") from None


def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _int(body: dict, name: str, default, low: int, high: int):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"'{name}' must be an integer, got {_json_type(value)} {value!r:.40}", param=name)
    if not low <= value <= high:
        raise APIError(400, f"'{name}' must be between {low} and {high}, got {value}", param=name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"'{name}' must be a number, got {_json_type(value)}", param=name)
    if not math.isfinite(value) or not low <= value <= high:
        raise APIError(400, f"'{name}' must be a finite number between {low} and {high}, got {value}", param=name)
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {_json_type(value)}", param=name)
    return value


def _stop(value, limits: Limits) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if isinstance(stops, list) and len(stops) > limits.max_stop:  # the cheap check first: lists may be huge
        raise APIError(400, f"'stop' takes at most {limits.max_stop} sequences (the server's {_flag('max_stop')}), "
                            f"got {len(stops)}", param="stop")
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_chars:
        raise APIError(400, f"a stop string may have at most {limits.max_stop_chars} characters (the server's "
                            f"{_flag('max_stop_chars')}), got one of {longest}", param="stop")
    return stops


def _logit_bias(value, vocab_size: int, limits: Limits) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise APIError(400, "'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    if len(value) > limits.max_logit_bias:
        raise APIError(400, f"'logit_bias' takes at most {limits.max_logit_bias} entries (the server's "
                            f"{_flag('max_logit_bias')}), got {len(value)}", param="logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise APIError(400, f"'logit_bias' key {key!r:.40} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab_size or str(token) != str(key).strip():
            raise APIError(400, f"'logit_bias' key {key!r:.40} is not a token id in [0, {vocab_size})",
                           param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -100 <= bias <= 100:
            raise APIError(400, f"'logit_bias' values must be numbers in [-100, 100], got {bias!r:.40}",
                           param="logit_bias")
        out[token] = float(bias)
    return out


def _prompt(value, vocab_size: int, max_model_len: int) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise APIError(400, "'prompt' is empty", param="prompt")
        return value
    if isinstance(value, list) and len(value) >= max_model_len:  # before looking at each id
        raise APIError(400, f"this model's context is {max_model_len} tokens; the prompt has {len(value)}",
                       param="prompt", code="context_length_exceeded")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"'prompt' holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                           param="prompt")
        return list(value)
    if isinstance(value, list) and not value:
        raise APIError(400, "'prompt' is empty", param="prompt")
    raise APIError(400, "'prompt' must be a string or a list of token ids", param="prompt")


def _messages(value) -> list[dict]:
    """The chat messages, each `{"role", "content"}`: content a string, or (OpenAI's content parts) a list
    of `{"type": "text"}` and `{"type": "image_url"}` parts. A message whose parts are all text becomes
    one string (joined by newlines, as vLLM does); one with images keeps its parts, each image decoded
    from its base64 data URL to `{"type": "image", "data": bytes}` (the server fetches nothing)."""
    if not isinstance(value, list) or not value:
        raise APIError(400, "'messages' must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(value):
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if not isinstance(m, dict) or m.get("role") not in ROLES or not (
                isinstance(m.get("content"), (str, list)) or (calls is not None and m.get("content") is None)):
            raise APIError(400, f"messages[{i}] must be an object with a 'role' ({', '.join(ROLES)}) and a "
                                "'content' (a string or an array of content parts; null beside 'tool_calls')",
                           param=f"messages[{i}]")
        known = {"role", "content", "name"} | {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(m["role"], set())
        if set(m) - known:
            raise APIError(400, f"messages[{i}] has unknown field(s) {sorted(set(m) - known)}", param=f"messages[{i}]")
        extra = tools.message_fields(m, f"messages[{i}]")
        content = m["content"] if m["content"] is not None else ""
        if isinstance(content, list):
            parts = [_content_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content)]
            if not parts:
                raise APIError(400, f"messages[{i}].content is an empty array", param=f"messages[{i}].content")
            if all(part["type"] == "text" for part in parts):
                content = "\n".join(part["text"] for part in parts)
            elif m["role"] != "user":
                raise APIError(400, f"messages[{i}]: only user messages may hold images", param=f"messages[{i}]")
            else:
                content = parts
        out.append({"role": m["role"], "content": content, **extra})
    tools.check_tool_answers(out)
    return out


_DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,(.*)", re.DOTALL)


def _content_part(part, where: str) -> dict:
    import base64
    import binascii

    if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
        raise APIError(400, f"{where} must be a content part of type 'text' or 'image_url'", param=where)
    if part["type"] == "text":
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise APIError(400, f"{where}: a text part is {{'type': 'text', 'text': <string>}}", param=where)
        return {"type": "text", "text": part["text"]}
    image = part.get("image_url")
    if set(part) != {"type", "image_url"} or not isinstance(image, dict) or not isinstance(image.get("url"), str) \
            or set(image) - {"url", "detail"}:
        raise APIError(400, f"{where}: an image part is {{'type': 'image_url', 'image_url': {{'url': <data URL>}}}}",
                       param=where)
    match = _DATA_URL.fullmatch(image["url"])
    if match is None:
        raise APIError(400, f"{where}: image_url must be a base64 data URL (data:image/<type>;base64,...); "
                            "the server fetches nothing", param=where)
    try:
        data = base64.b64decode(match.group(1), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: the image's base64 data is malformed", param=where) from None
    if not data:
        raise APIError(400, f"{where}: the image is empty", param=where)
    return {"type": "image", "data": data}
