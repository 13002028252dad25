"""Liveness of the tensor-parallel ranks a process started itself (`hf-paged serve --tensor-parallel-size`,
a tensor-parallel replica or pool worker): a rank that hangs is found and ended, so that rank 0 never
waits in a collective until torch.distributed's own timeout (30 minutes on gloo).

Each started rank writes one byte to a pipe every `BEAT_INTERVAL` seconds, from a daemon thread that
runs while its main thread computes or waits in a collective (both release the GIL). Rank 0's
`RankWatch` reads the pipes: a rank silent for `heartbeat_timeout` seconds (stopped, deadlocked,
swapped out) is taken for hung, and every started rank is killed. Rank 0's pending or next collective
then fails at once (the peer's connection closes), its executor takes the group for lost
(`TensorParallelGroup.lose`), and every request gets its clear error instead of a hang. A rank that
exits closes its pipe, which is the same loss, seen at once.

Torch-free: pipes, a thread and signals.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import threading
import time

logger = logging.getLogger(__name__)

BEAT_INTERVAL = 0.5  # seconds between a started rank's beats
HEARTBEAT_TIMEOUT = 20.0  # seconds of silence after which a started rank is taken for hung
FIRST_BEAT_GRACE = 120.0  # seconds a rank may take to send its first beat (it imports torch and transformers)
TIMEOUT_ENV = "HF_PAGED_RANK_HEARTBEAT_TIMEOUT"  # overrides HEARTBEAT_TIMEOUT (seconds)
FD_ENV = "HF_PAGED_RANK_HEARTBEAT_FD"  # in a started rank: the pipe its beats go to


def heartbeat_timeout() -> float:
    """`HEARTBEAT_TIMEOUT`, or the positive number of seconds `$HF_PAGED_RANK_HEARTBEAT_TIMEOUT` sets."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return HEARTBEAT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"${TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


def beat_to_parent() -> None:
    """In a started rank, first thing: beat on the pipe rank 0 passed (nothing when there is none)."""
    fd = os.environ.pop(FD_ENV, None)
    if fd is None:
        return

    def beat(fd: int) -> None:
        while True:
            try:
                os.write(fd, b".")
            except OSError:  # rank 0 is gone: the parent-death signal ends this process
                return
            time.sleep(BEAT_INTERVAL)

    threading.Thread(target=beat, args=(int(fd),), name="hf_paged-rank-beat", daemon=True).start()


class RankWatch:
    """Rank 0's side: watches the beats of `procs` (each with the read end of its pipe) and kills them all
    when one falls silent for `timeout` seconds (`FIRST_BEAT_GRACE` before its first beat) or exits before
    `stop()`."""

    def __init__(self, procs: list[subprocess.Popen], read_fds: list[int], timeout: float):
        self.procs = procs
        self.timeout = timeout
        self._fds = dict(zip(read_fds, range(1, len(read_fds) + 1)))  # fd -> rank
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hf_paged-rank-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The ranks are being stopped on purpose: their silence from now on is not a loss."""
        self._stopped.set()
        self._thread.join(timeout=2 * BEAT_INTERVAL + 1)

    def _watch(self) -> None:
        began = time.monotonic()
        last = {fd: None for fd in self._fds}  # when each rank last beat (None: not yet)
        try:
            while not self._stopped.is_set():
                ready, _, _ = select.select(list(last), [], [], BEAT_INTERVAL)
                now = time.monotonic()
                for fd in ready:
                    if not os.read(fd, 4096):  # the rank exited (its pipe closed)
                        return self._lose(f"tensor-parallel rank {self._fds[fd]} exited")
                    last[fd] = now
                silent = [fd for fd, t in last.items()
                          if (now - t > self.timeout if t is not None else now - began > FIRST_BEAT_GRACE)]
                if silent and not self._stopped.is_set():
                    return self._lose(f"tensor-parallel rank {self._fds[silent[0]]} sent no heartbeat for "
                                      f"{self.timeout:g} s (hung)")
        finally:
            for fd in self._fds:
                os.close(fd)

    def _lose(self, why: str) -> None:
        if self._stopped.is_set():
            return
        logger.error("hf_paged: %s; ending every started rank, so that rank 0's collectives fail now", why)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
