"""Reruns the commands whose output README.md and docs/*.md show, and rewrites their blocks.

A generated block is the command between markers, its output in a code block:

    <!-- generated: hf-paged plan llama-3-70b --gpu h100-sxm --tp 4 -->
    ```
    $ hf-paged plan llama-3-70b --gpu h100-sxm --tp 4
    ...what the command prints now...
    ```
    <!-- /generated -->

so a figure in the docs is the tool's own and cannot drift from it. Only `hf-paged` commands are
allowed; each runs through `hf_paged.cli.main` in this process (trailing spaces dropped from every line).

Usage:
    python scripts/gen_docs.py            # rewrite every stale block
    python scripts/gen_docs.py --check    # list the stale blocks and exit 1 if there are any
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import shlex
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^<!-- generated: (?P<command>.+?) -->\n(?P<body>.*?)^<!-- /generated -->$", re.M | re.S)


def doc_files() -> list[pathlib.Path]:
    """README.md and every docs/*.md page."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def run_command(command: str) -> str:
    """What `command` (an `hf-paged ...` line) prints, stdout and stderr together.

    Raises:
        ValueError: the command is not an `hf-paged` command.
        RuntimeError: it exited with a non-zero status.
    """
    argv = shlex.split(command)
    if argv[:1] != ["hf-paged"]:
        raise ValueError(f"generated blocks run hf-paged commands only, not {command!r}")
    from hf_paged.cli import main

    out = io.StringIO()  # stdout and stderr in the order a terminal shows them (notes go to stderr)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = main(argv[1:])
    if status:
        raise RuntimeError(f"{command!r} exited with status {status}")
    return out.getvalue()


def render(command: str, output: str) -> str:
    """The block's body for `command` and its output."""
    lines = [line.rstrip() for line in output.rstrip("\n").split("\n")]
    return "\n".join(["```", f"$ {command}", *lines, "```", ""])


def regenerate(text: str) -> tuple[str, list[str]]:
    """`text` with every generated block rewritten from its command's output now, and the commands whose
    block changed."""
    if len(re.findall(r"^<!-- generated: ", text, re.M)) != len(commands(text)):
        raise ValueError("a `<!-- generated: ... -->` marker without its `<!-- /generated -->`")
    stale = []

    def rewrite(match: re.Match) -> str:
        command = match.group("command")
        body = render(command, run_command(command))
        if body != match.group("body"):
            stale.append(command)
        return f"<!-- generated: {command} -->\n{body}<!-- /generated -->"

    return BLOCK.sub(rewrite, text), stale


def commands(text: str) -> list[str]:
    """The commands of the generated blocks in `text`."""
    return [m.group("command") for m in BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check = "--check" in argv
    any_stale = False
    for path in doc_files():
        text = path.read_text()
        new, stale = regenerate(text)
        for command in stale:
            print(f"{path.relative_to(ROOT)}: {'stale' if check else 'rewrote'}: {command}")
        any_stale |= bool(stale)
        if stale and not check:
            path.write_text(new)
    return 1 if check and any_stale else 0


if __name__ == "__main__":
    sys.exit(main())
