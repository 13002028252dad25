"""The supervisor of a disaggregated engine: the worker processes, and the router thread that
places requests, watches heartbeats and re-runs what a dead worker held.

    request --> router --prefill--> prefill worker: prompt K/V + first token
                   ^                      |  one contiguous isend (gloo/NCCL)
                   |                      v
                   +------done------ decode worker: import K/V, register hashes, decode

The router thread (of the process that built the engine, or torchrun's rank 0) sends each request
to a prefill worker (prefix-cache affinity, then load: `router`) and names its decode worker (most
free KV blocks). Control messages go through the job's `TCPStore` (`mailbox`); K/V go point to
point over the workers' process group (`transfer`), one buffer per request, overlapping the
prefill worker's next steps.

Faults:
* a worker that dies (exit, SIGKILL) or stops answering (no heartbeat for `heartbeat_timeout`
  seconds; it is then killed) has its requests re-run from their prompts on the workers left (a
  worker beats between engine steps, and, while one step runs long, from a pulse thread for up to
  `disagg.worker.STEP_PULSE_LIMIT` seconds of it);
  results of an abandoned attempt are ignored, so nothing is returned twice, and a stream never
  repeats a token it already gave;
* a transfer that fails or times out is asked for once more, then the decode worker recomputes
  the request itself; with no prefill worker left, decode workers run whole requests;
* `close()` (or interpreter exit) stops every worker, killing what does not stop in time; workers
  also exit when the process that started them is gone.

The callers' side (checking prompts, `generate` / `stream`) is `client.DisaggregatedEngine`; each
request reaches this thread as a `Routed`, and its events and output go to the `owner` it names.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import weakref
from collections import defaultdict

import torch

from ..engine.outputs import CompletionOutput, RequestOutput, StreamEvent
from ..sampling_params import SamplingParams
from .mailbox import Mailbox
from .router import Router
from .worker import ROUTER, WorkerSpec
from .worker import main as worker_main

logger = logging.getLogger(__name__)

# The control messages that concern one request (the rest: start-up, heartbeats, shutdown, and the
# token batches a stream adds per decode step).
REQUEST_OPS = frozenset({"prefill", "run", "first", "kv", "got", "resend", "lost", "done", "failed", "recomputed",
                         "abort"})


@dataclasses.dataclass
class Routed:
    """The router's view of one request."""

    rid: str
    index: int
    prompt: list[int]
    params: SamplingParams
    owner: "queue.SimpleQueue"  # where its events and final output go (anything with `put`)
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


