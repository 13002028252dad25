"""`StepLoop`: the engine's background thread. Each turn, under the engine's lock, it applies the
commands other threads handed over and runs one step while requests remain; between turns it lets
other threads take the lock, and it sleeps (woken by `wake`) while there is nothing to do.

If the thread dies (a `BaseException` escaping a step), `on_death` ends every request with that
error before it exits: nothing waits silently on a loop that is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

IDLE_WAIT_SECONDS = 0.05  # how long an idle loop sleeps before looking again (a `wake` cuts it short)


class StepLoop:
    """Runs `turn(stop_mode) -> busy` under `lock` until stopped (see `Engine.start`)."""

    def __init__(self, lock: threading.RLock, turn: Callable[[str | None], bool],
                 on_death: Callable[[Exception], None]):
        self.lock = lock
        self.turn = turn
        self.on_death = on_death
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_mode: str | None = None  # None, "drain" or "abort"

    def start(self) -> None:
        if self.is_running():
            return
        self._stop_mode = None
        self._thread = threading.Thread(target=self._run, name="hf_paged-engine", daemon=True)
        self._thread.start()

    def stop(self, drain: bool, timeout: float | None) -> None:
        """Stop after the last request ends (`drain`) or aborting them.

        Raises:
            TimeoutError: the thread did not end within `timeout` seconds (it keeps running)."""
        thread = self._thread
        if thread is None:
            return
        self._stop_mode = "drain" if drain else "abort"
        self._wakeup.set()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"the engine loop did not stop within {timeout} s")
        self._thread = None

    def wake(self) -> None:
        self._wakeup.set()

    def is_running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def is_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        try:
            while True:
                with self.lock:
                    busy = self.turn(self._stop_mode)
                    if not busy and self._stop_mode is not None:
                        return
                if not busy:
                    self._wakeup.wait(IDLE_WAIT_SECONDS)
                    self._wakeup.clear()
                else:
                    time.sleep(0)  # let other threads take the lock between steps
        except BaseException as exc:
            logger.exception("hf_paged: the engine loop stopped")
            error = exc if isinstance(exc, Exception) else RuntimeError(f"the engine loop stopped: {exc!r}")
            with self.lock:
                self.on_death(error)
            raise
