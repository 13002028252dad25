"""Offline at run time: the default model's loader, drop-in `generate` and the engine reach no host beyond
loopback, with the installed transformers' defaults (5.25 turns hub kernels on by default) and without
HF_HUB_OFFLINE, in a fresh Python whose every name lookup and connection is logged and refused
(`tests/offline.py`; the server's check is in tests/serve/test_offline_serve.py)."""

from __future__ import annotations

import pytest

from offline import run_offline

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked


def test_the_guard_sees_a_hub_request(tmp_path):
    """The check can fail: a hub call under the guard is logged and refused."""
    log = tmp_path / "net.log"
    done = run_offline("""
        import huggingface_hub
        huggingface_hub.model_info("HuggingFaceTB/SmolLM2-135M-Instruct", timeout=5)
    """, log)
    assert done.returncode != 0 and "huggingface.co" in log.read_text(), done.stderr[-2000:]


@pytest.mark.slow
def test_the_default_model_drop_in_generate_and_the_engine_reach_no_host(tmp_path):
    log = tmp_path / "net.log"
    done = run_offline("""
        import warnings
        from hf_paged import Engine, SamplingParams
        from hf_paged.defaults.models import load_default

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, tokenizer = load_default(attn_implementation="hf_paged")
            assert not getattr(model, "use_kernels", False)  # no hub kernels: nothing to fetch
            batch = tokenizer(["The capital of France is", "Hi"], return_tensors="pt", padding=True)
            out = model.generate(**batch, max_new_tokens=4, do_sample=False)
            assert out.shape[1] == batch["input_ids"].shape[1] + 4
            engine = Engine(model, tokenizer)
            assert len(engine.generate(["Hello"], SamplingParams(max_new_tokens=4))[0].token_ids) == 4
            engine.shutdown()
        print("WARNINGS", len(caught), [str(w.message)[:120] for w in caught])
    """, log)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not log.exists(), log.read_text()
    assert "WARNINGS 0 " in done.stdout, done.stdout  # no warning storm either
