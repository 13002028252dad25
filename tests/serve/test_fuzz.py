"""Schemathesis, the real tool, against `hf-paged serve`'s own OpenAPI document (`/openapi.json`) with
the API key: generated valid and invalid requests on every route (bodies, methods, missing auth),
checked for no 5xx, responses that match the schema, invalid data rejected and no request hanging;
then every error response in its HAR record must be OpenAI's error body.

Bounded for the suite (`HF_PAGED_FUZZ_EXAMPLES` per operation, 40 by default; the closing note's
2,000-request run used 1000), with a fixed seed so a failure reproduces."""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

from served import KEY, Served  # noqa: E402

ROUTES = {"/health", "/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions"}


def test_schemathesis_finds_no_server_error_and_every_error_is_well_formed(model_dir, tmp_path):
    examples = int(os.environ.get("HF_PAGED_FUZZ_EXAMPLES", "40"))
    server = Served(model_dir, "--max-tokens", "8", "--max-n", "2")
    har = tmp_path / "fuzz.har"
    cli = shutil.which("schemathesis", path=os.path.dirname(sys.executable)) or "schemathesis"
    try:
        done = subprocess.run(
            [cli, "run", server.url + "/openapi.json", "-H", f"Authorization: Bearer {KEY}",
             "--checks", "all", "--exclude-checks", "positive_data_acceptance",  # valid by schema, not always by
             "--max-examples", str(examples), "--seed", "20261203", "--workers", "1",  # context: a 400 is right
             "--request-timeout", "60", "--report", "har", "--report-har-path", str(har)],
            capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    finally:
        assert server.stop() == 0
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    entries = json.loads(har.read_text())["log"]["entries"]
    counts = collections.Counter(e["response"]["status"] for e in entries)
    print(f"{len(entries)} requests, by status: {dict(sorted(counts.items()))}")
    routes = {e["request"]["url"].split(str(server.port), 1)[1].split("?")[0] for e in entries}
    assert ROUTES <= routes and len(entries) >= 2 * examples
    assert not [s for s in counts if s >= 500]
    for e in entries:
        status = e["response"]["status"]
        if status >= 400:
            body = json.loads(e["response"]["content"]["text"])
            error = body["error"]
            assert isinstance(error["message"], str) and error["message"], e["request"]["url"]
            assert isinstance(error["type"], str) and set(error) == {"message", "type", "param", "code"}
