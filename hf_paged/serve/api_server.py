"""`hf-paged serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncEngine`.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (the model's chat template),
`GET /v1/models`, `GET /health` (always open) and `GET /metrics` (Prometheus text, vLLM's names).
`"stream": true` answers with Server-Sent Events in OpenAI's chunk format, ending with `[DONE]`.

Hardening:
* `--api-key` (or `HF_PAGED_API_KEY`): every endpoint but `/health` needs `Authorization: Bearer
  <key>`, compared in constant time (`hmac.compare_digest`); otherwise 401 in OpenAI's shape.
* The server binds 127.0.0.1 unless `--host` says otherwise, and warns at start when it listens
  beyond loopback without a key.
* Bodies over `Limits.max_body_bytes`, prompts over `max_model_len` tokens, and `n` / `max_tokens`
  over their caps are refused with 400/413. Every malformed body gets a 4xx with an OpenAI error
  body, never a 500 or a traceback (`openai_protocol`).
* A client that disconnects mid-stream aborts its request: its blocks are freed at once.
* More than `max_waiting` requests in flight: 429 with `Retry-After`, before any work is queued.
* An engine error for one request is a 500 for that request only.
* SIGTERM: uvicorn stops accepting, in-flight requests finish within the grace period, exit 0.
"""

from __future__ import annotations

import hmac
import json
import logging
import signal
import time
import uuid

from ..engine import AsyncEngine
from ..worker import SamplingParams
from ..worker.cpu_caches import bound_cpu_kernel_caches
from .openai_protocol import APIError, Limits, Parsed, parse

try:  # FastAPI resolves the endpoints' annotations in this module's globals
    from starlette.requests import Request
except ImportError:  # the `serve` extra is missing: `Server` says so (`_require`)
    Request = None

logger = logging.getLogger(__name__)


def _require():
    from ..integrations.optional import require

    fastapi = require("fastapi", "serve", "hf-paged serve")
    require("uvicorn", "serve", "hf-paged serve")
    prometheus = require("prometheus_client", "serve", "hf-paged serve")
    return fastapi, prometheus


