"""`hf-paged serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over an `EngineClient`: an
`AsyncEngine`, or (`--num-prefill P --num-decode D`) disaggregated prefill and decode workers through
their async client, which the `hf-paged` command line wires in (this module imports nothing of
`disagg`).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat template),
`GET /v1/models`, `GET /health` (always open), `GET /metrics` (Prometheus text, vLLM's names) and
`GET /openapi.json` (the request contract, `openapi.py`). `"stream": true` answers with Server-Sent
Events in OpenAI's chunk format (logprobs included), ending with `[DONE]`.

Hardening:
* `--api-key`: every endpoint but `/health` needs `Authorization: Bearer <key>` (`auth.py`), else 401;
  `launch` binds 127.0.0.1 unless told otherwise, and warns beyond loopback without a key.
* Every per-request cost is bounded: the body (`--max-body-bytes`, 413), and each cap of
  `openai_protocol.Limits` (stop strings and their length, logit-bias entries, n, max_tokens,
  logprobs), each a flag; a request over one gets a 400 naming it. Stop matching is linear in the
  text (`engine.detokenizer`).
* Every malformed request gets a 4xx with an OpenAI error body, never a 500 or a traceback: bad
  UTF-8 or JSON, number literals, lone surrogates anywhere (`openai_protocol.decode_body`), a chat
  template that refuses the messages, a request the KV pool can never hold. The request is set up
  (tokenised, templated, checked by the engine) before the answer starts, off the event loop, so the
  same 4xx comes whether or not it streams; a stream that fails after its first byte ends with an
  error event and `[DONE]`.
* A client that disconnects mid-stream aborts its request: its blocks are freed at once.
* More than `max_waiting` requests in flight: 429 with `Retry-After`, before any work is queued.
* An engine error for one request is a 500 for that request only; an engine that stopped, 503.
* SIGTERM: uvicorn stops accepting, in-flight requests finish within the grace period, exit 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from ..engine import EngineClient, EngineClosedError, ExecutorLostError
from ..sampling_params import SamplingParams
from .openai_protocol import APIError, Limits, Parsed, decode_body, max_tokens_for, parse
from .openapi import openapi_document
from . import tool_calls, tools
from .auth import RequireKey, check_api_key
from .prometheus import EngineCollector

try:  # FastAPI resolves the endpoints' annotations in this module's globals
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import Response, StreamingResponse
except ImportError:  # the `serve` extra is missing: `Server` says so (`_require`)
    Request = Response = StreamingResponse = None
    ClientDisconnect = ConnectionError

logger = logging.getLogger(__name__)

# What a logprob of -inf is sent as (JSON has no infinity; OpenAI and vLLM send -9999.0).
MIN_LOGPROB = -9999.0
# Bodies larger than this are decoded and checked on a worker thread, one at a time: a megabyte of
# JSON costs milliseconds (json.loads holds the GIL for its C parse, ~1-14 ms a MiB here, so the loop
# waits at most for one such call, not for the queue). At most MAX_LARGE_BODIES of them are read
# and waiting to be parsed at once, each read within BODY_TIMEOUT_SECONDS (408 after); the others
# stay unread in their sockets.
PARSE_INLINE_BYTES = 64 << 10
MAX_LARGE_BODIES = 4
BODY_TIMEOUT_SECONDS = 30.0


def _require():
    from ..optional import require

    fastapi = require("fastapi", "serve", "hf-paged serve")
    require("uvicorn", "serve", "hf-paged serve")
    prometheus = require("prometheus_client", "serve", "hf-paged serve")
    return fastapi, prometheus


def _dumps(payload) -> bytes:
    """JSON for the wire: UTF-8, never NaN/Infinity (invalid JSON), and never failing to encode."""
    try:
        return json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate reached a message: escape it instead of failing
        return json.dumps(payload, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _sse(payload: dict) -> bytes:
    return b"data: " + _dumps(payload) + b"\n\n"


def _logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB  # -inf and NaN-free by then


class Server:
    """The app and its state (in-flight count, metrics). `app` is the ASGI application.

    Args:
        engine: the `EngineClient` serving requests (an `AsyncEngine`, or the disaggregated engine's
            async client).
        tokenizer: tokenises prompts and renders the chat template.
        processor: a vision-language model's processor (transformers' `AutoProcessor`): renders chat
            messages that hold images (base64 data URLs) into ids and pixel inputs; None: images get 400.
        model_name: the id clients pass as `model` (and `/v1/models` lists).
        api_key: required as `Authorization: Bearer <key>` on every endpoint but `/health`; None: open.
            An empty key is a ValueError (`check_api_key`).
        limits: request caps (`openai_protocol.Limits`).
        max_waiting: requests in flight beyond which new ones get 429 with `Retry-After`.
    """

    def __init__(self, engine: EngineClient, tokenizer, model_name: str, api_key: str | None = None,
                 limits: Limits | None = None, max_waiting: int = 256, processor=None):
        fastapi, prometheus = _require()
        from fastapi.responses import PlainTextResponse
        from starlette.exceptions import HTTPException

        check_api_key(api_key)
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.processor = processor
        self.api_key = api_key
        self.limits = limits or Limits()
        self.max_waiting = max_waiting
        self.in_flight = 0
        self.vocab_size = engine.vocab_size
        self.tool_format = tool_calls.format_for_template(getattr(tokenizer, "chat_template", None))
        special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        # A format whose markers are special tokens needs them in the text, to read the calls back.
        self._keep_special_for_tools = any(m in special for m in self.tool_format.markers)
        self.counts = {"ok": 0, "client_errors": 0, "server_errors": 0, "rejected_busy": 0, "aborted": 0}
        self._parsing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_paged-parse")
        self._large_bodies = asyncio.Semaphore(MAX_LARGE_BODIES)
        self._openapi = _dumps(openapi_document(model_name, self.limits, self.vocab_size))
        self._registry = prometheus.CollectorRegistry()
        self._registry.register(EngineCollector(self))
        app = fastapi.FastAPI(title="hf_paged", docs_url=None, redoc_url=None, openapi_url=None)
        self.app = app

        @app.exception_handler(HTTPException)
        async def http_error(request, exc):  # unknown routes and methods, in OpenAI's shape
            return _json(APIError(exc.status_code, str(exc.detail), type="invalid_request_error").body(),
                         exc.status_code, headers=getattr(exc, "headers", None))  # a 405's Allow

        @app.exception_handler(Exception)
        async def any_error(request, exc):  # never a traceback to the client
            logger.exception("hf_paged serve: unhandled error")
            self.counts["server_errors"] += 1
            return _json(APIError(500, "internal error", type="server_error").body(), 500)

        if api_key is not None:
            app.add_middleware(RequireKey, key=api_key)

        @app.get("/health")
        async def health():
            alive = self.engine.is_alive()
            return _json({"status": "ok" if alive else "engine stopped"}, 200 if alive else 503)

        @app.get("/v1/models")
        async def models():
            return _json({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                      "owned_by": "hf_paged"}]})

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(prometheus.generate_latest(self._registry).decode(),
                                     media_type=prometheus.CONTENT_TYPE_LATEST)

        @app.get("/openapi.json")
        async def openapi():
            return Response(self._openapi, media_type="application/json")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._serve(request, "completion")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._serve(request, "chat")

    # ------------------------------------------------------------------ one request
    async def _serve(self, request, kind: str):
        try:
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.limits.max_body_bytes:
                raise APIError(413, f"the request body is larger than {self.limits.max_body_bytes} bytes "
                                    "(the server's --max-body-bytes)")
            if declared.isdigit() and int(declared) <= PARSE_INLINE_BYTES:
                parsed = self._parse(kind, await self._body(request))
            else:
                # A few large bodies at a time are read (within a deadline) and parsed: the others
                # wait unread (uvicorn stops reading a connection whose body is not consumed), so the
                # event loop and memory never hold more than MAX_LARGE_BODIES of them.
                async with self._large_bodies:
                    try:
                        raw = await asyncio.wait_for(self._body(request), BODY_TIMEOUT_SECONDS)
                    except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11 on
                        raise APIError(408, f"the request body did not arrive within {BODY_TIMEOUT_SECONDS:g} s"
                                       ) from None
                    parsed = await asyncio.get_running_loop().run_in_executor(self._parsing, self._parse, kind, raw)
        except APIError as exc:
            return self._client_error(exc)
        except ClientDisconnect:  # the client left before its body arrived: nobody reads an answer
            self.counts["aborted"] += 1
            return Response(status_code=400)
        if self.in_flight >= self.max_waiting:
            self.counts["rejected_busy"] += 1
            return _json(APIError(429, f"the server has {self.in_flight} requests in flight; retry later",
                                  type="rate_limit_error").body(), 429, headers={"Retry-After": "1"})
        self.in_flight += 1
        handed_over = False  # to the stream, which releases it however it ends
        try:
            rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
            prompt_ids, images = await asyncio.to_thread(self._prompt, parsed)  # tokenising is never on the loop
            params = self._params(parsed)
            prompt = prompt_ids if images is None else {"prompt_token_ids": prompt_ids, "multi_modal_data": images}
            try:
                pending = await self.engine.add_request(prompt, params, rid, stream=parsed.stream)
            except (ValueError, TypeError) as exc:  # the engine's own checks (a pool that can never hold it...)
                raise APIError(400, str(exc)) from None
            if parsed.stream:
                handed_over = True
                return _GuardedStream(self._stream(parsed, prompt_ids, pending, rid),
                                      on_close=lambda: self._close_stream(pending), headers=_warnings(parsed))
            output = await pending.result()
        except APIError as exc:
            return self._client_error(exc)
        except EngineClosedError as exc:
            self.counts["server_errors"] += 1
            return _json(APIError(503, f"the engine is not serving: {exc}", type="server_error").body(), 503)
        finally:
            if not handed_over:
                self.in_flight -= 1
        failed = [s.error for s in output.outputs if s.error is not None]
        if failed:
            status = (400 if isinstance(failed[0], (ValueError, TypeError))
                      else 503 if isinstance(failed[0], ExecutorLostError) else 500)
            self.counts["client_errors" if status == 400 else "server_errors"] += 1
            return _json(APIError(status, f"generation failed: {failed[0]}",
                                  type="invalid_request_error" if status == 400 else "server_error").body(), status)
        self.counts["ok"] += 1
        # Off the loop: with logprobs, the answer decodes up to n x max_tokens x (1 + top_logprobs) tokens.
        return _json(await asyncio.to_thread(self._response, parsed, rid, prompt_ids, output),
                     headers=_warnings(parsed))

    def _client_error(self, exc: APIError):
        self.counts["client_errors"] += 1
        return _json(exc.body(), exc.status)

    async def _body(self, request) -> bytes:
        """The body, refused with 413 as soon as it passes `--max-body-bytes` (a declared size is
        checked by `_serve` before reading)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise APIError(413, f"the request body is larger than {self.limits.max_body_bytes} bytes "
                                    "(the server's --max-body-bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    def _parse(self, kind: str, raw: bytes) -> Parsed:
        return parse(kind, decode_body(raw), [self.model_name], self.limits, self.vocab_size, self.tool_format)

    def _prompt(self, p: Parsed) -> tuple[list[int], dict | None]:
        """The prompt's token ids and its image inputs (None without images), on a worker thread:
        tokenising, templating and decoding images cost time. Sets `p.max_tokens` to what the request
        may generate (`openai_protocol.max_tokens_for`: chat's default is the rest of the context)."""
        images = None
        with self.engine.tokenizer_lock:  # the engine's: it encodes string prompts too
            if p.kind == "chat" and any(isinstance(m["content"], list) for m in p.messages):
                ids, images = self._render_images(p.messages)
            elif p.kind == "chat":
                try:
                    messages, kwargs = tools.template_inputs(p.messages, p.tools, self.tokenizer.chat_template)
                    ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                             **kwargs)
                except Exception as exc:  # noqa: BLE001 - a template's raise_exception, or any error it meets
                    raise APIError(400, f"the model's chat template cannot render these messages: {exc}",
                                   param="messages") from None
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            elif isinstance(p.prompt, str):
                ids = self.tokenizer(p.prompt)["input_ids"]
            else:
                ids = p.prompt
        if not ids:
            raise APIError(400, "the prompt is empty once tokenised", param="prompt")
        p.max_tokens = max_tokens_for(p, len(ids), self.limits)  # the defaults need the prompt's length
        return list(ids), images

    def _render_images(self, messages: list[dict]) -> tuple[list[int], dict]:
        """Chat messages with images through the processor's chat template: the ids (each image's
        placeholders expanded) and the image tensors beside them."""
        if self.processor is None:
            raise APIError(400, f"model {self.model_name!r} takes no images", param="messages")
        import io

        from PIL import Image, UnidentifiedImageError

        rendered = []
        for m in messages:
            if not isinstance(m["content"], list):
                rendered.append(m)
                continue
            parts = []
            for part in m["content"]:
                if part["type"] == "text":
                    parts.append(part)
                    continue
                try:
                    image = Image.open(io.BytesIO(part["data"]))
                    image.load()
                except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
                    raise APIError(400, f"an image_url holds no image this server can read: {exc}",
                                   param="messages") from None
                parts.append({"type": "image", "image": image.convert("RGB")})
            rendered.append({"role": m["role"], "content": parts})
        try:
            out = self.processor.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, return_tensors="pt")
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception, or a processor refusing the images
            raise APIError(400, f"the model's processor cannot render these messages: {exc}",
                           param="messages") from None
        ids = out["input_ids"][0].tolist()
        # The ids' (modality) types of Qwen-VL's and Gemma 3's processors are derived by the engine from the ids.
        images = {k: v for k, v in out.items()
                  if k not in ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")}
        if "pixel_values" not in images:
            raise APIError(400, "the model's processor produced no pixel_values for these images", param="messages")
        return ids, images

    def _params(self, p: Parsed) -> SamplingParams:
        # A tool format whose markers are special tokens keeps them in the text, to read the calls back.
        skip_special = p.skip_special_tokens and not (self._keep_special_for_tools and p.tool_choice != "none")
        try:
            params = SamplingParams(max_new_tokens=p.max_tokens, min_new_tokens=p.min_tokens,
                                    temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                                    n=p.n, stop=p.stop or None, stop_token_ids=p.stop_token_ids,
                                    ignore_eos=p.ignore_eos, seed=p.seed, logprobs=p.logprobs,
                                    repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                                    frequency_penalty=p.frequency_penalty, logit_bias=p.logit_bias or None,
                                    structured=p.structured, skip_special_tokens=skip_special)
            params.validate(self.vocab_size)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from None
        return params

    # ------------------------------------------------------------------ answers
    def _usage(self, prompt_ids, outputs) -> dict:
        completion = sum(len(s.token_ids) for s in outputs)
        return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                "total_tokens": len(prompt_ids) + completion}

    def _response(self, p: Parsed, rid: str, prompt_ids, output) -> dict:
        choices = []
        for i, sample in enumerate(output.outputs):
            reason = _finish_reason(sample.finish_reason)
            logprobs = None
            if p.logprobs is not None:
                logprobs = self._chat_logprobs(sample.logprobs) if p.kind == "chat" else \
                    self._completion_logprobs(sample.logprobs)
            if p.kind == "chat":
                message, reason = tools.answer(sample.text or "", reason, p.tool_choice, p.tool_format)
                choice = {"index": i, "message": {"role": "assistant", **message}, "logprobs": logprobs,
                          "finish_reason": reason}
            else:
                choice = {"index": i, "text": sample.text or "", "finish_reason": reason, "logprobs": logprobs}
            choices.append(choice)
        return {"id": rid, "object": "chat.completion" if p.kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": self._usage(prompt_ids, output.outputs)}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(self, logprobs) -> dict:
        """OpenAI's chat `logprobs` for these tokens' `TokenLogprobs` (`{"content": [...]}`)."""
        content = []
        for lp in logprobs or []:
            token = self._token(lp.token_id)
            content.append({"token": token, "logprob": _logprob(lp.logprob), "bytes": list(token.encode()),
                            "top_logprobs": [{"token": self._token(t), "logprob": _logprob(v),
                                              "bytes": list(self._token(t).encode())} for t, v in (lp.top or [])]})
        return {"content": content}

    def _completion_logprobs(self, logprobs, offset: int = 0) -> dict:
        """OpenAI's completions `logprobs` for these tokens; `text_offset` counts from `offset`."""
        tokens = [self._token(lp.token_id) for lp in logprobs or []]
        offsets, at = [], offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [_logprob(lp.logprob) for lp in logprobs or []],
                "top_logprobs": [{self._token(t): _logprob(v) for t, v in (lp.top or [])} for lp in logprobs or []],
                "text_offset": offsets}

    async def _stream(self, p: Parsed, prompt_ids, pending, rid: str):
        """Server-Sent Events: one chunk per token event (with its logprobs when asked), the finish
        reasons, the usage chunk on request, then `[DONE]`. A failure after the first byte ends the
        stream with an error event and `[DONE]`. A client that goes away ends the response, whose
        `on_close` aborts the request."""
        created, obj = int(time.time()), "chat.completion.chunk" if p.kind == "chat" else "text_completion"
        counts, offsets = [0] * p.n, [0] * p.n
        calling = p.kind == "chat" and p.tool_choice != "none"
        calls_only = calling and tool_calls.forces_calls(p.tool_choice)  # content null, as OpenAI streams it
        parsers = [tool_calls.ToolCallParser(p.tool_format, calls_only) for _ in range(p.n)] if calling else []
        try:
            if p.kind == "chat":
                for i in range(p.n):
                    yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                "choices": [{"index": i, "delta": {"role": "assistant",
                                                                   "content": None if calls_only else ""},
                                             "logprobs": None, "finish_reason": None}]})
            async for event in pending.events():
                i = event.sample_index
                if event.finish_reason == "error":
                    raise RuntimeError(f"request {rid} failed in the engine")
                if event.token_id is not None:
                    counts[i] += 1
                text = event.text or ""
                reason = _finish_reason(event.finish_reason)
                logprobs = None
                if p.logprobs is not None and event.logprobs is not None:
                    if p.kind == "chat":
                        logprobs = self._chat_logprobs([event.logprobs])
                    else:
                        logprobs = self._completion_logprobs([event.logprobs], offsets[i])
                        offsets[i] += sum(len(t) for t in logprobs["tokens"])
                if calling:
                    # Calls as OpenAI streams them: the name (with the call's id) once it is whole, then
                    # the arguments as they are generated; text that may open a call waits until decided.
                    deltas = parsers[i].feed(text) + (parsers[i].finish(cut=reason != "stop")
                                                      if reason is not None else [])
                    if reason == "stop" and parsers[i].calls:
                        reason = "tool_calls"
                    if not deltas and (reason is not None or logprobs is not None):
                        deltas = [{}]
                    for k, delta in enumerate(deltas):
                        last = k == len(deltas) - 1
                        yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                    "choices": [{"index": i, "delta": delta, "logprobs": logprobs if last else None,
                                                 "finish_reason": reason if last else None}]})
                    continue
                choice = {"index": i, "finish_reason": reason, "logprobs": logprobs}
                if p.kind == "chat":
                    choice["delta"] = {"content": text} if text or reason is None else {}
                else:
                    choice["text"] = text
                yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                            "choices": [choice]})
            if p.include_usage:
                completion = sum(counts)
                yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
                                      "total_tokens": len(prompt_ids) + completion}})
            self.counts["ok"] += 1
        except Exception as exc:  # noqa: BLE001 - after the first byte the status is sent: say so in the stream
            logger.warning("hf_paged serve: stream %s failed: %r", rid, exc)
            self.counts["server_errors"] += 1
            stopped = isinstance(exc, (EngineClosedError, ExecutorLostError))
            yield _sse(APIError(503 if stopped else 500, f"the engine stopped: {exc}" if stopped else "generation failed",
                                type="server_error").body())
        yield b"data: [DONE]\n\n"

    async def _close_stream(self, pending) -> None:
        """However a stream ended (finished, failed, the client left, never started): abort what is
        still running and release its in-flight slot, once."""
        self.in_flight -= 1
        if not pending.finished:
            self.counts["aborted"] += 1
        await pending.abort()


def _json(payload, status: int = 200, headers: dict | None = None):
    return Response(_dumps(payload), status_code=status, media_type="application/json", headers=headers)


if StreamingResponse is not None:
    class _GuardedStream(StreamingResponse):
        """An SSE response whose `on_close` runs however the response ends, even if the client left
        before its first byte (a generator that never started would never run its `finally`)."""

        def __init__(self, content, on_close, headers: dict | None = None):
            super().__init__(content, media_type="text/event-stream", headers=headers)
            self._on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self._on_close()


def _warnings(p: Parsed) -> dict | None:
    """A `Warning` header (RFC 9111's 299, "miscellaneous persistent warning") for each schema that was
    held only as far as the grammar backend can; ASCII, as headers must be."""
    if not p.warnings:
        return None
    text = "; ".join(p.warnings).encode("ascii", "backslashreplace").decode()[:2000].replace('"', "'")
    return {"Warning": f'299 hf_paged "{text}"'}


def _finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}.get(reason, reason)
