"""`DisaggregatedEngine`: prefill and decode workers in their own processes, behind `Engine`'s
`generate` / `stream` / `metrics`.

Prefill is compute-bound and decode bandwidth-bound; on one engine a long prompt's chunk stalls
every running decode. Here each role has its own processes, each with a model replica and an
`Engine` (`worker`); the `supervisor` starts them and routes every request. This module is the
callers' side: it checks and tokenises prompts, hands each request to the supervisor with a queue
for its events, and gathers the outputs.

A bad request fails alone, with the engine's ValueError in its output. `close()` (or leaving the
`with` block, or interpreter exit) stops every worker.

Limits: one sample per request (n = 1), no prompt logprobs, an unquantised cache with one KV group
(sliding-window models run with `enable_hybrid_kv=False`).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from collections.abc import Iterator, Sequence as SequenceABC

from ..config import EngineConfig
from ..engine.outputs import CompletionOutput, RequestOutput, StreamEvent
from ..sampling_params import SamplingParams
from ..worker.sampling import draw_seed
from .supervisor import Routed, Supervisor


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
            engine step keeps beating, up to `disagg.worker.STEP_PULSE_LIMIT` seconds).
        transfer_timeout: seconds a K/V transfer may take before it is asked for again.
        start_timeout: seconds the workers may take to start (model loading included).
        faults: test hooks per worker name (see `disagg.worker`).
        prefill_tensor_parallel_size, decode_tensor_parallel_size: ranks per prefill / decode worker
            (their own sizes: a request's K/V move in pieces, each KV head once, from the prefill rank
            holding it to the decode rank that needs it). Above 1, `model_factory` must start the
            ranks: `hf_paged.parallel.TensorParallelReplica(model_path)`.
    """

    def __init__(self, model_factory, num_prefill: int = 1, num_decode: int = 2, backend: str | None = None, *,
                 tokenizer=None, engine_kwargs: dict | None = None, device: str = "cpu", num_threads: int | None = None,
                 heartbeat_timeout: float = 10.0, transfer_timeout: float = 10.0, start_timeout: float = 300.0,
                 faults: dict | None = None, prefill_tensor_parallel_size: int = 1,
                 decode_tensor_parallel_size: int = 1):
        if not isinstance(num_prefill, int) or not isinstance(num_decode, int) or num_prefill < 0 or num_decode < 1:
            raise ValueError(f"need num_prefill >= 0 and num_decode >= 1, got {num_prefill!r} and {num_decode!r}")
        if not callable(model_factory):
            raise TypeError("model_factory must be a picklable callable returning the model (or model, tokenizer)")
        sizes = (prefill_tensor_parallel_size, decode_tensor_parallel_size)
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
            raise ValueError(f"tensor-parallel sizes must be positive integers, got {sizes}")
        if max(sizes) > 1 and not getattr(model_factory, "starts_ranks", False):
            raise TypeError("tensor-parallel workers need a model factory that starts their ranks: "
                            "hf_paged.parallel.TensorParallelReplica(model_path)")
        if max(sizes) > 1 and num_prefill == 0:
            raise ValueError("a data-parallel engine's replicas take their tensor-parallel size from their factory "
                             "(TensorParallelReplica(model_path, size)), not decode_tensor_parallel_size")
        engine_kwargs = {"block_size": EngineConfig.block_size, "enable_hybrid_kv": False, **(engine_kwargs or {})}
        backend = backend or ("nccl" if str(device).startswith("cuda") else "gloo")
        self._init(tokenizer)
        self.supervisor = Supervisor.spawn(model_factory, num_prefill, num_decode, backend,
                                           engine_kwargs=engine_kwargs, device=device, num_threads=num_threads,
                                           heartbeat_timeout=heartbeat_timeout, transfer_timeout=transfer_timeout,
                                           start_timeout=start_timeout, faults=faults, tensor_parallel_sizes=sizes)

    @classmethod
    def over(cls, supervisor: Supervisor, tokenizer=None) -> "DisaggregatedEngine":
        """The callers' side over a supervisor that is already routing (torchrun's rank 0)."""
        self = cls.__new__(cls)
        self._init(tokenizer)
        self.supervisor = supervisor
        return self

    def _init(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokenizer_lock = threading.Lock()  # string prompts are encoded under it (as `Engine` does)
        self._ids = itertools.count()

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
        self.supervisor.abort(request_id)

    def metrics(self) -> dict:
        """Router counters, K/V transfers per worker pair (count, bytes, seconds, bytes/s), control
        messages and tensor sends, and each worker's last reported status."""
        return self.supervisor.metrics()

    @property
    def worker_pids(self) -> dict[str, int]:
        return self.supervisor.worker_pids

    def send_control(self, name: str, message: dict) -> None:
        """Send a worker a control message directly (the test hooks' "freeze")."""
        self.supervisor.send_control(name, message)

    @property
    def is_closed(self) -> bool:
        return self.supervisor.is_closed

    def is_running(self) -> bool:
        return self.supervisor.is_running()

    def close(self, timeout: float = 20.0) -> None:
        """Stop every worker (those that do not exit within `timeout` seconds are killed) and the router."""
        self.supervisor.close(timeout)

    def __enter__(self) -> "DisaggregatedEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ submission
    def prepare(self, prompt, params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        """A prompt's token ids and its parameters, checked, with a seed drawn when none was given
        (every attempt and both workers then draw alike).

        Raises:
            ValueError/TypeError: the request cannot be served here.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError("DisaggregatedEngine serves one sample per request (n=1)")
        if params.prompt_logprobs is not None:
            raise ValueError("DisaggregatedEngine does not return prompt logprobs")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need tokenizer= (or pass token ids)")
            with self.tokenizer_lock:
                prompt = self.tokenizer(prompt)["input_ids"]
        if not isinstance(prompt, SequenceABC) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in prompt):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("empty prompt")
        if params.seed is None:
            params = dataclasses.replace(params, seed=draw_seed(None))
        return list(prompt), params

    def new_request_id(self) -> str:
        return f"dreq-{next(self._ids)}"

    def enqueue(self, rid: str, prompt_ids: list[int], params: SamplingParams, owner, index: int = 0,
                stream: bool = False) -> Routed:
        """Route one prepared request; its events (`stream`) or output go to `owner.put`."""
        routed = Routed(rid, index, prompt_ids, params, owner, stream=stream)
        self.submit(routed)
        return routed

    def submit(self, routed: Routed) -> None:
        """Hand a built request to the router."""
        if self.supervisor.is_closed:
            raise RuntimeError("this DisaggregatedEngine is closed")
        self.supervisor.submit(routed)

    def _submit(self, prompts, sampling_params, owner, stream: bool):
        if self.supervisor.is_closed:
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
        checked, results = [], [None] * len(prompts)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = self.new_request_id()
            try:
                checked.append((rid, i, *self.prepare(prompt, p)))
            except (ValueError, TypeError) as exc:
                results[i] = RequestOutput(request_id=rid, prompt_token_ids=prompt if isinstance(prompt, list) else [],
                                           outputs=[CompletionOutput(0, finish_reason="error", error=exc)],
                                           finish_reason="error")
        routed = [self.enqueue(rid, ids, p, owner, i, stream) for rid, i, ids, p in checked]
        return routed, results

    def _next(self, owner: queue.SimpleQueue):
        while True:
            try:
                return owner.get(timeout=0.5)
            except queue.Empty:
                self.supervisor.check_running()


class DataParallelEngine(DisaggregatedEngine):
    """`data_parallel_size` replicas of the model, each in its own process with its own `Engine`, behind
    `Engine`'s `generate` / `stream` / `metrics`: each request runs whole on one replica, chosen by
    prefix-cache affinity, then load (the disaggregated router's policy, `Router.choose_replica`). A
    replica that dies or hangs has its requests re-run on the others.

    Args:
        model_factory: as `DisaggregatedEngine`'s; `parallel.TensorParallelReplica` makes every replica
            tensor-parallel (each starts its own ranks).
        data_parallel_size: replicas (one process each, plus a tensor-parallel replica's other ranks).
        tokenizer, engine_kwargs, device, num_threads, heartbeat_timeout, start_timeout, faults: as
            `DisaggregatedEngine`'s (workers are named "replica0", "replica1", ...).

    Limits: `DisaggregatedEngine`'s (one sample per request, no prompt logprobs).
    """

    def __init__(self, model_factory, data_parallel_size: int = 2, *, tokenizer=None, engine_kwargs: dict | None = None,
                 device: str = "cpu", num_threads: int | None = None, heartbeat_timeout: float = 10.0,
                 start_timeout: float = 300.0, faults: dict | None = None):
        if not isinstance(data_parallel_size, int) or isinstance(data_parallel_size, bool) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
        super().__init__(model_factory, 0, data_parallel_size, tokenizer=tokenizer, engine_kwargs=engine_kwargs,
                         device=device, num_threads=num_threads, heartbeat_timeout=heartbeat_timeout,
                         start_timeout=start_timeout, faults=faults)
