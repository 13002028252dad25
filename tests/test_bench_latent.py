"""A smoke run of `benchmarks/latent.py --quick`: the DeepSeek-V3-shaped model (random weights,
SmolLM2's tokenizer) through stock static batches and hf_paged's Engine, and one layer's decode step
with the latent up-projections absorbed against the dense expansion. The figures are not checked (a
smoke run on a shared machine); that every method did its work, and the same work, is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")  # SmolLM2's tokenizer comes from the default model's GGUF file

ROOT = Path(__file__).resolve().parents[1]


def _latent_benchmark():
    spec = importlib.util.spec_from_file_location("latent_bench", ROOT / "benchmarks" / "latent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_latent_benchmark_quick(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:  # one thread: on a loaded machine two stall at every op's barrier (seconds, not a smoke run)
        record = _latent_benchmark().main(["--quick", "--threads", "1", "--json", str(tmp_path / "latent.json")])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "SUMMARY engine" in printed and (tmp_path / "latent.json").exists()
    assert "GPU-only figures are printed only where a GPU is" in printed

    tp = record["throughput"]
    assert tp["engine_tokens_per_s"] > 0 and tp["stock_tokens_per_s"] > 0 and tp["ratio_vs_static"] > 0
    # Equal work: greedy tokens from random weights match stock's per request (2 tokens each here; the
    # absorbed attention equals the expanded one up to rounding, far below these logits' gaps).
    assert tp["greedy_identical"] == tp["num_requests"]

    cpu = record["decode"]["cpu"]
    assert cpu["dense_ms"] > 0 and "torch" in cpu["absorbed"]
    for name, res in cpu["absorbed"].items():
        # The same attention: fp32 sums of 64 keys in another order, about 1e-7 here.
        assert res["max_abs_diff"] <= cpu["tolerance"] * cpu["dense_max_abs"], name
        assert res["agrees"] and res["ratio"] == pytest.approx(cpu["dense_ms"] / res["ms"])
    if "cpu" in cpu["absorbed"]:
        assert isinstance(cpu["cpu_native_kernel"], bool)
    cuda = record["decode"]["cuda"]
    if torch.cuda.is_available():
        assert cuda["absorbed"] and all(res["agrees"] for res in cuda["absorbed"].values())
    else:
        assert "skipped" in cuda and "skipped: no CUDA device" in printed
