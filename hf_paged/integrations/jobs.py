"""Batch jobs: generate a completion for every row of a dataset file and write them out as they
finish, resumable (`hf-paged generate --input ... --output ...`).

* Input: a `.jsonl`, `.json` (a list of objects), `.csv` or `.parquet` file, or a folder written by
  `datasets.Dataset.save_to_disk`; the prompt is the row's `column` (a string, or with `chat=True`
  a user message, or a list of chat messages, rendered with the tokenizer's chat template). Text
  files are UTF-8, with or without a byte-order mark. A `.jsonl` row is a line that is not blank;
  a `.csv` row is a record after the header.
* Output: one JSON line per row, `{"index", "prompt", "completion", "token_ids", "finish_reason",
  "error"}`, appended (and flushed) the moment the row finishes, in finishing order. A record whose
  text will not encode as UTF-8 (a lone surrogate, from a `"\\ud800"` escape in the input) is
  written with ASCII escapes, so writing a record never fails.
* Before any model loads, `inspect_input` reads the input once: the number of rows (the progress
  bar's total) and whether its first readable row has the prompt column.
* Resume: rows whose index is already in the output with a result are skipped, so a run that was
  interrupted (Ctrl-C, SIGTERM, SIGKILL, a crash) and started again ends with exactly one record per
  row; a last line cut short by a kill, and every error record, are dropped first: a rerun retries
  the rows that failed. A row's result does not depend on the rows run
  beside it (greedy, or sampling seeded per row: `seed + index`), so a resumed run writes what an
  uninterrupted one would.
* A bad row gets a record with `error` set and `finish_reason` "error"; the job goes on. Bad rows
  are a line that is not valid UTF-8 or not JSON, a `.csv` record with bytes that are not UTF-8,
  and a prompt that is missing, empty, too long, not text, holds a lone surrogate, or is refused
  by the chat template. A row the engine failed on (a step that kept failing) gets one too,
  marked `"retry": true`. A rerun replaces every error record with the row's new outcome.
* Every row runs through one `Engine`, at most `max_in_flight` rows queued at a time, with a tqdm
  progress bar (rows out of the total with an ETA, and generated tokens per second).
"""

from __future__ import annotations

import csv
import json
import dataclasses
import logging
import os
import queue
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from ..engine import Engine
from ..engine.delivery import Inbox
from ..text import refuse_lone_surrogates
from ..sampling_params import SamplingParams
from ..optional import require

logger = logging.getLogger(__name__)

INPUT_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def read_rows(path: str | os.PathLike) -> Iterator[dict]:
    """The rows of a dataset file or saved `datasets` folder, as dicts, in order.

    A leading UTF-8 byte-order mark is skipped. A row that cannot be read (a `.jsonl` line that is
    not valid UTF-8 or not JSON, a `.csv` record holding bytes that are not UTF-8 or one the csv
    reader refuses) comes as `{"__error__": reason}` in its place, so the row numbers, which resume
    relies on, are the same on every run.

    Raises:
        ValueError: an unknown file type, or a `.json` file that is not a JSON list; ImportError: parquet
            or a saved dataset without `datasets`.
    """
    path = Path(path)
    if path.is_dir():
        dataset = _datasets("a saved dataset folder").load_from_disk(str(path))
        yield from dataset
        return
    suffix = path.suffix.lower()
    # Bytes that are not UTF-8 decode to lone surrogates U+DC80..U+DCFF (surrogateescape), which strict
    # UTF-8 never produces, so one bad byte costs its own row, not the job.
    if suffix == ".jsonl":
        with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if (bad := _escaped_byte(line)) is not None:
                    yield {"__error__": f"line {n} is not valid UTF-8 ({bad})"}
                    continue
                try:
                    yield json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    yield {"__error__": f"line {n} is not valid JSON"}
    elif suffix == ".json":
        with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
            data = json.load(f)  # a string with a byte that is not UTF-8 holds a lone surrogate: prompt_of refuses it
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json input must hold a list of objects")
        yield from data
    elif suffix == ".csv":
        with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
            reader = csv.DictReader(f)
            while True:
                try:
                    row = next(reader)
                except StopIteration:
                    return
                except csv.Error as exc:  # e.g. a field over csv.field_size_limit(); the reader goes on
                    yield {"__error__": f"the csv record after line {reader.line_num} is refused: {exc}"}
                    continue
                bad = _csv_escaped_byte(row)
                yield row if bad is None else {"__error__": f"line {reader.line_num} is not valid UTF-8 ({bad})"}
    elif suffix == ".parquet":
        yield from _datasets("parquet input").Dataset.from_parquet(str(path))
    else:
        raise ValueError(f"{path}: unknown input type {suffix!r}; use one of {', '.join(INPUT_SUFFIXES)} or a folder "
                         "written by datasets.Dataset.save_to_disk")