class Server:
    """The app and its state (in-flight count, metrics). `app` is the ASGI application.

    Args:
        engine: the `AsyncEngine` serving requests.
        tokenizer: tokenises prompts and renders the chat template.
        model_name: the id clients pass as `model` (and `/v1/models` lists).
        api_key: required as `Authorization: Bearer <key>` on every endpoint but `/health`; None: open.
        limits: request caps (`openai_protocol.Limits`).
        max_waiting: requests in flight beyond which new ones get 429 with `Retry-After`.
    """

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, api_key: str | None = None,
                 limits: Limits | None = None, max_waiting: int = 256):
        fastapi, prometheus = _require()
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.exceptions import HTTPException

        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key = api_key
        self.limits = limits or Limits()
        self.max_waiting = max_waiting
        self.in_flight = 0
        self.vocab_size = engine.engine.vocab_size
        self.counts = {"ok": 0, "client_errors": 0, "server_errors": 0, "rejected_busy": 0, "aborted": 0}
        self._registry = prometheus.CollectorRegistry()
        self._registry.register(_EngineCollector(self))
        app = fastapi.FastAPI(title="hf_paged", docs_url=None, redoc_url=None, openapi_url=None)
        self.app = app
        self._JSONResponse, self._StreamingResponse = JSONResponse, StreamingResponse

        @app.exception_handler(HTTPException)
        async def http_error(request, exc):  # unknown routes and methods, in OpenAI's shape
            return JSONResponse(APIError(exc.status_code, str(exc.detail), type="invalid_request_error").body(),
                                status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def any_error(request, exc):  # never a traceback to the client
            logger.exception("hf_paged serve: unhandled error")
            self.counts["server_errors"] += 1
            return JSONResponse(APIError(500, "internal error", type="server_error").body(), status_code=500)

        @app.middleware("http")
        async def guard(request, call_next):
            if request.url.path != "/health" and self.api_key is not None:
                given = request.headers.get("authorization", "")
                token = given[7:] if given[:7].lower() == "bearer " else ""
                if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                    return JSONResponse(APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                                 code="invalid_api_key").body(), status_code=401)
            return await call_next(request)

        @app.get("/health")
        async def health():
            alive = self.engine.engine.is_running()
            return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "hf_paged"}]}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(prometheus.generate_latest(self._registry).decode(),
                                     media_type=prometheus.CONTENT_TYPE_LATEST)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._serve(request, "completion")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._serve(request, "chat")

    # ------------------------------------------------------------------ one request
    async def _serve(self, request, kind: str):
        try:
            body = await self._body(request)
            parsed = parse(kind, body, [self.model_name], self.limits, self.vocab_size)
            prompt_ids = self._prompt_ids(parsed)
            params = self._params(parsed, len(prompt_ids))
        except APIError as exc:
            self.counts["client_errors"] += 1
            return self._JSONResponse(exc.body(), status_code=exc.status)
        if self.in_flight >= self.max_waiting:
            self.counts["rejected_busy"] += 1
            return self._JSONResponse(APIError(429, f"the server has {self.in_flight} requests in flight; retry "
                                                    "later", type="rate_limit_error").body(), status_code=429,
                                      headers={"Retry-After": "1"})
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        if parsed.stream:
            return self._StreamingResponse(self._stream(parsed, prompt_ids, params, rid),
                                           media_type="text/event-stream")
        self.in_flight += 1
        try:
            output = await self.engine.generate(prompt_ids, params, request_id=rid)
        finally:
            self.in_flight -= 1
        failed = [s.error for s in output.outputs if s.error is not None]
        if failed:
            status = 400 if isinstance(failed[0], (ValueError, TypeError)) else 500
            self.counts["client_errors" if status == 400 else "server_errors"] += 1
            return self._JSONResponse(APIError(status, f"generation failed: {failed[0]}",
                                               type="invalid_request_error" if status == 400 else "server_error").body(),
                                      status_code=status)
        self.counts["ok"] += 1
        return self._JSONResponse(self._response(parsed, rid, prompt_ids, output))

    async def _body(self, request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            raise APIError(413, f"the request body is larger than {self.limits.max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise APIError(413, f"the request body is larger than {self.limits.max_body_bytes} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise APIError(400, "the request body is not valid UTF-8") from None
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None

    def _prompt_ids(self, p: Parsed) -> list[int]:
        if p.kind == "chat":
            ids = self.tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        elif isinstance(p.prompt, str):
            ids = self.tokenizer(p.prompt)["input_ids"]
        else:
            ids = p.prompt
        if not ids:
            raise APIError(400, "the prompt is empty once tokenised", param="prompt")
        if len(ids) + p.max_tokens > self.limits.max_model_len:
            raise APIError(400, f"this model's context is {self.limits.max_model_len} tokens; the prompt has "
                                f"{len(ids)} and max_tokens asks for {p.max_tokens} more",
                           param="messages" if p.kind == "chat" else "prompt", code="context_length_exceeded")
        return list(ids)

    def _params(self, p: Parsed, prompt_len: int) -> SamplingParams:
        try:
            params = SamplingParams(max_new_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, n=p.n,
                                    stop=p.stop or None, seed=p.seed, logprobs=p.logprobs,
                                    presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                                    logit_bias=p.logit_bias or None)
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
            if p.kind == "chat":
                choice = {"index": i, "message": {"role": "assistant", "content": sample.text or ""},
                          "logprobs": self._chat_logprobs(sample) if p.logprobs is not None else None,
                          "finish_reason": reason}
            else:
                choice = {"index": i, "text": sample.text or "", "finish_reason": reason,
                          "logprobs": self._completion_logprobs(sample) if p.logprobs is not None else None}
            choices.append(choice)
        return {"id": rid, "object": "chat.completion" if p.kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": self._usage(prompt_ids, output.outputs)}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(self, sample) -> dict:
        content = []
        for token_id, lp in zip(sample.token_ids, sample.logprobs or []):
            token = self._token(token_id)
            content.append({"token": token, "logprob": lp.logprob, "bytes": list(token.encode()),
                            "top_logprobs": [{"token": self._token(t), "logprob": v,
                                              "bytes": list(self._token(t).encode())} for t, v in (lp.top or [])]})
        return {"content": content}

    def _completion_logprobs(self, sample) -> dict:
        tokens = [self._token(t) for t in sample.token_ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in sample.logprobs or []],
                "top_logprobs": [{self._token(t): v for t, v in (lp.top or [])} for lp in sample.logprobs or []],
                "text_offset": offsets}

    async def _stream(self, p: Parsed, prompt_ids, params, rid: str):
        """Server-Sent Events: one chunk per token event, the finish reasons, the usage chunk on request,
        then `[DONE]`. A client that goes away cancels this generator, which aborts the request."""
        created, obj = int(time.time()), "chat.completion.chunk" if p.kind == "chat" else "text_completion"
        counts = [0] * p.n
        self.in_flight += 1
        finished = False
        try:
            if p.kind == "chat":
                for i in range(p.n):
                    yield _sse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
            async for event in self.engine.stream(prompt_ids, params, request_id=rid):
                i = event.sample_index
                if event.token_id is not None:
                    counts[i] += 1
                text = event.text or ""
                reason = _finish_reason(event.finish_reason)
                if event.finish_reason == "error":
                    self.counts["server_errors"] += 1
                    yield _sse(APIError(500, "generation failed", type="server_error").body())
                    return
                choice = {"index": i, "finish_reason": reason, "logprobs": None}
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
            yield "data: [DONE]\n\n"
            finished = True
            self.counts["ok"] += 1
        finally:
            self.in_flight -= 1
            if not finished:
                self.counts["aborted"] += 1


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}.get(reason, reason)


class _EngineCollector:
    """Prometheus metrics read from the engine at each scrape, under vLLM's names."""

    def __init__(self, server: Server):
        self.server = server

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        m = self.server.engine.engine.metrics()
        labels = {"model_name": self.server.model_name}

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            g.add_metric(list(labels.values()), float(value or 0))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=list(labels))
            c.add_metric(list(labels.values()), float(value or 0))
            return c

        yield gauge("vllm:num_requests_running", "Requests running on the engine.", m["vllm:num_requests_running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting for the engine.", m["vllm:num_requests_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", m["vllm:kv_cache_usage_perc"])
        yield counter("vllm:prompt_tokens", "Prompt tokens computed.", m["vllm:prompt_tokens"])
        yield counter("vllm:generation_tokens", "Tokens generated.", m["vllm:generation_tokens"])
        yield counter("vllm:num_preemptions", "Preemptions.", m["vllm:num_preemptions"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up.", m["vllm:prefix_cache_queries"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache.", m["vllm:prefix_cache_hits"])
        yield counter("vllm:request_success", "Requests finished.", m["vllm:request_success"])
        for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                     "vllm:e2e_request_latency_seconds"):
            s = m[name]
            family = SummaryMetricFamily(name, name.split(":")[1].replace("_", " "), labels=list(labels))
            family.add_metric(list(labels.values()), count_value=s["count"], sum_value=s["sum"])
            yield family
        yield gauge("hf_paged:requests_in_flight", "HTTP requests being served.", self.server.in_flight)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def main(argv: list[str] | None = None) -> int:
    """`hf-paged serve MODEL_DIR|default|module:callable [--host --port --api-key ...]`."""
    import argparse
    import os
    import sys

    from ..engine import Engine
    from .models import ModelFromPath

    parser = argparse.ArgumentParser(prog="hf-paged serve", description="OpenAI-compatible server over hf_paged")
    parser.add_argument("model", help="a model folder, a factory 'module:callable', or 'default' (SmolLM2)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("HF_PAGED_API_KEY"),
                        help="require 'Authorization: Bearer <key>' (default: $HF_PAGED_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model id clients pass (default: the path)")
    parser.add_argument("--max-waiting", type=int, default=256, help="requests in flight before 429")
    parser.add_argument("--max-model-len", type=int, default=None, help="prompt + completion tokens per request")
    parser.add_argument("--max-tokens", type=int, default=1024, help="the largest max_tokens a request may ask")
    parser.add_argument("--max-n", type=int, default=8)
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=None, help="a fixed KV pool (blocks of --block-size)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--grace", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")
    args = parser.parse_args(argv)
    import uvicorn

    _require()
    bound_cpu_kernel_caches()  # before the first forward: a server's RSS stays flat (worker/cpu_caches.py)
    model, tokenizer = ModelFromPath(args.model)()
    if tokenizer is None:
        parser.error(f"{args.model} has no tokenizer")
    model = model.eval()
    limit = args.max_model_len or min(getattr(model.config, "max_position_embeddings", 2048) or 2048, 8192)
    engine = Engine(model, tokenizer, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                    num_blocks=args.num_blocks, max_model_len=limit, show_progress=False)
    name = args.served_model_name or ("default" if args.model == "default" else args.model)
    server = Server(AsyncEngine(engine), tokenizer, name, api_key=args.api_key,
                    limits=Limits(max_body_bytes=args.max_body_bytes, max_model_len=limit, max_tokens=args.max_tokens,
                                  max_n=args.max_n), max_waiting=args.max_waiting)
    if args.api_key is None and args.host not in LOOPBACK:
        print(f"WARNING: hf-paged serve listens on {args.host} without --api-key: anyone who can reach it can use "
              "it", file=sys.stderr, flush=True)
    config = uvicorn.Config(server.app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.grace, limit_concurrency=None)
    print(f"hf-paged serve: {name} on http://{args.host}:{args.port}", flush=True)
    # uvicorn drains on SIGTERM, then re-raises it under the handler it found: a no-op, so that a
    # drained shutdown exits 0 instead of dying of the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.Server(config).run()  # SIGTERM/SIGINT: stop accepting, finish in-flight requests, return
    engine.stop(drain=False)
    return 0
