"""Checks on text that comes from outside (prompts, request bodies, dataset rows), shared by the
engine, the batch jobs and the server. A leaf: torch-free, imports nothing of hf_paged.

A Python `str` can hold a lone UTF-16 surrogate (U+D800..U+DFFF), from a JSON `"\\ud800"` escape or
from bytes decoded with `surrogateescape`. It is not Unicode text: no tokenizer encodes it, and no
UTF-8 writer (an error message, a record) can write it. So it is refused where it enters.
"""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


def find_lone_surrogate(value, path: str = "the text") -> str | None:
    """Where a lone surrogate sits in `value` (a string, or lists and dicts of them, keys included):
    `"<path> holds a lone surrogate (U+D800 at character 7)"`, or None. Iterative: JSON may nest
    deeper than Python's recursion limit."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            match = _SURROGATE.search(item)
            if match is not None:
                return f"{where} holds a lone surrogate (U+{ord(match[0]):04X} at character {match.start() + 1})"
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((child, f"{where}.{str(key)[:40]}"))
                stack.append((key, f"a key of {where}"))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return None


def refuse_lone_surrogates(value, path: str = "the text") -> None:
    """Raise ValueError naming where `value` holds a lone surrogate (see `find_lone_surrogate`)."""
    where = find_lone_surrogate(value, path)
    if where is not None:
        raise ValueError(f"{where}, which is not Unicode text (a \\ud800-\\udfff escape, or a byte that is not UTF-8)")
