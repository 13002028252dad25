"""Issue 53's first hour with the openai client against `hf-paged serve default`: the checks of
`scripts/first_hour_check.py`, run on the suite's shared server (`conftest.served_default`), no
`max_tokens`, temperature 0. A required tool call answers with `content` None (the grammar starts at the
call) and valid arguments; a call cut short leaves no markup in `content`; a text answer with `tools`
present streams in several chunks; a JSON schema answer parses; "What is the capital of France?" stops
by itself."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("openai")
pytest.importorskip("jsonschema_rs")

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "first_hour_check.py"
_spec = importlib.util.spec_from_file_location("first_hour_check", _SCRIPT)
first_hour = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(first_hour)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(first_hour.CHECKS))
def test_the_first_hour_through_the_openai_client(served_default, name):
    client = served_default.client().with_options(timeout=600)  # two tool calls take ~80 tokens
    ok, seen = first_hour.CHECKS[name](client, "tiny")
    assert ok, seen
