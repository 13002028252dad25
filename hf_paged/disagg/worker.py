"""One worker process of a disaggregated engine: a model replica, its own `Engine`, and a loop that
takes control messages, moves K/V and steps the engine. The loop is the only thread that touches
the engine. It beats between steps; while one step runs long (a 2,048-token prefill chunk takes
about 9 s on one slow CPU core), a pulse thread beats for it, up to `STEP_PULSE_LIMIT` seconds, so
that only a worker that stops making progress is taken for dead.

Prefill role: each request runs with one new token and its sequence kept (`retain_kv`); the first
token goes to the router, the prompt's K/V to the decode worker (`export_kv`, one `isend`), whose
acknowledgement frees the buffer. A request that ends at its first token (EOS, a stop, or
`max_new_tokens=1`) is finished here.

Decode role: a K/V message posts its `irecv`; once the buffer is in, it is written into this
engine's blocks (`import_kv`, prefix hashes registered) and the request resumes after the first
token (`resume_tokens`). A transfer that fails or times out is asked for once more; if that fails
too, the request is recomputed here from its prompt. A decode worker also runs whole requests
("run") when no prefill worker is left.

Tensor-parallel workers (`WorkerSpec.layout` gives a worker several ranks): the worker's process is
rank 0 of its model and starts the others (its factory, `parallel.TensorParallelReplica`, runs them as
`disagg.rank`). Every rank joins the K/V group, and each request's K/V move in pieces
(`transfer.plan_pieces`): rank 0 decides, and tells its other ranks over the model's TP group
(`Engine.tell_ranks`) to send their heads ("kv_out"), to post their receives ("kv_recv"), to write
what arrived into the blocks rank 0 reserved ("kv_write", committed only if every rank wrote:
`Engine.all_ranks_ok`), or to drop it ("kv_drop"). A transfer in several pieces is not sent again:
the decode worker recomputes the request instead.

Replica role (a data-parallel engine): whole requests only. A replica moves no K/V, so it joins no
K/V process group, and its model may itself be tensor-parallel (its factory starts the other
ranks, `parallel.TensorParallelReplica`: the replica's process is their rank 0).

Test hooks (`WorkerSpec.faults`): `drop_transfers=k` skips the first k sends of the first request
transferred (its control messages still go: k=1 is made good by the retry, k=2 makes the decode
worker recompute it), `freeze_on_request=True` lets a "freeze" message stop the loop for good
(no more heartbeats), as a hung worker would, and `slow_step_seconds=s` makes every engine step
take s seconds longer, as a long prefill on a slow CPU does.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.util
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ..engine import Engine
from ..engine.delivery import Inbox
from ..sampling_params import SamplingParams
from . import transfer
from .mailbox import Mailbox

logger = logging.getLogger(__name__)

ROUTER = "router"
# A step that runs longer than this stops being vouched for by the pulse: its worker then looks hung.
STEP_PULSE_LIMIT = 600.0


@dataclass
class WorkerSpec:
    """Everything a worker process needs (picklable: it crosses the spawn)."""

    name: str
    role: str  # "prefill", "decode" or "replica"
    rank: int  # in the workers' K/V process group (a tensor-parallel worker's rank 0)
    world_size: int
    host: str
    port: int
    backend: str
    model_factory: object  # () -> model, or (model, tokenizer)
    engine_kwargs: dict = field(default_factory=dict)
    num_threads: int = 1
    device: str = "cpu"
    heartbeat_interval: float = 0.2
    transfer_timeout: float = 10.0
    start_timeout: float = 300.0
    parent_pid: int | None = None  # exit when this process is gone (no orphans)
    faults: dict = field(default_factory=dict)
    layout: dict = field(default_factory=dict)  # worker name -> its K/V-group ranks, TP rank order (empty: one each)

    def ranks_of(self, name: str) -> list[int]:
        return list(self.layout.get(name, ()))

    @property
    def tensor_parallel_size(self) -> int:
        return max(1, len(self.layout.get(self.name, ())))


def main(spec: WorkerSpec) -> None:
    """The worker process: set up, serve until "stop", then exit without waiting on dead peers."""
    code = 0
    mailbox = None
    try:
        torch.set_num_threads(max(1, spec.num_threads))
        import torch.distributed as dist

        store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timedelta(seconds=spec.start_timeout))
        mailbox = Mailbox(store, spec.name)
        moves_kv = spec.role != "replica"
        built = _build(spec)
        model, tokenizer = built if isinstance(built, tuple) else (built, None)
        model = model.to(spec.device).eval()
        engine = Engine(model, tokenizer, show_progress=False, **spec.engine_kwargs)
        kv_group = None
        if moves_kv:  # every rank of every worker joins it, each after loading its model
            kv_group = transfer.kv_group(spec.backend, store, spec.rank, spec.world_size,
                                         timedelta(seconds=spec.start_timeout))
        engine.generate([[0, 1]], SamplingParams(max_new_tokens=1))  # allocates every layer's K/V tensors
        engine.reset_prefix_cache()
        engine.reset_metrics()
        if moves_kv:
            engine.check_kv_transferable()
        Worker(spec, engine, mailbox, kv_group).run()
        engine.shutdown(drain=False)  # a tensor-parallel replica's other ranks stop following
    except Exception as exc:  # noqa: BLE001 - report, then exit: the router re-routes this worker's requests
        traceback.print_exc()
        if mailbox is not None:
            try:
                mailbox.send(ROUTER, {"op": "crashed", "name": spec.name, "error": repr(exc)})
            except Exception:  # noqa: BLE001 - the router is gone too
                pass
        code = 1
    finally:
        exit_process(code)


def exit_process(code: int) -> None:
    """End this process now, without the interpreter's teardown: `os._exit`, so that it never blocks
    on a process group whose peers may be dead. First what that teardown would release beyond the
    process: multiprocessing's named semaphores (tqdm's lock, made by `from_pretrained`'s first
    progress bar), unlinked by the finalizers an exit runs first (priority >= 0: no join among them),
    or Python's resource tracker reports them as leaked when the engine shuts down."""
    try:
        multiprocessing.util._run_finalizers(0)
    except Exception:  # noqa: BLE001 - nothing may stop the exit
        logger.debug("hf_paged: exit finalizers failed", exc_info=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _build(spec: WorkerSpec):
    """The worker's model: a factory that starts ranks of its own (`parallel.TensorParallelReplica`)
    builds their engines with this worker's settings, at this worker's tensor-parallel size, with
    `disagg.rank` running each (it joins the K/V group at its rank)."""
    factory = spec.model_factory
    if not getattr(factory, "starts_ranks", False):
        if spec.tensor_parallel_size > 1:
            raise ValueError("a tensor-parallel disaggregated worker needs a model factory that starts its ranks "
                             "(hf_paged.parallel.TensorParallelReplica)")
        return factory()
    if spec.role == "replica":  # a data-parallel replica: the factory's own tensor-parallel size
        return factory(engine_kwargs=spec.engine_kwargs)
    settings = {"kv": {"host": spec.host, "port": spec.port, "backend": spec.backend, "world": spec.world_size,
                       "ranks": spec.ranks_of(spec.name) or [spec.rank], "timeout": spec.start_timeout,
                       "transfer_timeout": spec.transfer_timeout, "num_threads": spec.num_threads}}
    return factory(engine_kwargs=spec.engine_kwargs, tensor_parallel_size=spec.tensor_parallel_size,
                   rank_module="hf_paged.disagg.rank", rank_settings=settings)


class Worker:
    def __init__(self, spec: WorkerSpec, engine: Engine, mailbox: Mailbox, kv_group=None):
        self.spec, self.engine, self.mailbox = spec, engine, mailbox
        self.kv_group = kv_group
        self.inbox = Inbox(wants_tokens=True)
        self.requests: dict[str, dict] = {}  # engine request id -> its routing message
        self.sends: dict[tuple, transfer.Transfer] = {}  # prefill: K/V buffers until acknowledged
        self.piece_sends: dict[tuple, list] = {}  # prefill: rank 0's pieces of a split transfer, until acknowledged
        self.recvs: dict[tuple, transfer.Pieces] = {}  # decode: rank 0's pieces of K/V on the way in
        self.resend_deadline: dict[tuple, tuple[float, dict]] = {}  # decode: asked again, waiting
        self.dead_ranks: set[int] = set()
        self.next_tag = 1
        self.drop_transfers = int(spec.faults.get("drop_transfers", 0))
        self.drop_key: tuple | None = None  # the request whose sends the hook drops
        self.slow_step_seconds = float(spec.faults.get("slow_step_seconds", 0.0))
        self.num_sent_tensors = 0
        self.stopping = False

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self.mailbox.send(ROUTER, {"op": "ready", "name": self.spec.name, **self.status(),
                                   "vocab_size": self.engine.vocab_size, "max_model_len": self.engine.max_model_len})
        last_beat = 0.0
        pulse = _StepPulse(self.mailbox, self.spec.heartbeat_interval)
        try:
            while not self.stopping:
                now = time.monotonic()
                if now - last_beat >= self.spec.heartbeat_interval:
                    status = self.status()
                    self.mailbox.beat(status)
                    pulse.status = status
                    last_beat = now
                    if self.spec.parent_pid is not None and os.getppid() != self.spec.parent_pid:
                        return  # the engine that started us is gone
                busy = False
                for message in self.mailbox.poll():
                    busy = True
                    self.handle(message)
                busy |= self.poll_transfers()
                if self.engine.has_unfinished_requests():
                    with pulse:
                        time.sleep(self.slow_step_seconds)
                        self.engine.step()
                    lost = self.engine.tensor_parallel.lost if self.engine.tensor_parallel is not None else None
                    if lost is not None:  # a rank of this worker is gone: exit, so the router re-runs its requests
                        raise lost
                    last_beat = 0.0 if pulse.beat_during_step else last_beat  # a fresh status next
                    busy = True
                busy |= self.deliver()
                if not busy:
                    time.sleep(0.002)
        finally:
            pulse.close()

    def status(self) -> dict:
        info = self.engine.kv_transfer_info()
        return {"role": self.spec.role, "free_blocks": info["free_blocks"], "num_blocks": info["num_blocks"],
                "block_size": info["block_size"],
                "running": len(self.requests), "pending_sends": len(self.sends), "pending_recvs": len(self.recvs),
                "messages_sent": dict(self.mailbox.num_sent), "tensors_sent": self.num_sent_tensors,
                "kv_numel_per_token": info["kv_numel_per_token"],
                "kv_dtype": transfer.dtype_name(info["kv_dtype"]), "engine": _engine_counters(self.engine)}

    def _kv_dtype(self) -> torch.dtype:
        return self.engine.kv_transfer_info()["kv_dtype"]

    # ------------------------------------------------------------------ control
    def handle(self, message: dict) -> None:
        op = message["op"]
        if op == "prefill":
            self.start(message, prefill=True)
        elif op == "run":
            self.start(message, prefill=False)
        elif op == "kv":
            self.receive(message)
        elif op == "got":
            self.sends.pop(message["key"], None)
            self.piece_sends.pop(message["key"], None)
        elif op == "resend":
            self.resend(message)
        elif op == "lost":
            self.recompute(message["key"])
        elif op == "abort":
            for rid, routed in list(self.requests.items()):
                if routed["rid"] == message["rid"]:
                    self.engine.abort(rid)
                    self.requests.pop(rid, None)
        elif op == "dead":
            for rank in message.get("ranks") or [message["rank"]]:
                self.peer_died(rank)
        elif op == "freeze" and self.spec.faults.get("freeze_on_request"):
            while True:  # a hung worker: no heartbeat, no answer, until killed
                time.sleep(3600)
        elif op == "stop":
            self.stopping = True

    def start(self, routed: dict, prefill: bool) -> None:
        """Queue a routed request: its prefill (one token, K/V kept) or the whole of it."""
        params: SamplingParams = routed["params"]
        rid = _engine_id(routed)
        if prefill:
            params = dataclasses.replace(params, max_new_tokens=1, min_new_tokens=min(params.min_new_tokens, 1))
        try:
            self.engine.add_owned_request(routed["prompt"], params, rid, self.inbox, streamed=not prefill
                                          and routed.get("stream", False), retain_kv=prefill)
        except (ValueError, TypeError) as exc:  # a bad request fails alone
            self.mailbox.send(ROUTER, {"op": "failed", "rid": routed["rid"], "attempt": routed["attempt"],
                                       "error": exc})
            return
        self.requests[rid] = {**routed, "role": "prefill" if prefill else "run"}

    def deliver(self) -> bool:
        items = self.inbox.take_all()
        tokens: dict[str, list] = {}
        for event, final in items:
            rid = (final.request_id if final is not None else event.request_id)
            routed = self.requests.get(rid)
            if routed is None:
                continue
            if event is not None and final is None and routed["role"] != "prefill" and routed.get("stream"):
                tokens.setdefault(rid, []).append((event.token_id, event.text))  # the last comes with "done"
            if final is None:
                continue
            if rid in tokens:
                self._send_tokens(routed, tokens.pop(rid))
            del self.requests[rid]
            if routed["role"] == "prefill":
                self.prefilled(routed, final)
            else:
                self.mailbox.send(ROUTER, {"op": "done", "rid": routed["rid"], "attempt": routed["attempt"],
                                           "output": final, "transfer": routed.get("transfer"),
                                           "first_logprobs": routed.get("first_logprobs")})
        for rid, batch in tokens.items():
            self._send_tokens(self.requests[rid], batch)
        return bool(items)

    def _send_tokens(self, routed: dict, batch: list) -> None:
        self.mailbox.send(ROUTER, {"op": "tokens", "rid": routed["rid"], "attempt": routed["attempt"],
                                   "events": batch})

    # ------------------------------------------------------------------ prefill side
    def prefilled(self, routed: dict, final) -> None:
        """The prompt is computed and its first token drawn: finish here, or hand the K/V on."""
        seqs = self.engine.kept_kv(final.request_id)
        key = (routed["rid"], routed["attempt"])
        params: SamplingParams = routed["params"]
        if final.error is not None or final.finish_reason != "length" or params.max_new_tokens == 1:
            self.engine.free_kv(seqs)
            op = "failed" if final.error is not None else "done"
            self.mailbox.send(ROUTER, {"op": op, "rid": routed["rid"], "attempt": routed["attempt"], "output": final,
                                       "error": final.error})
            return
        try:
            info = self.engine.kv_transfer_info()
            src = self.spec.ranks_of(self.spec.name) or [self.spec.rank]
            dst = self.spec.ranks_of(routed["decode"]) or [routed["decode_rank"]]
            pieces = transfer.plan_pieces(info["kv_heads"] * len(src), src, dst)
            slots = self.engine.kv_token_slots(seqs[0])
            per_head_token = info["kv_numel_per_token"] // info["kv_heads"]
            for piece in pieces:
                piece["tag"] = self.next_tag
                piece["numel"] = len(slots) * per_head_token * (piece["heads"][1] - piece["heads"][0])
                self.next_tag += 1
            self.engine.tell_ranks("kv_out", {"key": key, "slots": slots, "pieces": pieces})  # the others' heads
            own = [(piece, self.engine.gather_kv(slots, piece["src_heads"])) for piece in pieces
                   if piece["src"] == self.spec.rank]
        finally:
            self.engine.free_kv(seqs)  # its full blocks stay in the prefix cache for later prompts
        sample = final.outputs[0]
        kv = {"op": "kv", "key": key, "rid": routed["rid"], "attempt": routed["attempt"], "prompt": routed["prompt"],
              "params": params, "stream": routed.get("stream", False), "first": list(sample.token_ids),
              "first_logprobs": sample.logprobs, "src": self.spec.rank, "src_name": self.spec.name,
              "pieces": pieces, "dtype": transfer.dtype_name(self._kv_dtype()), "retry": 0}
        if len(pieces) == 1:  # rank 0 to rank 0: kept until acknowledged, sent again if asked
            self._post_send(key, own[0][1], routed["decode_rank"], routed["decode"], kv)
        else:
            self.mailbox.send(routed["decode"], {**kv, "sent_at": time.time()})
            self.piece_sends[key] = [transfer.send(key, buffer, piece["dst"], piece["tag"], self.kv_group)
                                     for piece, buffer in own]
            self.num_sent_tensors += len(own)
        self.mailbox.send(ROUTER, {"op": "first", "rid": routed["rid"], "attempt": routed["attempt"],
                                   "token_ids": list(sample.token_ids), "text": sample.text})

    def _post_send(self, key: tuple, buffer: torch.Tensor, peer: int, peer_name: str, kv: dict) -> None:
        tag = self.next_tag
        self.next_tag += 1
        kv = {**kv, "tag": tag, "sent_at": time.time()}
        kv["pieces"] = [{**kv["pieces"][0], "tag": tag}]
        # The message goes first: the peer posts its receive when it reads it, and NCCL sets up a pair's
        # communicator lazily at its first send, which blocks until the receiver joins.
        self.mailbox.send(peer_name, kv)
        if self.drop_transfers > 0 and self.drop_key in (None, key):  # test hook: the message goes, the data never
            self.drop_transfers -= 1
            self.drop_key = key
            self.sends[key] = transfer.Transfer(key, peer, tag, buffer, _NeverDone(), meta=kv)
        else:
            self.sends[key] = transfer.send(key, buffer, peer, tag, self.kv_group, meta=kv)
            self.num_sent_tensors += 1
        self.sends[key].meta["peer_name"] = peer_name

    def resend(self, message: dict) -> None:
        key = message["key"]
        sent = self.sends.pop(key, None)
        if sent is None:  # nothing kept any more: the decode worker recomputes
            self.mailbox.send(message["from"], {"op": "lost", "key": key})
            return
        kv = {**sent.meta, "retry": sent.meta["retry"] + 1}
        self._post_send(key, sent.buffer, sent.peer, sent.meta["peer_name"], kv)

    def peer_died(self, rank: int) -> None:
        self.dead_ranks.add(rank)
        for key in [k for k, t in self.sends.items() if t.peer == rank]:
            del self.sends[key]
        for key in [k for k, sent in self.piece_sends.items() if any(t.peer == rank for t in sent)]:
            del self.piece_sends[key]
        for key in [k for k, t in self.recvs.items() if rank in t.meta["src_ranks"]]:
            self.recompute(key)
        for key in [k for k, (_, m) in self.resend_deadline.items() if m["src"] == rank]:
            self.recompute(key)

    # ------------------------------------------------------------------ decode side
    def receive(self, kv: dict) -> None:
        """Post this rank's receives of a request's K/V pieces, and have the other ranks post theirs."""
        key = kv["key"]
        self.resend_deadline.pop(key, None)
        dtype = transfer.dtype_of(kv["dtype"])
        mine = [p for p in kv["pieces"] if p["dst"] == self.spec.rank]
        if len(mine) < len(kv["pieces"]):
            self.engine.tell_ranks("kv_recv", {"key": key, "dtype": kv["dtype"],
                                               "pieces": [p for p in kv["pieces"] if p["dst"] != self.spec.rank]})
        parts = [(transfer.receive(key, p["numel"], dtype, self.engine.device, p["src"], p["tag"], self.kv_group),
                  p["dst_heads"]) for p in mine]
        meta = {**kv, "src_ranks": {p["src"] for p in kv["pieces"]}}
        self.recvs[key] = transfer.Pieces(key, parts, meta=meta)

    def poll_transfers(self) -> bool:
        progressed = False
        timeout = self.spec.transfer_timeout
        for key, t in list(self.recvs.items()):
            state = transfer.state(t, timeout)
            if state == "pending":
                continue
            progressed = True
            del self.recvs[key]
            kv = t.meta
            if state == "done":
                self.mailbox.send(kv["src_name"], {"op": "got", "key": key})
                self.resume(kv, t)
            elif kv["retry"] == 0 and len(kv["pieces"]) == 1 and kv["src"] not in self.dead_ranks:  # once more
                self.mailbox.send(kv["src_name"], {"op": "resend", "key": key, "from": self.spec.name})
                self.resend_deadline[key] = (time.monotonic() + timeout, kv)
            else:
                self.mailbox.send(kv["src_name"], {"op": "got", "key": key})
                self.recompute(key, kv)
        for key, (deadline, kv) in list(self.resend_deadline.items()):
            if time.monotonic() > deadline:
                progressed = True
                self.recompute(key, kv)
        for key, t in list(self.sends.items()):  # unacknowledged sends are dropped after long enough
            if time.monotonic() - t.started > 4 * timeout:
                del self.sends[key]
        for key, sent in list(self.piece_sends.items()):
            if all(t.finished.is_set() for t in sent) or time.monotonic() - sent[0].started > 4 * timeout:
                del self.piece_sends[key]
        return progressed

    def resume(self, kv: dict, t: transfer.Pieces) -> None:
        """Every piece of this rank is in: every rank stores its heads in the blocks rank 0 reserves, and
        the request continues after the first token (or, if a rank could not, is recomputed here)."""
        nbytes = sum(p["numel"] for p in kv["pieces"]) * transfer.dtype_of(kv["dtype"]).itemsize
        routed = {"rid": kv["rid"], "attempt": kv["attempt"], "prompt": kv["prompt"], "params": kv["params"],
                  "stream": kv["stream"], "role": "decode", "first_logprobs": kv["first_logprobs"],
                  "transfer": {"src": kv["src_name"], "bytes": nbytes, "seconds": max(time.time() - kv["sent_at"],
                                                                                    1e-9)}}
        rid = _engine_id(routed)
        try:
            reserved = self.engine.reserve_kv_import(kv["prompt"])
        except Exception as exc:  # noqa: BLE001 - no room (a fixed pool) or a bad buffer: recompute here
            logger.warning("hf_paged: %s could not store the K/V of %r (%r); recomputing it", self.spec.name,
                           kv["rid"], exc)
            self.recompute(kv["key"], kv)
            return
        split = len(t.parts) < len(kv["pieces"])  # other ranks hold pieces too
        if split:
            self.engine.tell_ranks("kv_write", {"key": kv["key"], "slots": reserved.slots,
                                                "num_blocks": self.engine.kv_transfer_info()["num_blocks"]})
        ok = True
        try:
            for piece, heads in t.parts:
                self.engine.write_kv(reserved.slots, piece.buffer, heads)
        except Exception as exc:  # noqa: BLE001 - a bad buffer: recompute (every rank learns it below)
            logger.warning("hf_paged: %s could not write the K/V of %r (%r)", self.spec.name, kv["rid"], exc)
            ok = False
        if split:
            ok = self.engine.all_ranks_ok(ok)
        if not ok:
            self.engine.cancel_kv_import(reserved)
            self.recompute(kv["key"], kv, told=True)
            return
        seq = self.engine.commit_kv_import(reserved)
        try:
            self.engine.add_owned_request(kv["prompt"], kv["params"], rid, self.inbox, streamed=kv["stream"],
                                          kv_prefix=seq, resume_tokens=kv["first"])
        except (ValueError, TypeError) as exc:
            self.engine.free_kv([seq])
            self.mailbox.send(ROUTER, {"op": "failed", "rid": kv["rid"], "attempt": kv["attempt"], "error": exc})
            return
        self.requests[rid] = routed

    def recompute(self, key: tuple, kv: dict | None = None, told: bool = False) -> None:
        """Run the request whole here, from its prompt (a transfer that could not be had); the other
        ranks drop what they received of it (unless `told`: they took part in a failed write)."""
        pending = self.recvs.pop(key, None)
        waiting = self.resend_deadline.pop(key, None)
        kv = kv or (pending.meta if pending is not None else waiting[1] if waiting is not None else None)
        if kv is None:
            return
        if not told and any(p["dst"] != self.spec.rank for p in kv["pieces"]):
            self.engine.tell_ranks("kv_drop", {"key": key})
        self.mailbox.send(ROUTER, {"op": "recomputed", "rid": kv["rid"], "attempt": kv["attempt"]})
        self.start({"rid": kv["rid"], "attempt": kv["attempt"], "prompt": kv["prompt"], "params": kv["params"],
                    "stream": kv["stream"]}, prefill=False)


class _NeverDone:
    """The work of a send the `drop_transfers` hook skipped."""

    def is_completed(self) -> bool:
        return False

    def wait(self, *args) -> bool:
        return False


class _StepPulse:
    """Beats for the worker while its loop is inside one engine step, every `interval` seconds and
    for at most `STEP_PULSE_LIMIT` seconds of that step, with the status the loop last reported. The
    store client serialises its operations, so two threads may use it."""

    def __init__(self, mailbox: Mailbox, interval: float):
        self.mailbox, self.interval = mailbox, interval
        self.status: dict = {}
        self.beat_during_step = False
        self._step_began: float | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hf_paged-pulse", daemon=True)
        self._thread.start()

    def __enter__(self):
        self.beat_during_step = False
        self._step_began = time.monotonic()
        return self

    def __exit__(self, *exc):
        self._step_began = None
        return False

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(self.interval):
            began = self._step_began
            if began is not None and time.monotonic() - began < STEP_PULSE_LIMIT:
                try:
                    self.mailbox.beat(self.status)
                    self.beat_during_step = True
                except Exception:  # noqa: BLE001 - a store hiccup, or the router is gone (the loop finds out)
                    logger.debug("hf_paged: a pulse heartbeat failed", exc_info=True)


def _engine_id(routed: dict) -> str:
    return f"{routed['rid']}#{routed['attempt']}"


def _engine_counters(engine: Engine) -> dict:
    m = engine.metrics()
    keys = ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
            "vllm:num_requests_running", "vllm:request_success", "num_steps")
    return {k: m[k] for k in keys if k in m}