def _escaped_byte(text: str) -> str | None:
    """Where `text`, decoded with surrogateescape, holds a byte that is not UTF-8, or None."""
    match = _ESCAPED_BYTE.search(text)
    return None if match is None else f"byte 0x{ord(match[0]) - 0xDC00:02x} at character {match.start() + 1}"


def _csv_escaped_byte(row: dict) -> str | None:
    """Where a csv row's values hold a byte that is not UTF-8, or None."""
    for key, value in row.items():
        for v in value if isinstance(value, list) else [value]:  # key None: the fields past the header's
            if isinstance(v, str) and (where := _escaped_byte(v)) is not None:
                return f"{where} of column {key!r}" if key is not None else f"{where} of a field past the header"
    return None


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def _datasets(what: str):
    return require("datasets", "data", what)


def inspect_input(path: str | os.PathLike, column: str) -> int:
    """Check a job's input before a model loads: its number of rows.

    Raises:
        ValueError: no such file, an unreadable or unknown input, no rows at all, or a first readable
            row (an object) without `column` (the message lists the columns it has).
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--input {str(path)!r}: no such file or folder")
    if path.is_dir() or path.suffix.lower() == ".parquet":  # a table: its columns, without walking its rows
        loader = _datasets("a saved dataset folder" if path.is_dir() else "parquet input")
        table = loader.load_from_disk(str(path)) if path.is_dir() else loader.Dataset.from_parquet(str(path))
        num_rows, first = len(table), (dict.fromkeys(table.column_names) if len(table) else None)
    else:
        num_rows, first = 0, None
        try:
            for row in read_rows(path):
                num_rows += 1
                if first is None and isinstance(row, dict) and "__error__" not in row:
                    first = row
        except (OSError, UnicodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"--input {str(path)!r}: {exc}") from exc
    if num_rows == 0:
        raise ValueError(f"--input {str(path)!r} holds no rows")
    if first is not None and column not in first:
        names = ", ".join(repr(k) for k in first) or "none"
        raise ValueError(f"--column {column!r}: the input has no such column (its first row has {names})")
    return num_rows


def done_indices(output: str | os.PathLike) -> set[int]:
    """Indices already in `output` with a result. A last line cut short (a killed run) is removed from
    the file, and so is every error record: a rerun tries those rows again.

    Raises:
        ValueError: a complete line that is not one of this job's records (another file?).
    """
    path = Path(output)
    if not path.exists():
        return set()
    done: set[int] = set()
    kept: list[bytes] = []
    lines = path.read_bytes().splitlines(keepends=True)
    partial = False
    for n, line in enumerate(lines, 1):
        try:
            record = json.loads(line) if line.endswith(b"\n") else None
        except json.JSONDecodeError:
            record = None
        if record is None:  # only a killed run's last line may be cut short
            if n < len(lines):
                raise ValueError(f"{path}: line {n} is not a JSON record; is --output another file?")
            partial = True
            break
        if not isinstance(record, dict) or not isinstance(record.get("index"), int):
            raise ValueError(f"{path}: line {n} has no integer 'index'; is --output another file?")
        if not record.get("error"):
            done.add(record["index"])
            kept.append(line)
    if len(kept) != len(lines):
        retried = len(lines) - len(kept) - partial
        logger.warning("hf_paged: %s: dropping %s before resuming", path, " and ".join(
            ([f"{retried} error record(s), to retry those rows"] if retried else [])
            + (["a partial last record"] if partial else [])))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(b"".join(kept))
        os.replace(tmp, path)
    return done


def prompt_of(row: dict, column: str, tokenizer, chat: bool):
    """The row's prompt as token ids (chat-templated with `chat`).

    Raises:
        ValueError/TypeError: an unreadable row (`read_rows`), no such column, an empty prompt, one of
            the wrong type, one holding a lone surrogate (no tokenizer can encode it), or chat messages
            the chat template refuses.
    """
    if "__error__" in row:
        raise ValueError(row["__error__"])
    if column not in row:
        raise ValueError(f"the row has no column {column!r} (it has {sorted(row, key=str)})")
    value = row[column]
    if chat:
        messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise TypeError(f"column {column!r} must hold a string or a list of chat messages, got {value!r:.80}")
        refuse_lone_surrogates(messages, "the prompt")
        from jinja2 import TemplateError

        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        except TemplateError as exc:  # e.g. a message whose content is null
            raise ValueError(f"the chat template refused the messages: {exc}") from exc
    if not isinstance(value, str):
        raise TypeError(f"column {column!r} must hold a string, got {type(value).__name__}")
    if not value:
        raise ValueError("the prompt is empty")
    refuse_lone_surrogates(value, "the prompt")
    return tokenizer(value)["input_ids"]


def run_job(engine: Engine, tokenizer, rows, output: str | os.PathLike, params: SamplingParams, *,
            column: str = "prompt", chat: bool = False, max_in_flight: int | None = None,
            progress: bool = True, total: int | None = None) -> dict:
    """Generate for every row not yet in `output`, appending a record per row as it finishes.

    Args:
        engine: runs every row (its tokenizer decodes the completions).
        rows: an iterable of dicts (`read_rows`).
        params: every row's sampling; with `params.seed` set, row `i` uses `seed + i`.
        max_in_flight: rows queued at once (default four times the engine's `max_num_seqs`).
        total: the number of rows, for the progress bar's ETA (default `len(rows)` where it has one).

    Returns:
        counts: `written`, `errors`, `skipped` (already in the output) and `seconds`.
    """
    done = done_indices(output)
    limit = max_in_flight or 4 * engine.max_num_seqs
    inbox = Inbox(wants_tokens=False)
    live: dict[str, tuple[int, str]] = {}  # request id -> (row index, prompt text)
    counts = dict(written=0, errors=0, skipped=0, tokens=0)
    began = time.perf_counter()
    if total is None and hasattr(rows, "__len__"):
        total = len(rows)
    bar = _bar(progress, total, len(done))
    stop = _StopOnSigterm()
    with open(output, "ab") as out, stop:
        def write(record: dict) -> None:
            try:
                line = json.dumps(record, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate: the escapes read back as the same string
                line = json.dumps(record).encode("ascii")
            out.write(line + b"\n")  # one write per record: a kill can cut only the last line short
            out.flush()
            counts["errors" if record["error"] else "written"] += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(tok_s=f"{counts['tokens'] / max(time.perf_counter() - began, 1e-9):.1f}")

        def collect(wait: bool) -> None:
            """Write every finished row; with `wait`, step the engine until one finishes first."""
            while live:
                try:
                    _, final = inbox.get_nowait()
                except queue.Empty:
                    if not wait:
                        return
                    engine.advance()
                    continue
                if final is None:
                    continue
                wait = False
                index, prompt = live.pop(final.request_id)
                sample = final.outputs[0]
                counts["tokens"] += len(sample.token_ids)
                error = None if sample.error is None and sample.finish_reason != "error" else str(sample.error)
                record = dict(index=index, prompt=prompt, completion=None if error else sample.text,
                              token_ids=None if error else list(sample.token_ids),
                              finish_reason=sample.finish_reason, error=error)
                if error:
                    record["retry"] = True  # the engine's failure, not the row's: a rerun tries again
                write(record)

        try:
            for index, row in enumerate(rows):
                if index in done:
                    counts["skipped"] += 1
                    continue
                shown = _shown(row.get(column) if isinstance(row, dict) else None)
                try:
                    if not isinstance(row, dict):
                        raise TypeError(f"row {index} is a {type(row).__name__}, not an object")
                    ids = prompt_of(row, column, tokenizer, chat)
                    row_params = params if params.seed is None else _with_seed(params, params.seed + index)
                    rid = engine.add_owned_request(ids, row_params, None, inbox, index)
                except (ValueError, TypeError) as exc:
                    write(dict(index=index, prompt=shown, completion=None, token_ids=None, finish_reason="error",
                               error=str(exc)))
                    continue
                live[rid] = (index, shown)
                collect(wait=len(live) >= limit)
            while live:
                collect(wait=True)
        finally:
            for rid in list(live):
                engine.abort(rid)
            if bar is not None:
                bar.close()
    counts["seconds"] = time.perf_counter() - began
    return counts


def _shown(value) -> str:
    """A record's `prompt`: the prompt text, or the column's value as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):  # e.g. nested deeper than json.dumps goes
        return f"<{type(value).__name__}>"


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return dataclasses.replace(params, seed=seed)


def _bar(progress: bool, total: int | None, num_done: int):
    if not progress:
        return None
    from tqdm.auto import tqdm

    # Rows already in the output count from the start, so the ETA covers only what is left.
    initial = min(num_done, total) if total is not None else 0
    return tqdm(desc="hf_paged", unit="row", dynamic_ncols=True, total=total, initial=initial)


class _StopOnSigterm:
    """Within the block, SIGTERM ends the job like Ctrl-C (KeyboardInterrupt): the records written so
    far are complete and flushed, and a rerun resumes after them. Only in the main thread."""

    def __enter__(self):
        self._installed = False
        try:
            self._previous = signal.signal(signal.SIGTERM, self._raise)
            self._installed = True
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, *exc):
        if self._installed:  # None: a handler not set from Python; the default is the closest
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        return False

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt("SIGTERM")
