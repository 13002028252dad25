"""`StructuredOutputs`: what a request's output must match (vLLM's `StructuredOutputsParams`).

Torch-free and backend-free (a leaf module): plain data, checked by `validate` and pickled with its
`SamplingParams` to other processes; `structured.grammar.Grammars` compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint.

    Args:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid against it.
        json_object: True: the output is any JSON object (OpenAI's `response_format={"type": "json_object"}`).
        regex: the output matches this regular expression, whole.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (GBNF, with a `root` rule).
        lark: a Lark grammar (with a `start` rule).
        structural_tag: an xgrammar structural tag (a dict, or its JSON text): free text with tagged,
            schema-checked sections such as tool calls.
        any_whitespace: with `json` / `json_object`, whether any whitespace may separate JSON tokens
            (False: the compact form, `,` and `:` with no spaces).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    lark: str | None = None
    structural_tag: dict | str | None = None
    any_whitespace: bool = True

    @property
    def kind(self) -> str:
        """Which constraint it holds (one of `KINDS`); `validate` first."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        """Raise ValueError/TypeError naming the problem: not exactly one constraint, or one of the wrong
        type. (Whether a schema or grammar compiles is checked by `grammar.Grammars.compile`.)"""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if not isinstance(self.json_object, bool) or not isinstance(self.any_whitespace, bool):
            raise TypeError("structured outputs' json_object and any_whitespace must be booleans")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured outputs' {name} is not valid JSON: {exc}") from None
            if not isinstance(value, dict):
                raise TypeError(f"structured outputs' {name} must be a JSON object (a dict or its text), "
                                f"got {type(value).__name__}")
        for name in ("regex", "grammar", "lark"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured outputs' {name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise TypeError(f"structured outputs' choice must be a non-empty list of non-empty strings, "
                            f"got {self.choice!r}")

    def key(self) -> tuple:
        """A hashable key, equal for equal constraints (a schema dict's key order does not matter)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif isinstance(value, str) and self.kind in ("json", "structural_tag"):
            value = json.dumps(json.loads(value), sort_keys=True)
        elif isinstance(value, list):
            value = tuple(value)
        return self.kind, value, self.any_whitespace
