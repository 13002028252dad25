"""Batch jobs (`hf-paged generate --input ... --output ...`, `integrations.jobs`): every row of a
dataset file through one engine, records written as rows finish, bad rows as error records, and a
run interrupted by SIGTERM or SIGKILL resumes to exactly one record per row, each what an
uninterrupted run writes. Hostile input (bytes that are not UTF-8, lone surrogates, byte-order
marks, lines cut short) costs only its own rows: one error record each."""

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_paged import Engine, SamplingParams
from hf_paged.integrations.jobs import done_indices, prompt_of, read_rows, run_job
from tiny_models import save_tiny_llama_folder

ROOT = Path(__file__).resolve().parents[2]
WORDS = "alpha beta gamma delta river stone cloud lamp seven quiet bright".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama over the default tokenizer, saved as a model folder."""
    pytest.importorskip("gguf")
    return save_tiny_llama_folder(tmp_path_factory.mktemp("tiny-model"))


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
    lines = Path(path).read_bytes().decode("utf-8").splitlines()  # strict: the output is always UTF-8
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


def test_error_records_are_dropped_and_a_foreign_file_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    records = [{"index": 0, "error": None}, {"index": 1, "error": "boom", "retry": True},
               {"index": 2, "error": "the prompt is empty"}]
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert done_indices(out) == {0} and out.read_text() == json.dumps({"index": 0, "error": None}) + "\n"
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
            "--output", str(out), "--max-new-tokens", "12", "--max-num-seqs", "2", *extra], env


# The interrupted-run tests' rows: enough that a run stopped after a third of them is stopped half-way
# (2 sequences at a time), with the three kinds of bad row.
JOB_ROWS, JOB_BAD = 100, (7, 50, 83)


@pytest.fixture(scope="module")
def uninterrupted(model_dir, tmp_path_factory):
    """The rows file and the records of one run of the batch job left to finish."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    rows_path = _write_jsonl(folder / "rows.jsonl", _rows(JOB_ROWS, JOB_BAD))
    full = folder / "full.jsonl"
    cmd, env = _cli(model_dir, rows_path, full)
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "row" in done.stderr and "hf_paged" in done.stderr  # the progress bar
    assert f"{JOB_ROWS - 3} rows written, 3 error records" in done.stdout
    return rows_path, _records(full)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_an_interrupted_run_resumes_to_exactly_the_uninterrupted_records(model_dir, uninterrupted, tmp_path, sig):
    rows_path, full_records = uninterrupted
    out = tmp_path / "resumed.jsonl"
    cmd, env = _cli(model_dir, rows_path, out)
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < JOB_ROWS // 3):
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    written = out.read_text().count("\n")
    assert 0 < written < JOB_ROWS, f"the run was not stopped half-way ({written} records)"
    if sig == signal.SIGTERM:
        assert proc.returncode == 130  # stopped cleanly: every record complete
    cmd, env = _cli(model_dir, rows_path, out)
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _records(out) == full_records


# Hostile input: every row gets exactly one record, whatever its bytes.

BOM = b"\xef\xbb\xbf"


@pytest.fixture(scope="module")
def tiny(model_dir):
    """The tiny model in this process: an engine and its tokenizer, shared by the in-process jobs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="hf_paged").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return Engine(model, tokenizer, max_num_seqs=8), tokenizer


def _check_records(path, wants: list[str]) -> dict[int, dict]:
    """The records of `path`, checked: one per row, a completion for each "ok" row, an error record
    for each other row, whose error holds the row's `wants` entry."""
    records = _records(path)
    assert sorted(records) == list(range(len(wants))), "not exactly one record per row"
    for i, want in enumerate(wants):
        r = records[i]
        if want == "ok":
            assert r["error"] is None and isinstance(r["completion"], str) and r["token_ids"], (i, r)
        else:
            assert r["finish_reason"] == "error" and r["completion"] is None and r["token_ids"] is None, (i, r)
            assert want == "error" or want in r["error"], (i, want, r["error"])
    return records


def test_a_byte_order_mark_is_skipped_in_every_text_format(tmp_path):
    rows = [{"prompt": "one two"}, {"prompt": "three"}]
    (tmp_path / "a.jsonl").write_bytes(BOM + "".join(json.dumps(r) + "\n" for r in rows).encode())
    (tmp_path / "a.json").write_bytes(BOM + json.dumps(rows).encode())
    (tmp_path / "a.csv").write_bytes(BOM + b"prompt\r\none two\r\nthree\r\n")
    for name in ("a.jsonl", "a.json", "a.csv"):
        assert [dict(r) for r in read_rows(tmp_path / name)] == rows, name


