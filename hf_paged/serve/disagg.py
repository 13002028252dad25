"""Disaggregated prefill and decode over torch.distributed: `DisaggregatedEngine`, and the same
topology under torchrun (`python -m torch.distributed.run ... -m hf_paged.serve.disagg`).

    request --> router --prefill--> prefill worker: prompt K/V + first token
                   ^                      |  one contiguous isend (gloo/NCCL)
                   |                      v
                   +------done------ decode worker: import K/V, register hashes, decode

Prefill is compute-bound and decode bandwidth-bound; on one engine a long prompt's chunk stalls
every running decode. Here each role has its own processes, each with a model replica and an
`Engine`. The router (a thread of the process that built the engine, or torchrun's rank 0) sends
each request to a prefill worker (prefix-cache affinity, then load) and names its decode worker
(most free KV blocks). Control messages go through the job's `TCPStore` (`mailbox`); K/V go
point to point over the workers' process group (`transfer`), one buffer per request, overlapping
the prefill worker's next steps.

Faults:
* a worker that dies (exit, SIGKILL) or stops answering (no heartbeat for `heartbeat_timeout`
  seconds; it is then killed) has its requests re-run from their prompts on the workers left (a
  worker beats between engine steps, and, while one step runs long, from a pulse thread for up to
  `serve.worker.STEP_PULSE_LIMIT` seconds of it);
  results of an abandoned attempt are ignored, so nothing is returned twice, and a stream never
  repeats a token it already gave;
* a transfer that fails or times out is asked for once more, then the decode worker recomputes
  the request itself; with no prefill worker left, decode workers run whole requests;
* a bad request fails alone, with the engine's ValueError in its output;
* `close()` (or leaving the `with` block, or interpreter exit) stops every worker, killing what
  does not stop in time; workers also exit when the process that started them is gone.

Limits: one sample per request (n = 1), no prompt logprobs, an unquantised cache with one KV group
(sliding-window models run with `enable_hybrid_kv=False`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Iterator, Sequence as SequenceABC

import torch

from ..config import EngineConfig
from ..engine.outputs import CompletionOutput, RequestOutput, StreamEvent
from ..sampling_params import SamplingParams
from ..worker.sampling import draw_seed
from .mailbox import Mailbox
from .models import ModelFromPath
from .router import Router
from .worker import ROUTER, WorkerSpec
from .worker import main as worker_main

logger = logging.getLogger(__name__)

# The control messages that concern one request (the rest: start-up, heartbeats, shutdown, and the
# token batches a stream adds per decode step).
_REQUEST_OPS = frozenset({"prefill", "run", "first", "kv", "got", "resend", "lost", "done", "failed", "recomputed",
                          "abort"})


@dataclasses.dataclass
class _Routed:
    """The router's view of one request."""

    rid: str
    index: int
    prompt: list[int]
    params: SamplingParams
    owner: "queue.SimpleQueue"  # where its events and final output go
    stream: bool = False
    attempt: int = 0
    stage: str = "queued"  # queued -> prefill -> decode -> done; "local": a decode worker runs it whole
    prefill: str | None = None
    decode: str | None = None
    pledged: int = 0
    emitted_tokens: int = 0  # streamed to the caller so far (a re-run never repeats them)
    emitted_text: str = ""
    attempt_tokens: int = 0  # seen from the current attempt
    attempt_text: str = ""
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None


