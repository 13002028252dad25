"""`hf-paged serve` in a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

KEY = "sk-test-" + "x" * 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A server process for `model_dir` (model id "tiny", context 256, `--max-tokens 64` unless `args`
    say otherwise). Its stderr goes to a file (`stderr()`): a pipe nobody reads would fill and stall it."""

    def __init__(self, model_dir, *args, key: str | None = KEY, host: str = "127.0.0.1", env: dict | None = None,
                 start_timeout: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "hf_paged.cli", "serve", str(model_dir), "--served-model-name", "tiny",
               "--host", host, "--port", str(self.port), "--max-model-len", "256", "--max-tokens", "64", *args]
        if key is not None:
            cmd += ["--api-key", key]
        base = {k: v for k, v in os.environ.items() if k != "HF_PAGED_API_KEY"}
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._log, text=True,
                                     env={**base, **(env or {})})
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.stderr()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            self.proc.kill()
            raise TimeoutError("server did not start")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def stderr(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def post(self, path: str, **kwargs):
        kwargs.setdefault("headers", self.headers)
        return httpx.post(self.url + path, timeout=60, **kwargs)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
