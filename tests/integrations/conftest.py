"""Fixtures shared by the drop-in integration tests."""

import pytest

import hf_paged.integrations.batch_generate as batch_generate


@pytest.fixture
def engine_calls(monkeypatch):
    """Whether each drop-in call was served by the engine (True) or fell back to stock (False)."""
    calls = []
    original = batch_generate.try_engine_generate

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(batch_generate, "try_engine_generate", spy)
    return calls


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