def test_bytes_that_are_not_utf8_cost_only_their_own_row(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"prompt": "one"}\n\xff\xfe{"prompt": "x"}\n\n{"prompt": "caf\xe9"}\n'
                                       b'{"prompt": "two"}\n')
    rows = list(read_rows(tmp_path / "a.jsonl"))
    assert [r.get("prompt") for r in rows] == ["one", None, None, "two"]  # the blank line 3 is no row
    assert rows[1]["__error__"] == "line 2 is not valid UTF-8 (byte 0xff at character 1)"
    assert rows[2]["__error__"] == "line 4 is not valid UTF-8 (byte 0xe9 at character 16)"
    # A csv record with such a byte, or one the csv reader refuses, is an error row; the reader goes on.
    (tmp_path / "a.csv").write_bytes(b'prompt,n\none,1\ncaf\xe9,2\n"two",3\n' + b"x" * 200_000 + b",4\nthree,5\n")
    rows = list(read_rows(tmp_path / "a.csv"))
    assert [r.get("n") for r in rows] == ["1", None, "3", None, "5"]
    assert rows[1]["__error__"] == "line 3 is not valid UTF-8 (byte 0xe9 at character 4 of column 'prompt')"
    assert "field larger than field limit" in rows[3]["__error__"]
    # In a .json list, such a byte inside a string costs its row at the prompt.
    (tmp_path / "a.json").write_bytes(b'[{"prompt": "caf\xe9"}, {"prompt": "two"}]')
    first, second = read_rows(tmp_path / "a.json")
    with pytest.raises(ValueError, match="lone surrogate"):
        prompt_of(first, "prompt", None, chat=False)
    assert second == {"prompt": "two"}


def test_a_lone_surrogate_is_refused_before_the_tokenizer():
    class Untouchable:  # the fast tokenizers raise an opaque TypeError on a lone surrogate
        def __call__(self, *args, **kwargs):
            raise AssertionError("the prompt reached the tokenizer")

        apply_chat_template = __call__

    for row, chat in [({"prompt": "a \ud800 b"}, False), ({"prompt": "\udfff"}, True),
                      ({"prompt": [{"role": "user", "content": "hi \udc80"}]}, True),
                      ({"prompt": [{"role": "user", "content": "hi", "\ud83d": "a key"}]}, True)]:
        with pytest.raises(ValueError, match=r"lone surrogate \(U\+D[89A-F][0-9A-F]{2} at character"):
            prompt_of(row, "prompt", Untouchable(), chat)


def _hostile_lines(chat: bool) -> list[tuple[bytes, str | None]]:
    """.jsonl lines and what their rows get: "ok", a piece of the error, or None (blank, no row)."""
    return [
        (b'{"prompt": "alpha beta"}', "ok"),
        (b'{"prompt": "alpha \\ud800 beta"}', "lone surrogate (U+D800 at character 7"),
        (b'{"prompt": [{"role": "user", "content": "\\udfff"}]}', "lone surrogate" if chat else "must hold a string"),
        (b'{"\\udc00": 1, "prompt": "gamma"}', "ok"),  # a surrogate outside the prompt is no matter
        (b'{"\\udc00": "gamma"}', "no column 'prompt'"),
        (b'{"prompt": "smile \\ud83d\\ude00"}', "ok"),  # a surrogate pair is text
        (b'{"prompt": "caf\xe9"}', "line 7 is not valid UTF-8 (byte 0xe9"),
        (b"", None),
        (b"\xff\xfe\x00garbage", "line 9 is not valid UTF-8 (byte 0xff"),
        (b'{"prompt": [{"role": "user", "content": null}]}',
         "chat template refused" if chat else "must hold a string"),
        (b'{"prompt": "del', "line 11 is not valid JSON"),  # the last line, cut short
    ]


def _without_errors(data: bytes) -> bytes:
    """The records of `data` (whole lines) that a rerun keeps: those with a result."""
    return b"".join(line for line in data.splitlines(keepends=True) if not json.loads(line)["error"])


