"""Fixtures shared by the drop-in integration tests."""

import pytest


@pytest.fixture
def engine_streams(monkeypatch):
    """The prompt counts of every `Engine.stream` call (the drop-in route's step-by-step path)."""
    from hf_paged.engine import Engine

    calls = []
    original = Engine.stream

    def spy(self, *args, **kwargs):
        calls.append(len(args[0]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "stream", spy)
    return calls
