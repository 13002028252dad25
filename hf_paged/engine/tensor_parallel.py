"""Tensor parallelism: one scheduler, N ranks. Rank 0 leads, the other ranks follow.

A model loaded with transformers' tensor parallelism (`distributed_config=DistributedConfig(tp_size=N)`
or `tp_plan="auto"`, under `torchrun` or the ranks `hf_paged.parallel` starts) holds one shard per rank,
and every rank must run every forward (its layers all-reduce). The engine runs on rank 0 only: rank 0
schedules, samples and owns the requests; each step's inputs (`worker.StepInputs`, plain host values)
reach the other ranks in one broadcast, and they run the same forward on their shard and their share
of the KV heads. The ranks never decide anything themselves, so they cannot disagree.

The messages rank 0 broadcasts over the model's TP group, in order:

    ("step", (StepInputs, num_blocks))
                           every rank runs this forward (rank 0 samples its logits), its pool first
                           grown to rank 0's `num_blocks` (a drop-in call grows rank 0's pool by what
                           only rank 0 knows: the blocks its returned caches hold)
    ("done", result)       the call every rank made returns `result` on every rank
    ("error", exception)   the call every rank made raises `exception` on every rank
    ("stop", None)         rank 0's engine shut down: a rank that serves (`Follower.serve`) returns
    (kind, payload)        any other kind: a message of the code driving the engine (`tell_ranks`), run on
                           each rank by the handler it registered (`on_rank_message`), in order with the
                           steps (a disaggregated worker's ranks move their own KV heads this way)

A call (`Engine.generate`, drop-in `generate`) is made on every rank with the same arguments, as
everything under `torchrun` is. On rank 0 it runs the engine, whose executor broadcasts each step; on
the others it follows: it runs each step it receives until the call's result arrives.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..worker import ModelRunner, StepInputs
from .blocking import BlockingAPI
from .executor import ExecutorLostError, ExecutorStep, InProcessExecutor, StepTimes

logger = logging.getLogger(__name__)


@dataclass
class TensorParallelGroup:
    """The ranks one tensor-parallel model is split over: `rank` (0 leads), `size`, and the process group."""

    group: object
    rank: int
    size: int
    lost: Exception | None = None  # rank 0's executor sets it when a rank is gone: nothing more can be broadcast

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def lose(self, exc: Exception) -> ExecutorLostError:
        """A rank is gone (`exc` says how): `lost` says so from now on, and is returned to raise."""
        self.lost = ExecutorLostError(
            f"hf_paged: a tensor-parallel rank is gone ({type(exc).__name__}: {str(exc)[:200]}); this engine cannot "
            "run steps any more: restart it (its server) to serve again")
        logger.error("%s", self.lost)
        return self.lost

    def broadcast(self, message=None):
        """Rank 0's `message` on every rank (rank 0 passes it, the others receive it)."""
        box = [message if self.leads else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]


def tensor_parallel_group(model: torch.nn.Module) -> TensorParallelGroup | None:
    """The TP group of a model loaded with transformers' tensor parallelism over more than one rank; None
    for any other model."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None or not dist.is_available() or not dist.is_initialized():
        return None
    names = mesh.mesh_dim_names or ()
    tp = mesh["tp"] if "tp" in names else mesh
    if tp.size() <= 1:
        return None
    return TensorParallelGroup(tp.get_group(), tp.get_local_rank(), tp.size())


class TensorParallelExecutor(InProcessExecutor):
    """Rank 0's executor: broadcasts each step's inputs, then runs the step on its own shard."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup):
        super().__init__(runner)
        self.group = group

    def execute(self, step: ExecutorStep) -> torch.Tensor:  # [num logit rows, vocab]
        if self.group.lost is not None:
            raise self.group.lost
        try:
            inputs = self.runner.inputs_for(step.chunks, step.copies)
            try:
                self.group.broadcast(("step", (inputs, self.runner.kv.num_blocks)))
            except Exception as exc:  # the broadcast reaches every rank or a rank is gone
                raise self.group.lose(exc) from exc
            try:
                return self.runner.run(inputs, step.new_full_blocks)
            except Exception as exc:
                if _is_distributed_failure(exc):  # the forward's collectives lost a rank
                    raise self.group.lose(exc) from exc
                raise
        finally:
            self._times = StepTimes(self.runner.last_metadata_seconds, self.runner.last_model_seconds)


class FollowerStopped(Exception):
    """Rank 0's engine shut down: nothing more will come."""


def _is_distributed_failure(exc: BaseException) -> bool:
    """Whether `exc` is torch.distributed's report of a peer that is gone (gloo's closed connection, NCCL's
    error, a collective's timeout), rather than the model's own error, which every rank raises alike."""
    dist_error = getattr(torch.distributed, "DistError", ())
    text = str(exc)
    return (isinstance(exc, dist_error) or "Connection closed by peer" in text or "Connection reset by peer" in text
            or "NCCL" in text or "Timed out" in text)


RESERVED_KINDS = frozenset({"step", "done", "error", "stop"})