class DisaggregatedEngine:
    """Prefill and decode workers in their own processes, with `Engine`'s `generate`/`stream`/`metrics`.

    Args:
        model_factory: a picklable callable returning the model (loaded with
            `attn_implementation="hf_paged"`), or `(model, tokenizer)`; each worker calls it once.
        num_prefill, num_decode: workers per role (at least one decode worker).
        backend: the K/V process group's backend; default "gloo" on CPU, "nccl" on CUDA.
        tokenizer: tokenises string prompts here (token-id prompts need none).
        engine_kwargs: passed to every worker's `Engine` (`block_size`, `num_blocks`,
            `enable_prefix_caching`, `max_num_seqs`, ...).
        device: where workers run ("cpu", "cuda": worker i takes GPU i modulo the GPUs present).
        num_threads: torch threads per worker (default: the cores split evenly).
        heartbeat_timeout: seconds without a heartbeat after which a worker is taken for dead (a long
            engine step keeps beating, up to `serve.worker.STEP_PULSE_LIMIT` seconds).
        transfer_timeout: seconds a K/V transfer may take before it is asked for again.
        start_timeout: seconds the workers may take to start (model loading included).
        faults: test hooks per worker name (see `serve.worker`).
    """

    def __init__(self, model_factory, num_prefill: int = 1, num_decode: int = 2, backend: str | None = None, *,
                 tokenizer=None, engine_kwargs: dict | None = None, device: str = "cpu", num_threads: int | None = None,
                 heartbeat_timeout: float = 10.0, transfer_timeout: float = 10.0, start_timeout: float = 300.0,
                 faults: dict | None = None):
        import torch.distributed as dist

        if not isinstance(num_prefill, int) or not isinstance(num_decode, int) or num_prefill < 0 or num_decode < 1:
            raise ValueError(f"need num_prefill >= 0 and num_decode >= 1, got {num_prefill!r} and {num_decode!r}")
        if not callable(model_factory):
            raise TypeError("model_factory must be a picklable callable returning the model (or model, tokenizer)")
        engine_kwargs = {"block_size": EngineConfig.block_size, "enable_hybrid_kv": False, **(engine_kwargs or {})}
        backend = backend or ("nccl" if str(device).startswith("cuda") else "gloo")
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        names = self._init_router(store, num_prefill, num_decode, engine_kwargs["block_size"], heartbeat_timeout,
                                  tokenizer)
        threads = num_threads or max(1, (os.cpu_count() or 1) // len(names))
        ctx = torch.multiprocessing.get_context("spawn")
        self._procs: dict[str, object] = {}
        for name in names:
            worker_device = device
            if str(device) == "cuda" and torch.cuda.is_available():
                worker_device = f"cuda:{self.ranks[name] % torch.cuda.device_count()}"
            spec = WorkerSpec(name=name, role="prefill" if name in self.prefill_names else "decode",
                              rank=self.ranks[name], world_size=len(names), host="127.0.0.1", port=self.store.port,
                              backend=backend, model_factory=model_factory, engine_kwargs=engine_kwargs,
                              num_threads=threads, device=worker_device, transfer_timeout=transfer_timeout,
                              start_timeout=start_timeout, parent_pid=os.getpid(),
                              faults=(faults or {}).get(name, {}))
            proc = ctx.Process(target=worker_main, args=(spec,), name=f"hf_paged-{name}", daemon=True)
            proc.start()
            self._procs[name] = proc
        self._finalizer = weakref.finalize(self, _kill_all, list(self._procs.values()))
        self._start(start_timeout)

    def _init_router(self, store, num_prefill: int, num_decode: int, block_size: int, heartbeat_timeout: float,
                     tokenizer) -> list[str]:
        """The router's state (both the spawning engine and torchrun's rank 0); returns the workers' names."""
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.heartbeat_timeout = heartbeat_timeout
        self.prefill_names = [f"prefill{i}" for i in range(num_prefill)]
        self.decode_names = [f"decode{j}" for j in range(num_decode)]
        names = self.prefill_names + self.decode_names
        self.ranks = {name: r for r, name in enumerate(names)}
        self.router = Router(self.prefill_names, self.decode_names, block_size)
        self.store = store
        self.mailbox = Mailbox(store, ROUTER)
        self._status: dict[str, dict] = {}
        self._beats = {name: (-1, time.monotonic()) for name in names}
        self._active: dict[str, _Routed] = {}
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = iter(range(1 << 62))
        self._lock = threading.Lock()
        self._closed = False
        self._error: BaseException | None = None
        self._transfers: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # pair -> count, bytes, s
        self.counters = defaultdict(int)  # requests, reroutes, recomputed, finished...
        return names

    def _start(self, start_timeout: float) -> None:
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._loop, name="hf_paged-router", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public surface
    def generate(self, prompts, sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order, as `Engine.generate` returns them; a rejected
        prompt gets an output with `.error` set, the others are unaffected."""
        owner: queue.SimpleQueue = queue.SimpleQueue()
        routed, results = self._submit(prompts, sampling_params, owner, stream=False)
        pending = {r.rid: r.index for r in routed}
        while pending:
            item = self._next(owner)
            if isinstance(item, RequestOutput) and item.request_id in pending:
                results[pending.pop(item.request_id)] = item
        return results

    def stream(self, prompts, sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None
               ) -> Iterator[StreamEvent]:
        """`StreamEvent`s of every prompt as tokens arrive; each request's last event has its
        `finish_reason` (texts join to its output's text)."""
        owner: queue.SimpleQueue = queue.SimpleQueue()
        routed, results = self._submit(prompts, sampling_params, owner, stream=True)
        for i, out in enumerate(results):
            if out is not None:  # rejected before routing
                yield StreamEvent(out.request_id, i, None, None, "error")
        pending = {r.rid for r in routed}
        try:
            while pending:
                item = self._next(owner)
                if isinstance(item, StreamEvent):
                    if item.finish_reason is not None:
                        pending.discard(item.request_id)
                    yield item
        finally:
            for rid in pending:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._new.put(("abort", request_id))

    def metrics(self) -> dict:
        """Router counters, K/V transfers per worker pair (count, bytes, seconds, bytes/s), control
        messages and tensor sends, and each worker's last reported status."""
        fresh = {name: self.mailbox.status_of(name) for name in self.router.alive()}
        with self._lock:
            self._status.update({name: st for name, st in fresh.items() if st is not None})
            transfers = {pair: {"count": int(c), "bytes": int(b), "seconds": s,
                                "bandwidth_bytes_per_s": b / s if s > 0 else 0.0}
                         for pair, (c, b, s) in self._transfers.items()}
            status = {name: dict(st) for name, st in self._status.items()}
            counters = dict(self.counters)
        sent = [st.get("messages_sent", {}) for st in status.values()] + [self.mailbox.num_sent]
        messages = sum(n for counts in sent for op, n in counts.items() if op in _REQUEST_OPS)
        return {**counters, "transfers": transfers,
                "kv_bytes_transferred": sum(t["bytes"] for t in transfers.values()),
                "kv_transfer_seconds": sum(t["seconds"] for t in transfers.values()),
                "control_messages": messages, "tensor_sends": sum(st.get("tensors_sent", 0) for st in status.values()),
                "workers": status, "dead_workers": sorted(self.router.dead)}

    @property
    def worker_pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    def send_control(self, name: str, message: dict) -> None:
        """Send a worker a control message directly (the test hooks' "freeze")."""
        self.mailbox.send(name, message)

    def close(self, timeout: float = 20.0) -> None:
        """Stop every worker (those that do not exit within `timeout` seconds are killed) and the router."""
        if self._closed:
            return
        self._closed = True
        for name, proc in self._procs.items():
            if proc.is_alive():
                try:
                    self.mailbox.send(name, {"op": "stop"})
                except Exception:  # noqa: BLE001 - the store is gone: kill below
                    pass
        deadline = time.monotonic() + timeout
        for proc in self._procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        _kill_all(list(self._procs.values()))
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(5)
        self._finalizer.detach()

    def __enter__(self) -> "DisaggregatedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ submission
    def _submit(self, prompts, sampling_params, owner, stream: bool):
        if self._closed:
            raise RuntimeError("this DisaggregatedEngine is closed")
        if isinstance(prompts, str) or (isinstance(prompts, SequenceABC) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, SequenceABC):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        routed, results = [], [None] * len(prompts)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = f"dreq-{next(self._ids)}"
            try:
                ids, p = self._checked(prompt, p)
            except (ValueError, TypeError) as exc:
                results[i] = RequestOutput(request_id=rid, prompt_token_ids=prompt if isinstance(prompt, list) else [],
                                           outputs=[CompletionOutput(0, finish_reason="error", error=exc)],
                                           finish_reason="error")
                continue
            routed.append(_Routed(rid, i, ids, p, owner, stream=stream))
        for r in routed:
            self._new.put(("add", r))
        return routed, results

    def _checked(self, prompt, params) -> tuple[list[int], SamplingParams]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError("DisaggregatedEngine serves one sample per request (n=1)")
        if params.prompt_logprobs is not None:
            raise ValueError("DisaggregatedEngine does not return prompt logprobs")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need tokenizer= (or pass token ids)")
            prompt = self.tokenizer(prompt)["input_ids"]
        if not isinstance(prompt, SequenceABC) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in prompt):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("empty prompt")
        if params.seed is None:  # every attempt and both workers draw with the same seed
            params = dataclasses.replace(params, seed=draw_seed(None))
        return list(prompt), params

    def _next(self, owner: queue.SimpleQueue):
        while True:
            try:
                return owner.get(timeout=0.5)
            except queue.Empty:
                if self._error is not None:
                    raise RuntimeError("the disaggregated router stopped") from self._error
                if not self._thread.is_alive() or self._closed:
                    raise RuntimeError("the DisaggregatedEngine was closed with requests unfinished")

    # ------------------------------------------------------------------ the router loop
    def _wait_ready(self, timeout: float) -> None:
        ready: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(ready) < len(self._procs):
            for message in self.mailbox.poll():
                if message["op"] == "ready":
                    ready.add(message["name"])
                    self._status[message["name"]] = message
                    self.router.report(message["name"], message.get("free_blocks"))
                elif message["op"] == "crashed":
                    raise RuntimeError(f"worker {message['name']} failed to start: {message['error']}")
            for name, proc in self._procs.items():
                if name not in ready and not proc.is_alive():
                    raise RuntimeError(f"worker {name} exited with code {proc.exitcode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {sorted(set(self._procs) - ready)} not ready within {timeout} s")
            time.sleep(0.01)

    def _loop(self) -> None:
        last_check = 0.0
        try:
            while not self._closed:
                busy = False
                while True:
                    try:
                        command = self._new.get_nowait()
                    except queue.Empty:
                        break
                    busy = True
                    if command[0] == "add":
                        self._active[command[1].rid] = command[1]
                        self.counters["requests"] += 1
                    elif command[0] == "abort":
                        self._abort(command[1])
                for message in self.mailbox.poll():
                    busy = True
                    self._on_message(message)
                now = time.monotonic()
                if now - last_check > 0.05:
                    last_check = now
                    self._check_workers(now)
                busy |= self._dispatch()
                if not busy:
                    time.sleep(0.002)
        except BaseException as exc:  # noqa: BLE001 - callers waiting are told, not left hanging
            logger.exception("hf_paged: the disaggregated router failed")
            self._error = exc

    def _dispatch(self) -> bool:
        progressed = False
        for r in list(self._active.values()):
            if r.stage != "queued":
                continue
            decode = self.router.choose_decode()
            if decode is None:
                self._finish_error(r, RuntimeError("no decode worker is left"))
                continue
            prefill = self.router.choose_prefill(r.prompt)
            r.decode, r.prefill = decode, prefill
            r.pledged = self.router.blocks_for(len(r.prompt) + r.params.max_new_tokens)
            self.router.pledge(decode, r.pledged)
            r.attempt_tokens, r.attempt_text = 0, ""
            message = {"rid": r.rid, "attempt": r.attempt, "prompt": r.prompt, "params": r.params, "stream": r.stream}
            if prefill is None:  # no prefill worker left: the decode worker computes it whole
                r.stage = "local"
                self.mailbox.send(decode, {"op": "run", **message})
            else:
                r.stage = "prefill"
                self.router.start_prefill(prefill, r.prompt)
                self.mailbox.send(prefill, {"op": "prefill", **message, "decode": decode,
                                            "decode_rank": self.ranks[decode]})
            progressed = True
        return progressed

    def _on_message(self, message: dict) -> None:
        op = message["op"]
        if op == "crashed":
            self._on_dead(message["name"], f"crashed: {message['error']}")
            return
        r = self._active.get(message.get("rid"))
        if r is None or message.get("attempt") != r.attempt:
            return  # an abandoned attempt's, or a finished request's
        if op == "first":
            if r.prefill is not None:
                self.router.end_prefill(r.prefill, r.prompt)
            r.stage = "decode"
            r.first_token_time = time.perf_counter()
            self._emit(r, [(t, "") for t in message["token_ids"]])
        elif op == "tokens":
            self._emit(r, message["events"])
        elif op == "done":
            self._finish(r, message["output"], message.get("first_logprobs"), message.get("transfer"))
        elif op == "failed":
            self._finish_error(r, message["error"])
        elif op == "recomputed":
            self.counters["recomputed"] += 1

    def _emit(self, r: _Routed, events: list) -> None:
        """Stream the current attempt's tokens the caller has not had yet (a re-run repeats none)."""
        if not r.stream:
            return
        for token, text in events:
            r.attempt_tokens += 1
            r.attempt_text += text or ""
            if r.attempt_tokens > r.emitted_tokens:
                delta = r.attempt_text[len(r.emitted_text):] if r.attempt_text.startswith(r.emitted_text) else ""
                r.owner.put(StreamEvent(r.rid, r.index, token, delta, None))
                r.emitted_tokens, r.emitted_text = r.attempt_tokens, r.emitted_text + delta

    def _finish(self, r: _Routed, output: RequestOutput, first_logprobs, moved: dict | None) -> None:
        sample = output.outputs[0]
        if first_logprobs and sample.logprobs is not None and len(sample.logprobs) < len(sample.token_ids):
            sample.logprobs = list(first_logprobs) + list(sample.logprobs)
        output.request_id = r.rid
        if moved is not None:
            with self._lock:
                entry = self._transfers[f"{moved['src']}->{r.decode}"]
                entry[0] += 1
                entry[1] += moved["bytes"]
                entry[2] += moved["seconds"]
        if r.stream:
            tokens = sample.token_ids
            for j in range(r.emitted_tokens, len(tokens)):
                last = j == len(tokens) - 1
                text = (sample.text or "")[len(r.emitted_text):] if last else ""
                r.owner.put(StreamEvent(r.rid, r.index, tokens[j], text, sample.finish_reason if last else None))
            if r.emitted_tokens >= len(tokens):
                r.owner.put(StreamEvent(r.rid, r.index, None, (sample.text or "")[len(r.emitted_text):],
                                        sample.finish_reason))
        else:
            r.owner.put(output)
        self._close_request(r)
        self.counters["finished"] += 1

    def _finish_error(self, r: _Routed, error) -> None:
        exc = error if isinstance(error, BaseException) else RuntimeError(str(error))
        output = RequestOutput(request_id=r.rid, prompt_token_ids=r.prompt,
                               outputs=[CompletionOutput(0, finish_reason="error", error=exc)], finish_reason="error")
        r.owner.put(StreamEvent(r.rid, r.index, None, None, "error") if r.stream else output)
        self._close_request(r)
        self.counters["errored"] += 1

    def _close_request(self, r: _Routed) -> None:
        if r.decode is not None:
            self.router.unpledge(r.decode, r.pledged)
        if r.stage == "prefill" and r.prefill is not None:
            self.router.end_prefill(r.prefill, r.prompt)
        r.stage = "done"
        self._active.pop(r.rid, None)

    def _abort(self, rid: str) -> None:
        r = self._active.get(rid)
        if r is None:
            return
        for name in {r.prefill, r.decode} - {None}:
            if name not in self.router.dead:
                self.mailbox.send(name, {"op": "abort", "rid": rid})
        output = RequestOutput(request_id=rid, prompt_token_ids=r.prompt,
                               outputs=[CompletionOutput(0, finish_reason="abort")], finish_reason="abort")
        r.owner.put(StreamEvent(rid, r.index, None, None, "abort") if r.stream else output)
        self._close_request(r)

    # ------------------------------------------------------------------ failures
    def _check_workers(self, now: float) -> None:
        for name, proc in self._procs.items():
            if name in self.router.dead:
                continue
            if not proc.is_alive():
                self._on_dead(name, f"exited with code {proc.exitcode}")
                continue
            beats = self.mailbox.beats_of(name)
            seen, since = self._beats[name]
            if beats != seen:
                self._beats[name] = (beats, now)
                status = self.mailbox.status_of(name)
                if status is not None:
                    with self._lock:
                        self._status[name] = status
                    self.router.report(name, status.get("free_blocks"))
            elif now - since > self.heartbeat_timeout:
                self._on_dead(name, f"no heartbeat for {now - since:.1f} s")

    def _on_dead(self, name: str, why: str) -> None:
        if name in self.router.dead:
            return
        logger.warning("hf_paged: disaggregated worker %s is dead (%s); re-routing its requests", name, why)
        self.router.mark_dead(name)
        self.counters["dead_workers"] += 1
        proc = self._procs[name]
        if proc.is_alive():  # hung: make sure it can never answer again (SIGKILL)
            proc.kill()
            proc.join(5)
        for other in self.router.alive():
            self.mailbox.send(other, {"op": "dead", "rank": self.ranks[name]})
        for r in list(self._active.values()):
            if (r.stage == "prefill" and name in (r.prefill, r.decode)) or (
                    r.stage in ("decode", "local") and r.decode == name):
                self.router.unpledge(r.decode, r.pledged)
                if r.stage == "prefill" and r.prefill is not None:
                    self.router.end_prefill(r.prefill, r.prompt)
                r.attempt += 1
                r.stage = "queued"
                self.counters["reroutes"] += 1
        if not self.router.alive():
            for r in list(self._active.values()):
                self._finish_error(r, RuntimeError("every disaggregated worker is dead"))


def _kill_all(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5)


# ---------------------------------------------------------------------------------------- torchrun
def main(argv: list[str] | None = None) -> int:
    """`python -m torch.distributed.run --nproc-per-node 1+P+D -m hf_paged.serve.disagg --prefill P
    --decode D --model default|DIR --input prompts.jsonl --output out.jsonl`: rank 0 routes (and writes
    the outputs), ranks 1..P prefill, the rest decode."""
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="hf_paged.serve.disagg", description=main.__doc__)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--model", default="default", help="a model folder, a factory 'module:callable', or "
                                                               "'default' (SmolLM2-135M-Instruct)")
    parser.add_argument("--input", required=True, help="JSON lines with a 'prompt' (text) or 'token_ids' per row")
    parser.add_argument("--output", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    EngineConfig.add_cli_args(parser, ["block_size"])
    parser.add_argument("--backend", default=None)
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 1 + args.prefill + args.decode:
        parser.error(f"torchrun started {world} processes; --prefill {args.prefill} --decode {args.decode} needs "
                     f"{1 + args.prefill + args.decode} (one router)")
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    factory = ModelFromPath(args.model)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if rank > 0:
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = f"cuda:{local % torch.cuda.device_count()}" if backend == "nccl" else "cpu"
        name = f"prefill{rank - 1}" if rank <= args.prefill else f"decode{rank - 1 - args.prefill}"
        worker_main(WorkerSpec(name=name, role=name.rstrip("0123456789"), rank=rank - 1, world_size=world - 1,
                               host=host, port=port, backend=backend, model_factory=factory,
                               engine_kwargs={"block_size": args.block_size, "enable_hybrid_kv": False},
                               num_threads=max(1, (os.cpu_count() or 1) // (world - 1)), device=device))
        return 0  # not reached: worker_main exits the process
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    engine = _TorchrunRouter(store, args.prefill, args.decode, args.block_size, args.heartbeat_timeout)
    _, tokenizer = factory(tokenizer_only=True)
    rows = [json.loads(line) for line in open(args.input) if line.strip()]
    if tokenizer is None and any("token_ids" not in row for row in rows):
        parser.error(f"{args.model} has no tokenizer: give every input row 'token_ids'")
    prompts = [row["token_ids"] if "token_ids" in row else tokenizer(row["prompt"])["input_ids"] for row in rows]
    try:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
        with open(args.output, "w") as f:
            for i, out in enumerate(outputs):
                text = tokenizer.decode(out.token_ids) if tokenizer is not None else None
                f.write(json.dumps({"index": i, "token_ids": out.token_ids, "text": text,
                                    "finish_reason": out.finish_reason,
                                    "error": None if out.error is None else str(out.error)}) + "\n")
        print(json.dumps({k: v for k, v in engine.metrics().items() if k != "workers"}, default=str))
    finally:
        engine.close()
    return 0

class _TorchrunRouter(DisaggregatedEngine):
    """The router of a torchrun job: the workers are torchrun's processes, not children of this one."""

    def __init__(self, store, num_prefill: int, num_decode: int, block_size: int, heartbeat_timeout: float):
        names = self._init_router(store, num_prefill, num_decode, block_size, heartbeat_timeout, None)
        self._procs = {name: _RemoteWorker() for name in names}
        self._finalizer = weakref.finalize(self, lambda: None)
        self._start(600.0)


class _RemoteWorker:
    """A torchrun worker as the router sees it: alive while it beats (torchrun owns the process)."""

    pid = -1
    exitcode = None

    def is_alive(self) -> bool:
        return True

    def join(self, timeout=None) -> None:
        return None

    def kill(self) -> None:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
