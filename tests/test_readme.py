"""README.md as a newcomer follows it: every snippet runs (or, for `make` and `pip`, names what exists),
each as its marker comment says (`doc_blocks`); the docs' relative links resolve; and every figure the
docs show from a tool (`<!-- generated: ... -->`) is what the tool prints now (`scripts/gen_docs.py`).

Python snippets are exec'd in this process, each in a fresh namespace (the default model loads in
well under a second once imported); `hf-paged` lines go through `hf_paged.cli.main`. The server
snippet's command is started once, on a free port, for the client snippets after it."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import shlex
import signal
import subprocess
import sys
import time

import httpx
import pytest

import doc_blocks
from doc_blocks import DOCS, README, README_URL, ROOT
from served import free_port

_spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
gen_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_docs)

README_BLOCKS = doc_blocks.code_blocks(README)
# Docs pages may mark a block to have it run too; unmarked docs blocks are reference material.
MARKED = README_BLOCKS + [b for page in DOCS for b in doc_blocks.code_blocks(page) if b.kind]


def _marked(*kinds):
    return pytest.mark.parametrize("block", [b for b in MARKED if b.kind in kinds], ids=lambda b: b.where)


def test_every_readme_block_says_how_it_is_tested():
    for block in README_BLOCKS:
        if block.generated:
            continue
        assert block.kind in doc_blocks.KINDS, (
            f"{block.where}: a code block without a `<!-- test: KIND -->` marker on the line before it "
            f"(KIND: one of {', '.join(doc_blocks.KINDS)})")
        assert block.kind not in ("skip", "exists", "server", "client") or block.note, \
            f"{block.where}: a `{block.kind}` marker needs its reason in parentheses"
        assert block.lang in ("python", "bash"), f"{block.where}: only python and bash blocks can be tested"
    for block in MARKED:  # a docs page's marker is honoured too, so a typo in one must not go unnoticed
        assert block.kind in doc_blocks.KINDS, f"{block.where}: unknown marker `{block.kind}`"
        assert block.kind != "server" or block.path == README, f"{block.where}: only README.md starts a server"


def test_the_readme_stays_a_quick_start():
    lines = README.read_text().split("\n")
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail into docs/"
    python = [b for b in README_BLOCKS if b.lang == "python"]
    assert "load_default" in python[0].code, "the first python snippet should start from the default model"


def test_the_supported_range_is_the_packages():
    # Read from the source: importing hf_paged beside torch registers the patch, seconds this test needn't spend.
    consts = {node.targets[0].id: ast.literal_eval(node.value)
              for node in ast.parse((ROOT / "hf_paged" / "transformers_api.py").read_text()).body
              if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in ("SUPPORTED_TRANSFORMERS",
                                                                                          "CHECKED_ON")}
    low, high = (v.removesuffix(".0") for v in consts["SUPPORTED_TRANSFORMERS"])
    checked = consts["CHECKED_ON"]
    page = (ROOT / "docs" / "supported-releases.md").read_text()
    assert f"`>={low},<{high}`" in page
    assert ", ".join(checked) in page, "docs/supported-releases.md lists other checked releases"
    assert f"transformers {low} to {checked[-1].removesuffix('.0')}" in README.read_text()


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    assert doc_blocks.missing_link_targets(page) == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_docs_python_blocks_compile(page):
    broken = []
    for block in doc_blocks.code_blocks(page):
        if block.lang == "python":
            try:
                compile(block.code, block.where, "exec")
            except SyntaxError as exc:
                broken.append(f"{block.where}: {exc.msg} (line {exc.lineno})")
    assert broken == [], broken


def test_generated_figures_are_the_tools_output():
    seen = []
    for path in gen_docs.doc_files():
        text = path.read_text()
        seen += gen_docs.commands(text)
        _, stale = gen_docs.regenerate(text)
        assert not stale, f"{path.name}: stale output of {stale}: run `python scripts/gen_docs.py`"
    assert any(c.startswith("hf-paged plan") for c in seen) and any(c.startswith("hf-paged kv-size") for c in seen)


def test_a_stale_generated_block_is_found_and_rewritten():
    command = "hf-paged kv-size smollm2-135m"
    text = f"before\n<!-- generated: {command} -->\n```\n$ {command}\n36.9 GB, 104 sequences\n```\n<!-- /generated -->\n"
    new, stale = gen_docs.regenerate(text)
    assert stale == [command] and new.startswith("before\n") and "36.9 GB" not in new
    assert gen_docs.regenerate(new) == (new, [])
    with pytest.raises(ValueError, match="without its"):
        gen_docs.regenerate(f"<!-- generated: {command} -->\n")


def test_hf_paged_imports_in_docs_and_docstrings_exist():
    texts = {b.where: b.code for page in [README, *DOCS] for b in doc_blocks.code_blocks(page) if b.lang == "python"}
    for path in sorted((ROOT / "hf_paged").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                texts[f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}"] = ast.get_docstring(node) or ""
    problems = [f"{where}: {p}" for where, text in texts.items() for p in doc_blocks.missing_imports(text)]
    assert problems == []


@_marked("exists")
def test_exists_blocks_name_what_exists(block):
    for line in doc_blocks.shell_lines(block.code):
        assert doc_blocks.existence_problem(line) is None, f"{block.where}: {doc_blocks.existence_problem(line)}"


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """A scratch working directory; the CLI's process-wide settings put back afterwards."""
    monkeypatch.chdir(tmp_path)
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):  # set by batch jobs
        monkeypatch.delenv(name, raising=False)
    return tmp_path


