"""A short soak of `hf-paged serve` (`benchmarks/soak.py`): 32 clients for at least 30 s and 120
requests, streaming and not, greedy and seeded, n of 1 and 2, stops, 10% of clients disconnecting
mid-stream, 5% malformed requests, a KV pool small enough to preempt. Every well-formed request
gets one complete response, greedy ones equal an offline run, the pool is free afterwards, RSS stays
flat, and SIGTERM exits 0."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytestmark = pytest.mark.slow


def test_short_soak_loses_nothing(model_dir):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    reference = soak.reference_texts(str(model_dir), 24)
    stats = soak.run_soak(str(model_dir), seconds=20, requests=80, clients=32)
    soak.report(stats)
    problems = soak.check(stats, reference)
    assert problems == []  # RSS included: within 5% between the first and last quarter after warm-up
    assert len(stats["done"]) >= 60 and stats["malformed"] > 0 and stats["disconnected"] > 0
    assert stats["preemptions"] > 0 and len(stats["greedy"]) > 0
    assert len(stats["rss"]) >= 20  # the RSS check had samples to compare (every 0.5 s after the 7.5 s warm-up)
