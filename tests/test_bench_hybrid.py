"""A smoke run of `benchmarks/hybrid.py --quick`: the Qwen-3.5-shaped hybrid model (random weights,
SmolLM2's tokenizer) through stock static batches, transformers' `generate_batch` and hf_paged's
Engine, and the shared-system-prompt TTFT with and without the prefix cache. The figures are not
checked (a smoke run on a shared machine); that every method did its work, and equally, is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")  # SmolLM2's tokenizer comes from the default model's GGUF file

ROOT = Path(__file__).resolve().parents[1]


def _hybrid_benchmark():
    spec = importlib.util.spec_from_file_location("hybrid", ROOT / "benchmarks" / "hybrid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hybrid_benchmark_quick(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:  # one thread: on a loaded machine two stall at every op's barrier (seconds, not a smoke run)
        record = _hybrid_benchmark().main(["--quick", "--threads", "1", "--json", str(tmp_path / "hybrid.json")])
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "SUMMARY engine" in printed and (tmp_path / "hybrid.json").exists()
    assert record["engine_tokens_per_s"] > 0 and record["stock_tokens_per_s"] > 0
    # Equal work, and the same work: greedy tokens from random weights match stock's per request.
    assert record["greedy_identical"] == record["num_requests"]
    # transformers' continuous batching either runs or its exception is reported (5.25 refuses it).
    gb = record["generate_batch"]
    assert ("tokens_per_s" in gb) != ("error" in gb)
    # The second request takes the whole shared system prompt (linear-attention state included)
    # from the prefix cache; without the cache nothing is.
    system = record["system_prompt_tokens"]
    assert [run["cached"] for run in record["ttft_runs"]["prefix_cache"]] == [[0, system]]
    assert [run["cached"] for run in record["ttft_runs"]["no_prefix_cache"]] == [[0, 0]]
