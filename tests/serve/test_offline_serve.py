"""`hf-paged serve` on a model folder reaches no host beyond loopback, with the installed transformers'
defaults (5.25 turns hub kernels on by default) and without HF_HUB_OFFLINE (`tests/offline.py`)."""

from __future__ import annotations

import pytest

from offline import offline_env
from served import Served


@pytest.mark.slow
def test_the_server_reaches_no_host(tmp_path, model_dir):
    log = tmp_path / "net.log"
    env = offline_env(log)
    server = Served(model_dir, env={k: env[k] for k in ("PYTHONPATH", "HF_PAGED_NETWORK_LOG")})
    try:
        reply = server.client().chat.completions.create(model="tiny", max_tokens=4,
                                                        messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].message.content is not None
    finally:
        assert server.stop() == 0, server.stderr()[-3000:]
    assert not log.exists(), log.read_text()