class Follower:
    """A rank other than 0: runs rank 0's steps on its shard until the call's result arrives."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup):
        self.runner = runner
        self.group = group
        self.handlers: dict = {}  # kind -> handler(payload), for `tell_ranks`' messages

    def follow(self):
        """Run steps until rank 0 ends the call; return its result (or raise its exception)."""
        while True:
            kind, payload = self.group.broadcast()
            if kind == "step":
                inputs, num_blocks = payload
                try:
                    if self.runner.kv.num_blocks < num_blocks:
                        self.runner.kv.grow_to(num_blocks)
                    self.runner.run(inputs)
                except Exception:  # noqa: BLE001 - rank 0 ran the same step: its failure is the call's
                    logger.debug("hf_paged: a followed step failed on this rank", exc_info=True)
            elif kind == "done":
                return payload
            elif kind == "error":
                raise payload
            elif kind == "stop":
                raise FollowerStopped
            elif kind in self.handlers:
                self.handlers[kind](payload)
            else:
                raise RuntimeError(f"hf_paged: unknown tensor-parallel message {kind!r}")

    def serve(self) -> None:
        """Follow rank 0 until its engine shuts down (the worker ranks of `hf-paged serve`): whatever calls it
        makes, and the steps its background loop runs."""
        while True:
            try:
                self.follow()
            except FollowerStopped:
                return
            except Exception:  # noqa: BLE001 - rank 0's call failed; it raised there, the next one follows
                logger.debug("hf_paged: a followed call failed", exc_info=True)


class Lead:
    """Rank 0's side of a call every rank makes: the outermost call broadcasts its result or exception."""

    def __init__(self, group: TensorParallelGroup):
        self.group = group
        self._depth = 0

    @contextlib.contextmanager
    def _call(self):
        self._depth += 1
        try:
            yield self._depth == 1
        finally:
            self._depth -= 1

    def run(self, fn):
        with self._call() as outermost:
            if not outermost:
                return fn()
            try:
                result = fn()
            except BaseException as exc:
                self.group.broadcast(("error", exc))
                raise
            self.group.broadcast(("done", result))
            return result

    def stop(self) -> None:
        """Tell the other ranks that this engine is gone (they stop following)."""
        self.group.broadcast(("stop", None))


def check_tensor_parallel(tp: TensorParallelGroup | None, probe, draft_model, speculative_method):
    """The cache config of an engine over `tp`'s ranks (each pool holds its rank's share of the KV heads).

    Raises:
        ValueError: speculative decoding was asked for a tensor-parallel model (not supported yet).
    """
    if tp is None:
        return probe
    if draft_model is not None or speculative_method is not None:
        raise ValueError("hf_paged: speculative decoding is not supported with a tensor-parallel model yet")
    return replace(probe, tensor_parallel_size=tp.size)


class TensorParallelCalls:
    """`Engine`'s calls that every rank of a tensor-parallel model makes (the engine sets `_lead` on rank 0,
    `_follower` on the others, neither without tensor parallelism)."""

    _lead: Lead | None
    _follower: Follower | None
    tensor_parallel: TensorParallelGroup | None

    def run_on_every_rank(self, fn):
        """`fn()`, for a call every rank of a tensor-parallel model makes with the same arguments: rank 0
        runs it (its steps reach the other ranks) and every rank returns its result or raises its
        exception. Without tensor parallelism, just `fn()`."""
        if self._follower is not None:
            return self._follower.follow()
        if self._lead is not None:
            return self._lead.run(fn)
        return fn()

    def generate(self, *args, **kwargs):
        return self.run_on_every_rank(lambda: BlockingAPI.generate(self, *args, **kwargs))

    generate.__doc__ = BlockingAPI.generate.__doc__

    def serve_as_follower(self) -> None:
        """On a tensor-parallel rank other than 0: run rank 0's steps until its engine shuts down (the
        ranks `hf_paged.parallel` starts for `hf-paged serve --tensor-parallel-size`)."""
        if self._follower is None:
            raise RuntimeError("serve_as_follower() is for the tensor-parallel ranks other than 0")
        self._follower.serve()

    # Messages of the code that drives a tensor-parallel engine (a disaggregated worker) to every rank.
    def tell_ranks(self, kind: str, payload=None) -> None:
        """On rank 0: run `payload` through the handler every other rank registered for `kind`
        (`on_rank_message`), in order with the steps. Without tensor parallelism, nothing.

        Raises:
            ExecutorLostError: a rank is gone (this engine can run no more steps either).
        """
        if self._lead is None:
            return
        if kind in RESERVED_KINDS:
            raise ValueError(f"{kind!r} is the engine's own tensor-parallel message")
        group = self._lead.group
        if group.lost is not None:
            raise group.lost
        try:
            group.broadcast((kind, payload))
        except Exception as exc:
            raise group.lose(exc) from exc

    def on_rank_message(self, kind: str, handler) -> None:
        """On a rank other than 0: `handler(payload)` runs each `tell_ranks(kind, payload)` of rank 0."""
        if self._follower is None:
            raise RuntimeError("on_rank_message() is for the tensor-parallel ranks other than 0")
        if kind in RESERVED_KINDS:
            raise ValueError(f"{kind!r} is the engine's own tensor-parallel message")
        self._follower.handlers[kind] = handler

    def all_ranks_ok(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank: rank 0 calls it after a `tell_ranks`, each other rank from
        that message's handler (one all-reduce over the TP group). Without tensor parallelism, `ok`.

        Raises:
            ExecutorLostError: a rank is gone (this engine can run no more steps either).
        """
        group = self._lead.group if self._lead is not None else self._follower.group if self._follower else None
        if group is None:
            return ok
        if group.lost is not None:
            raise group.lost
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group.group)
        except Exception as exc:
            raise group.lose(exc) from exc
        return bool(flag.item())

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank in the model's TP group (0 without tensor parallelism)."""
        return 0 if self.tensor_parallel is None else self.tensor_parallel.rank

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.tensor_parallel is None else self.tensor_parallel.size

    def _stop_followers(self) -> None:
        """At shutdown on rank 0: the other ranks stop following (unless one is gone already)."""
        if self._lead is None or self._lead.group.lost is not None:
            return
        try:
            self._lead.stop()
        except Exception as exc:  # noqa: BLE001 - a rank that died already stopped
            logger.warning("hf_paged: telling the tensor-parallel ranks to stop failed: %r", exc)