@pytest.mark.parametrize("chat", [False, True])
def test_hostile_rows_get_one_error_record_each_and_a_rerun_retries_only_those(tiny, tmp_path, chat):
    engine, tokenizer = tiny
    lines = _hostile_lines(chat)
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_bytes(BOM + b"\n".join(line for line, _ in lines))
    wants = [want for _, want in lines if want is not None]
    out = tmp_path / "out.jsonl"
    params = SamplingParams(max_new_tokens=3)
    counts = run_job(engine, tokenizer, read_rows(rows_path), out, params, chat=chat, progress=False)
    assert (counts["written"], counts["errors"]) == (wants.count("ok"), len(wants) - wants.count("ok"))
    records = _check_records(out, wants)
    assert records[1]["prompt"] == "alpha \ud800 beta"  # written as ASCII escapes, read back the same
    assert records[4]["prompt"] == "null" and "'\\udc00'" in records[4]["error"]
    assert records[5]["prompt"] == "smile \U0001F600"
    before = out.read_bytes()
    counts = run_job(engine, tokenizer, read_rows(rows_path), out, params, chat=chat, progress=False)
    num_errors = len(wants) - wants.count("ok")
    assert (counts["written"], counts["errors"], counts["skipped"]) == (0, num_errors, wants.count("ok"))
    assert out.read_bytes().startswith(_without_errors(before)) and _check_records(out, wants) == records


WORD_TEXT = st.lists(st.sampled_from(WORDS), min_size=1, max_size=5).map(" ".join)
LONE_SURROGATE = st.integers(0xD800, 0xDFFF).map(lambda c: f"\\u{c:04x}")  # as a JSON escape
NOT_UTF8 = st.sampled_from([b"\xff", b"\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf5\x80"])  # whatever surrounds it


def _one_line(data: bytes, *drop: bytes) -> bytes:
    for b in (b"\n", b"\r", *drop):
        data = data.replace(b, b"")
    return data


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _noise(data: bytes) -> tuple[bytes, str]:
    """Random bytes as one line that is not blank (a .jsonl row, never a good one)."""
    data = _one_line(data)
    if not data.decode("utf-8", "surrogateescape").replace("\ufeff", "").strip():
        data += b"~"
    return data, "error"


JSONL_LINES = st.one_of(
    WORD_TEXT.map(lambda t: (json.dumps({"prompt": t}).encode(), "ok")),
    WORD_TEXT.map(lambda t: (json.dumps({"prompt": f"{t} café \U0001F600"}, ensure_ascii=False).encode(), "ok")),
    LONE_SURROGATE.map(lambda s: (f'{{"{s}": 1, "prompt": "alpha"}}'.encode(), "ok")),
    st.tuples(WORD_TEXT, LONE_SURROGATE).map(lambda p: (f'{{"prompt": "{p[0]} {p[1]}"}}'.encode(), "error")),
    LONE_SURROGATE.map(lambda s: (f'{{"prompt": [{{"role": "user", "content": "{s}"}}]}}'.encode(), "error")),
    LONE_SURROGATE.map(lambda s: (f'{{"prompt": [{{"role": "user", "content": "hi", "{s}": 1}}]}}'.encode(),
                                  "error")),
    st.tuples(st.binary(max_size=12), NOT_UTF8, st.binary(max_size=12)).map(
        lambda p: (_one_line(b"".join(p)), "error")),
    st.binary(min_size=1, max_size=24).map(_noise),
    st.sampled_from([b"", b"  ", b"\t"]).map(lambda b: (b, None)),
)
CSV_LINES = st.one_of(
    WORD_TEXT.map(lambda t: (f'"{t}",1'.encode(), "ok")),
    WORD_TEXT.map(lambda t: (f"{t} café,2,an extra field".encode(), "ok")),
    st.tuples(st.binary(max_size=12), NOT_UTF8, st.binary(max_size=12)).map(
        lambda p: (_one_line(b"".join(p), b'"'), "error")),
    st.just((b"", None)),
)