@pytest.mark.slow
@_marked("run")
def test_run_blocks_run(block, in_tmp, capsys):
    if block.lang == "python":
        exec(compile(block.code, block.where, "exec"), {"__name__": "__readme__"})
        return
    from hf_paged.cli import main

    for line in doc_blocks.shell_lines(block.code):
        words = shlex.split(line, comments=True)
        if words[0] == "hf-paged":
            assert main(words[1:]) == 0, f"{block.where}: {line}\n{capsys.readouterr().err[-2000:]}"
        else:
            subprocess.run(["bash", "-ec", line], cwd=in_tmp, check=True)
    if "--output out.jsonl" in block.code:
        assert (in_tmp / "out.jsonl").read_text().count("\n") == (in_tmp / "rows.jsonl").read_text().count("\n")


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """The README's `hf-paged serve` command, started on a free port: its URL. It must exit 0 on SIGTERM."""
    block = next(b for b in README_BLOCKS if b.kind == "server")
    (line,) = doc_blocks.shell_lines(block.code)
    words = shlex.split(line, comments=True)
    assert words[:2] == ["hf-paged", "serve"], f"{block.where}: the server block runs `hf-paged serve`"
    port = free_port()
    words[words.index("--port") + 1] = str(port)
    env = {k: v for k, v in os.environ.items() if k != "HF_PAGED_API_KEY"}
    log = (tmp_path_factory.mktemp("readme_server") / "stderr").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged.cli", *words[1:]], stdout=subprocess.DEVNULL,
                            stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.seek(0)
            raise RuntimeError(f"`{line}` did not start: {log.read()[-3000:]}")
        time.sleep(0.2)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(60) == 0, "the README's server did not exit 0 on SIGTERM"
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.slow
@_marked("client")
def test_client_blocks_run_against_the_readme_server(block, readme_server):
    pytest.importorskip("openai")
    assert README_URL in block.code, f"{block.where}: a client block talks to {README_URL}, which the test replaces"
    namespace = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.code.replace(README_URL, readme_server), block.where, "exec"), namespace)
    assert out.getvalue().strip(), f"{block.where} printed nothing"
    reply = namespace.get("reply")
    if reply is not None:  # the README's chat completion without max_tokens: a whole answer
        assert reply.choices[0].finish_reason == "stop" and "Paris" in reply.choices[0].message.content, reply

