"""Batch jobs (`hf-paged generate --input ... --output ...`, `integrations.jobs`): every row of a
dataset file through one engine, records written as rows finish, bad rows as error records, and a
run interrupted by SIGTERM or SIGKILL resumes to exactly one record per row, each what an
uninterrupted run writes."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_paged import Engine, SamplingParams
from hf_paged.integrations.jobs import done_indices, read_rows, run_job

ROOT = Path(__file__).resolve().parents[2]
WORDS = "alpha beta gamma delta river stone cloud lamp seven quiet bright".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama over the default tokenizer, saved as a model folder."""
    pytest.importorskip("gguf")
    from hf_paged.defaults.models import load_default_tokenizer

    tokenizer = load_default_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("tiny-model")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _rows(n=200, bad=(7, 50, 123)):
    rows = []
    for i in range(n):
        text = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(1 + i % 13))
        rows.append({"id": i, "prompt": text})
    rows[bad[0]]["prompt"] = ""  # empty
    rows[bad[1]]["prompt"] = " ".join(["river"] * 400)  # longer than the model's 256 positions
    del rows[bad[2]]["prompt"]  # no prompt at all
    return rows


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _records(path) -> dict[int, dict]:
    lines = Path(path).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    by_index = {r["index"]: r for r in records}
    assert len(by_index) == len(records), "a row was written twice"
    return by_index


def test_every_input_type_reads_the_same_rows(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "one two"}, {"prompt": "three"}]
    _write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "a.json").write_text(json.dumps(rows))
    with open(tmp_path / "a.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt"])
        writer.writeheader()
        writer.writerows(rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for name in ("a.jsonl", "a.json", "a.csv", "a.parquet", "saved"):
        assert [dict(r) for r in read_rows(tmp_path / name)] == rows, name
    with pytest.raises(ValueError, match="unknown input type"):
        list(read_rows(tmp_path / "a.txt"))


def test_a_partial_last_record_is_dropped_before_resuming(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"index": 0}) + "\n" + json.dumps({"index": 3}) + "\n" + '{"index": 5, "compl')
    assert done_indices(out) == {0, 3}
    assert out.read_text().endswith("}\n") and out.read_text().count("\n") == 2


def test_retry_records_are_dropped_and_a_foreign_file_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"index": 0}) + "\n" + json.dumps({"index": 1, "error": "boom", "retry": True}) + "\n")
    assert done_indices(out) == {0} and out.read_text() == json.dumps({"index": 0}) + "\n"
    other = tmp_path / "notes.jsonl"
    other.write_text('{"name": "x"}\n')
    with pytest.raises(ValueError, match="no integer 'index'"):
        done_indices(other)
    assert other.read_text() == '{"name": "x"}\n'  # left as it was


def test_a_job_writes_one_record_per_row_and_error_records_for_bad_rows(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="hf_paged").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(model, tokenizer, max_num_seqs=16)
    rows = _rows()
    params = SamplingParams(max_new_tokens=6)
    counts = run_job(engine, tokenizer, rows, tmp_path / "out.jsonl", params, progress=False)
    records = _records(tmp_path / "out.jsonl")
    assert sorted(records) == list(range(200)) and counts["written"] == 197 and counts["errors"] == 3
    assert {i for i, r in records.items() if r["error"]} == {7, 50, 123}
    assert "empty" in records[7]["error"] and "max_model_len" in records[50]["error"]
    assert "no column 'prompt'" in records[123]["error"]
    # Each completion is the engine's for that prompt alone.
    alone = engine.generate([tokenizer(rows[i]["prompt"])["input_ids"] for i in (0, 99)], params)
    assert [records[0]["token_ids"], records[99]["token_ids"]] == [o.token_ids for o in alone]
    # Engine.generate takes a datasets.Dataset and a column, too.
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_list([{"text": "alpha beta"}, {"text": "gamma"}])
    engine.tokenizer = tokenizer
    by_column = engine.generate(table, params, column="text")
    assert [o.token_ids for o in by_column] == [o.token_ids for o in engine.generate(["alpha beta", "gamma"], params)]
    with pytest.raises(ValueError, match="no column 'prompt'"):
        engine.generate(table, params, column="prompt")


def _cli(model_dir, rows_path, out, *extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return [sys.executable, "-m", "hf_paged.cli", "generate", "--model", str(model_dir), "--input", str(rows_path),
            "--output", str(out), "--max-new-tokens", "24", "--max-num-seqs", "2", *extra], env


@pytest.fixture(scope="module")
def uninterrupted(model_dir, tmp_path_factory):
    """The rows file and the records of one run of the batch job left to finish."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    rows_path = _write_jsonl(folder / "rows.jsonl", _rows())
    full = folder / "full.jsonl"
    cmd, env = _cli(model_dir, rows_path, full)
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "row" in done.stderr and "hf_paged" in done.stderr  # the progress bar
    assert "197 rows written, 3 error records" in done.stdout
    return rows_path, _records(full)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_an_interrupted_run_resumes_to_exactly_the_uninterrupted_records(model_dir, uninterrupted, tmp_path, sig):
    rows_path, full_records = uninterrupted
    out = tmp_path / "resumed.jsonl"
    cmd, env = _cli(model_dir, rows_path, out)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 60):
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    written = out.read_text().count("\n")
    assert 0 < written < 200, f"the run was not stopped half-way ({written} records)"
    if sig == signal.SIGTERM:
        assert proc.returncode == 130  # stopped cleanly: every record complete
    cmd, env = _cli(model_dir, rows_path, out)
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _records(out) == full_records