@st.composite
def hostile_files(draw, suffix: str) -> tuple[bytes, list[str]]:
    """A `suffix` input of good and hostile lines (random bytes, lone surrogates, blank lines), maybe
    a byte-order mark and a last line cut short, and what each row gets ("ok" or "error")."""
    lines = draw(st.lists(JSONL_LINES if suffix == ".jsonl" else CSV_LINES, max_size=8))
    ending = draw(st.sampled_from([b"\n", b"\r\n", b""]))
    if draw(st.booleans()):  # the last line cut short, without its newline
        whole = f'{{"prompt": "{draw(WORD_TEXT)} é"}}' if suffix == ".jsonl" else f'"{draw(WORD_TEXT)} é'
        cut = whole.encode()[:draw(st.integers(1 + (suffix == ".csv"), len(whole.encode()) - 1))]
        # A .jsonl line cut short is not JSON (or not UTF-8); the csv reader takes a quote still open
        # at the end as the field.
        lines.append((cut, "ok" if suffix == ".csv" and _is_utf8(cut) else "error"))
        ending = b""
    header = [] if suffix == ".jsonl" else [(b"prompt,n", None)]
    data = b"\n".join(line for line, _ in header + lines) + (ending if header + lines else b"")
    return (BOM if draw(st.booleans()) else b"") + data, [want for _, want in lines if want is not None]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_input_gets_one_record_per_row_and_survives_a_kill(tiny, tmp_path_factory, suffix, data):
    engine, tokenizer = tiny
    content, wants = data.draw(hostile_files(suffix), label="input")
    chat = data.draw(st.booleans(), label="chat")
    folder = tmp_path_factory.mktemp("hostile")
    path = folder / f"rows{suffix}"
    path.write_bytes(content)
    assert len(list(read_rows(path))) == len(wants)
    params = SamplingParams(max_new_tokens=2)
    out = folder / "out.jsonl"
    counts = run_job(engine, tokenizer, read_rows(path), out, params, chat=chat, progress=False)
    assert counts["written"] + counts["errors"] == len(wants)
    records = _check_records(out, wants)
    whole = out.read_bytes()
    again = run_job(engine, tokenizer, read_rows(path), out, params, chat=chat, progress=False)
    num_ok = wants.count("ok")
    assert (again["written"], again["errors"], again["skipped"]) == (0, len(wants) - num_ok, num_ok)
    assert _check_records(out, wants) == records
    # A SIGKILL leaves a prefix of the output, its last line maybe cut short; a rerun completes it.
    killed = folder / "killed.jsonl"
    cut = whole[:int(data.draw(st.floats(0, 1), label="killed at") * len(whole))]
    killed.write_bytes(cut)
    kept = _without_errors(cut[:cut.rfind(b"\n") + 1])
    run_job(engine, tokenizer, read_rows(path), killed, params, chat=chat, progress=False)
    assert killed.read_bytes().startswith(kept)  # every result written before the kill, unchanged
    assert _check_records(killed, wants) == records


def _hostile_jsonl(n: int = 50) -> tuple[bytes, list[str]]:
    """A .jsonl input with a byte-order mark, good rows between hostile ones, blank lines and a last
    line cut short, and what each row gets ("ok" or "error")."""
    lines, wants = [], []
    for i in range(n):
        text = " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(1 + i % 7))
        if i % 5 == 1:
            lines.append(f'{{"prompt": "{text} \\ud800"}}'.encode())  # a lone surrogate
        elif i % 5 == 3:
            lines.append(f'{{"prompt": "{text}"}}'.encode().replace(b" ", b"\xa0"))  # Latin-1, not UTF-8
        elif i % 10 == 4:
            lines.append(b"")
            continue
        else:
            lines.append(json.dumps({"prompt": text, "\ud800 note": "in a key"}).encode())
        wants.append("ok" if i % 5 not in (1, 3) else "error")
    return BOM + b"\n".join(lines) + b'\n{"prompt": "cut sh', wants + ["error"]


def test_a_killed_run_over_hostile_rows_resumes_without_losing_a_record(model_dir, tmp_path):
    content, wants = _hostile_jsonl()
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_bytes(content)
    out = tmp_path / "out.jsonl"
    cmd, env = _cli(model_dir, rows_path, out, "--max-new-tokens", "8")  # the last one counts
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and (
            not out.exists() or out.read_bytes().count(b"\n") < 15):
        time.sleep(0.05)
    if proc.poll() is not None:
        pytest.fail(f"the job ended before the kill (exit {proc.returncode}): {proc.communicate()[1][-2000:]!r}")
    proc.kill()
    proc.communicate(timeout=120)
    before = out.read_bytes()
    kept = before[:before.rfind(b"\n") + 1]
    written = kept.count(b"\n")
    assert 0 < written < len(wants), f"the run was not stopped half-way ({written} records)"
    assert any(json.loads(line)["error"] for line in kept.splitlines())  # hostile rows were written
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert out.read_bytes().startswith(_without_errors(kept))  # every result written before the kill, unchanged
    _check_records(out, wants)
