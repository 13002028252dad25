"""The `hf-paged` command line as a newcomer meets it (issue 53): `generate` honours every flag it
shows, bad arguments are one line and exit 2 before anything loads, batch jobs check their input
first, retry error records and show a total, and `import hf_paged` / `--help` stay light (no torch,
no transformers) while `attn_implementation="hf_paged"` still works once transformers is imported.

Most tests call `hf_paged.cli.main` in this process on a tiny random model; the ones about what a
fresh interpreter imports run a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hf_paged import cli
from tiny_models import save_tiny_llama_folder

# Subprocesses run away from the checkout, so `hf_paged` resolves as installed (or through PYTHONPATH).
ELSEWHERE = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama over the default tokenizer (which has a chat template), saved as a model folder."""
    pytest.importorskip("gguf")
    return save_tiny_llama_folder(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def engines(monkeypatch):
    """The engines the command line builds, in order (each keeps the model it was given)."""
    import hf_paged.engine

    built = []

    class Spy(hf_paged.engine.Engine):
        def __init__(self, model, *args, **kwargs):
            built.append(self)
            self.given_model = model
            super().__init__(model, *args, **kwargs)

    monkeypatch.setattr(hf_paged.engine, "Engine", Spy)
    return built


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ELSEWHERE, capture_output=True,
                          text=True, timeout=timeout)


# `generate` with one prompt: the model, sampling, device and dtype flags.

def test_generate_answers_with_the_model_dtype_and_device_it_is_given(model_dir, engines, capsys):
    rc, out, err = _run(capsys, "generate", "alpha beta", "--model", model_dir, "--dtype", "bfloat16",
                        "--device", "cpu", "--max-new-tokens", "4", "--block-size", "8")
    assert rc == 0, err
    (engine,) = engines
    assert Path(engine.given_model.name_or_path) == Path(model_dir)  # not the default model
    assert engine.given_model.dtype == torch.bfloat16 and engine.given_model.device.type == "cpu"
    assert engine.block_size == 8


def test_generate_samples_with_the_temperature_and_seed_it_is_given(model_dir, capsys):
    common = ["generate", "alpha beta gamma", "--model", model_dir, "--max-new-tokens", "8"]
    sampled = [_run(capsys, *common, "--temperature", "1.5", "--seed", "3") for _ in range(2)]
    greedy = _run(capsys, *common)
    assert [rc for rc, _, _ in sampled + [greedy]] == [0, 0, 0]
    assert sampled[0][1] == sampled[1][1]  # reproducible
    assert sampled[0][1] != greedy[1]


def test_bad_flags_are_one_line_and_exit_2(model_dir, capsys):
    for flags, named in [(["--top-p", "0"], "top_p"), (["--temperature", "-1"], "temperature"),
                         (["--block-size", "0"], "--block-size"), (["--device", "cuda:99"], "cuda:99"),
                         (["--device", "toaster"], "toaster")]:
        rc, out, err = _run(capsys, "generate", "hi", "--model", model_dir, *flags)
        assert rc == 2 and named in _one_line(err) and not out, (flags, err)


# A model argument that names nothing loadable: one line naming it, exit 2, nothing imported.

def test_a_missing_model_path_is_one_line_before_torch_is_imported():
    result = _python("""
        import sys
        from hf_paged.cli import main
        codes = [main(["generate", "--model", "/nonexistent/model", "hello"]),
                 main(["generate", "--model", "/nonexistent/model", "--input", "rows.jsonl", "--output", "o.jsonl"])]
        print(codes, "torch" in sys.modules, "transformers" in sys.modules)
    """)
    assert result.stdout.split() == ["[2,", "2]", "False", "False"], result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and all("'/nonexistent/model'" in line and "does not exist" in line for line in lines)


def test_check_model_path_names_what_is_missing(tmp_path):
    from hf_paged.model_source import ModelPathError, check_model_path

    assert check_model_path("default") == "default"
    assert check_model_path("hf_paged.defaults.models:load_default") == "hf_paged.defaults.models:load_default"
    (tmp_path / "config.json").write_text("{}")
    assert check_model_path(str(tmp_path)) == str(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    for arg, says in [(str(empty), "has no config.json"), (str(tmp_path / "config.json"), "is a file"),
                      ("no_such_module.sub:build", "no module named 'no_such_module.sub'"),
                      ("./missing", "does not exist"), ("", "give a model folder")]:
        with pytest.raises(ModelPathError, match=says) as info:
            check_model_path(arg)
        assert "\n" not in str(info.value) and repr(arg) in str(info.value)


def test_a_hub_id_is_refused_offline_unless_it_is_cached(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    from hf_paged.model_source import ModelPathError, check_model_path

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelPathError, match=r"'someorg/some-model' .* offline .* download it first") as info:
        check_model_path("someorg/some-model")
    assert "\n" not in str(info.value)
    rc, out, err = _run(capsys, "generate", "hi", "--model", "someorg/some-model")
    assert rc == 2 and "someorg/some-model" in _one_line(err)
    # In the local cache, the id is accepted as it is (transformers resolves it from disk).
    snapshot = tmp_path / "models--someorg--some-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--someorg--some-model" / "refs").mkdir()
    (tmp_path / "models--someorg--some-model" / "refs" / "main").write_text("abc123")
    assert check_model_path("someorg/some-model") == "someorg/some-model"