class Supervisor:
    """The router's state and thread, over worker processes started by `spawn` (or torchrun's).

    Args:
        store: the job's `TCPStore` (this process hosts it).
        num_prefill, num_decode: workers per role. With no prefill worker the engine is data-parallel:
            its workers ("replica0", ...) run whole requests, routed by prefix affinity then load.
        block_size: tokens per KV block (the workers' engines use the same).
        heartbeat_timeout: seconds without a heartbeat after which a worker is taken for dead.
    """

    def __init__(self, store, num_prefill: int, num_decode: int, block_size: int, heartbeat_timeout: float):
        self.block_size = block_size
        self.heartbeat_timeout = heartbeat_timeout
        self.prefill_names = [f"prefill{i}" for i in range(num_prefill)]
        self.data_parallel = num_prefill == 0
        self.decode_names = [f"{'replica' if self.data_parallel else 'decode'}{j}" for j in range(num_decode)]
        self.names = self.prefill_names + self.decode_names
        self.ranks = {name: r for r, name in enumerate(self.names)}  # each worker's (rank 0's) K/V-group rank
        self.layout: dict[str, list[int]] = {}  # tensor-parallel workers: every rank of each
        self.router = Router(self.prefill_names, self.decode_names, block_size)
        self.store = store
        self.mailbox = Mailbox(store, ROUTER)
        self._procs: dict[str, object] = {}
        self._status: dict[str, dict] = {}
        self.ready_reports: dict[str, dict] = {}  # each worker's "ready" message (vocab_size, max_model_len...)
        self._beats = {name: (-1, time.monotonic()) for name in self.names}
        self._active: dict[str, Routed] = {}
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._finalizer = None
        self._transfers: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # pair -> count, bytes, s
        self.counters = defaultdict(int)  # requests, reroutes, recomputed, finished...

    @classmethod
    def spawn(cls, model_factory, num_prefill: int, num_decode: int, backend: str, *, engine_kwargs: dict,
              device: str, num_threads: int | None, heartbeat_timeout: float, transfer_timeout: float,
              start_timeout: float, faults: dict | None, tensor_parallel_sizes: tuple[int, int] = (1, 1)
              ) -> "Supervisor":
        """Host the store, start one process per worker (a tensor-parallel worker starts its other ranks
        itself: `tensor_parallel_sizes` per role, prefill then decode), and route once they are all ready."""
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self = cls(store, num_prefill, num_decode, engine_kwargs["block_size"], heartbeat_timeout)
        world = len(self.names)
        if max(tensor_parallel_sizes) > 1:
            world = 0
            for name in self.names:
                size = tensor_parallel_sizes[0 if name in self.prefill_names else 1]
                self.layout[name] = list(range(world, world + size))
                world += size
            self.ranks = {name: ranks[0] for name, ranks in self.layout.items()}
        threads = num_threads or max(1, (os.cpu_count() or 1) // world)
        ctx = torch.multiprocessing.get_context("spawn")
        procs: dict[str, object] = {}
        for name in self.names:
            worker_device = device
            if str(device) == "cuda" and torch.cuda.is_available():
                worker_device = f"cuda:{self.ranks[name] % torch.cuda.device_count()}"
            role = "prefill" if name in self.prefill_names else "replica" if self.data_parallel else "decode"
            spec = WorkerSpec(name=name, role=role,
                              rank=self.ranks[name], world_size=world, host="127.0.0.1",
                              port=self.store.port, backend=backend, model_factory=model_factory,
                              engine_kwargs=engine_kwargs, num_threads=threads, device=worker_device,
                              transfer_timeout=transfer_timeout, start_timeout=start_timeout,
                              parent_pid=os.getpid(), faults=(faults or {}).get(name, {}), layout=self.layout)
            proc = ctx.Process(target=worker_main, args=(spec,), name=f"hf_paged-{name}", daemon=True)
            proc.start()
            procs[name] = proc
        self.start(procs, start_timeout)
        return self

    def start(self, procs: dict, start_timeout: float) -> None:
        """Wait for every worker in `procs` (name -> process, or a stand-in with `is_alive`, `kill`,
        `join`, `pid` and `exitcode`) to be ready, then start the router thread."""
        self._procs = dict(procs)
        self._finalizer = weakref.finalize(self, _kill_all, list(self._procs.values()))
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._loop, name="hf_paged-router", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the callers' side
    def submit(self, routed: Routed) -> None:
        self._new.put(("add", routed))

    def abort(self, request_id: str) -> None:
        self._new.put(("abort", request_id))

    @property
    def is_closed(self) -> bool:
        return self._closed

    def is_running(self) -> bool:
        """Whether the router thread is routing (started, not closed, not failed)."""
        return (not self._closed and self._error is None and self._thread is not None
                and self._thread.is_alive())

    def check_running(self) -> None:
        """Raise RuntimeError if requests in flight can no longer finish (the router failed or was closed)."""
        if self._error is not None:
            raise RuntimeError("the disaggregated router stopped") from self._error
        if self._thread is None or not self._thread.is_alive() or self._closed:
            raise RuntimeError("the DisaggregatedEngine was closed with requests unfinished")

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
        messages = sum(n for counts in sent for op, n in counts.items() if op in REQUEST_OPS)
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
        if self._thread is not None:
            self._thread.join(5)
        if self._finalizer is not None:
            self._finalizer.detach()

    # ------------------------------------------------------------------ the router loop
    def _wait_ready(self, timeout: float) -> None:
        ready: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(ready) < len(self._procs):
            for message in self.mailbox.poll():
                if message["op"] == "ready":
                    ready.add(message["name"])
                    self._status[message["name"]] = message
                    self.ready_reports[message["name"]] = dict(message)
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
            if self.data_parallel:
                progressed |= self._dispatch_whole(r)
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

    def _dispatch_whole(self, r: Routed) -> bool:
        """Data parallelism: one replica runs the request whole (prefix affinity, then load)."""
        replica = self.router.choose_replica(r.prompt)
        if replica is None:
            self._finish_error(r, RuntimeError("no replica is left"))
            return True
        r.decode, r.prefill, r.pledged, r.stage = replica, None, 0, "local"
        r.attempt_tokens, r.attempt_text = 0, ""
        self.router.start_run(replica, r.prompt, r.params.max_new_tokens)
        self.mailbox.send(replica, {"op": "run", "rid": r.rid, "attempt": r.attempt, "prompt": r.prompt,
                                    "params": r.params, "stream": r.stream})
        return True

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

    def _emit(self, r: Routed, events: list) -> None:
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

    def _finish(self, r: Routed, output: RequestOutput, first_logprobs, moved: dict | None) -> None:
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

    def _finish_error(self, r: Routed, error) -> None:
        exc = error if isinstance(error, BaseException) else RuntimeError(str(error))
        output = RequestOutput(request_id=r.rid, prompt_token_ids=r.prompt,
                               outputs=[CompletionOutput(0, finish_reason="error", error=exc)], finish_reason="error")
        r.owner.put(StreamEvent(r.rid, r.index, None, None, "error") if r.stream else output)
        self._close_request(r)
        self.counters["errored"] += 1

    def _release(self, r: Routed) -> None:
        """Undo what routing `r` counted against its workers (pledged blocks, outstanding tokens)."""
        if r.decode is not None:
            self.router.unpledge(r.decode, r.pledged)
            if self.data_parallel and r.stage == "local":
                self.router.end_run(r.decode, r.prompt, r.params.max_new_tokens)
        if r.stage == "prefill" and r.prefill is not None:
            self.router.end_prefill(r.prefill, r.prompt)

    def _close_request(self, r: Routed) -> None:
        self._release(r)
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
            self.mailbox.send(other, {"op": "dead", "rank": self.ranks[name], "ranks": self.layout.get(name)})
        for r in list(self._active.values()):
            if (r.stage == "prefill" and name in (r.prefill, r.decode)) or (
                    r.stage in ("decode", "local") and r.decode == name):
                self._release(r)
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