# Batch jobs.

def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_typod_column_stops_before_the_model_loads(model_dir, tmp_path, engines, monkeypatch, capsys):
    from hf_paged.model_source import ModelFromPath

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(ModelFromPath, "__call__", refuse)
    rows = _jsonl(tmp_path / "rows.jsonl", [{"id": i, "prompt": f"alpha {i}"} for i in range(3)])
    out = tmp_path / "out.jsonl"
    rc, _, err = _run(capsys, "generate", "--model", model_dir, "--input", rows, "--output", out, "--column", "promt")
    line = _one_line(err)
    assert rc == 2 and "'promt'" in line and "'prompt'" in line and "'id'" in line
    assert not out.exists() and not engines
    rc, _, err = _run(capsys, "generate", "--model", model_dir, "--input", tmp_path / "nope.jsonl", "--output", out)
    assert rc == 2 and "nope.jsonl" in _one_line(err)


def test_a_job_where_every_row_fails_exits_non_zero(model_dir, tmp_path, capsys):
    rows = _jsonl(tmp_path / "rows.jsonl", [{"prompt": ""}, {"prompt": ""}])
    rc, out, err = _run(capsys, "generate", "--model", model_dir, "--input", rows, "--output", tmp_path / "o.jsonl",
                        "--no-progress")
    assert rc == 1 and "0 rows written, 2 error records (a rerun retries them)" in out
    assert "every row failed" in err


def test_a_rerun_retries_error_records_and_the_bar_shows_a_total(model_dir, tmp_path, capsys):
    rows = _jsonl(tmp_path / "rows.jsonl", [{"prompt": f"alpha beta {i}"} for i in range(4)])
    out = tmp_path / "out.jsonl"
    # What an earlier run with a wrong column left: an error record per row, and one finished row.
    records = [dict(index=i, prompt=None, completion=None, token_ids=None, finish_reason="error",
                    error="the row has no column 'promt'") for i in range(3)]
    records.append(dict(index=3, prompt="alpha beta 3", completion="x", token_ids=[1], finish_reason="length",
                        error=None))
    _jsonl(out, records)
    rc, stdout, err = _run(capsys, "generate", "--model", model_dir, "--input", rows, "--output", out,
                           "--max-new-tokens", "3")
    assert rc == 0 and "3 rows written, 0 error records, 1 already done" in stdout
    final = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(final) == [0, 1, 2, 3] and all(r["error"] is None for r in final.values())
    assert "4/4" in err and "?" not in err.rsplit("\r", 1)[-1]  # a total, and so an ETA


# Start-up: `import hf_paged` and the light subcommands import neither torch nor transformers.

def test_help_and_kv_size_start_without_torch():
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "hf_paged.cli", "--help"], cwd=ELSEWHERE, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and "generate" in result.stdout
    assert time.perf_counter() - started < 2.0  # a loose guard; benchmarks/cli_startup.py has the figure
    result = _python("""
        import sys
        from hf_paged import cli  # through the package's lazy attributes, as a user writes it
        assert cli.main(["kv-size", "llama-3-8b"]) == 0
        print("torch" in sys.modules, "transformers" in sys.modules)
    """)
    assert result.stdout.split()[-2:] == ["False", "False"], result.stderr


TINY_LLAMA = ("LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
              "num_attention_heads=2, num_key_value_heads=1)")


IMPORT_ORDERS = {"hf_paged first": "import hf_paged",
                 "transformers first": "from transformers import AutoModelForCausalLM\nimport hf_paged",
                 "hf_paged.engine first": "from hf_paged.engine import Engine\nimport hf_paged",
                 "hf_paged.integrations first": "from hf_paged.integrations import jobs\nimport hf_paged"}


def test_import_hf_paged_is_light_and_still_registers_the_attention():
    """Registration happens whichever import comes first: transformers' models (the post-import hook, or
    at `import hf_paged` when they are already there), or an hf_paged sub-package that imports them. One
    fresh interpreter per order, all started at once (each spends its seconds importing)."""
    procs = {}
    for order, first in IMPORT_ORDERS.items():
        code = textwrap.dedent(f"""
            import sys, warnings
            warnings.simplefilter("error", RuntimeWarning)  # a failed post-import hook warns
            {first.replace(chr(10), chr(10) + '            ')}
            light = "torch" not in sys.modules
            from transformers import AutoModelForCausalLM, LlamaConfig
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
            import torch
            model = AutoModelForCausalLM.from_config({TINY_LLAMA}, attn_implementation="hf_paged")
            out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                                 pad_token_id=0)  # random weights: an EOS must not end it early
            from hf_paged import Engine, PagedCache
            print(light, "hf_paged" in ALL_ATTENTION_FUNCTIONS, hf_paged.integrations.is_installed(),
                  tuple(out.shape), Engine.__name__, "Engine" in dir(hf_paged))
        """)
        procs[order] = subprocess.Popen([sys.executable, "-c", code], cwd=ELSEWHERE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for order, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, (order, stderr[-3000:])
        light, *rest = stdout.split()
        assert rest == ["True", "True", "(1,", "5)", "Engine", "True"], (order, stdout)
        assert light == ("True" if order == "hf_paged first" else "False"), order
