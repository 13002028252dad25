"""`StructuredOutputs`: what a request's output must match (vLLM's `StructuredOutputsParams`).

Torch-free and backend-free (a leaf module): plain data, checked by `validate` and pickled with its
`SamplingParams` to other processes; `structured.grammar.Grammars` compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .config import MAX_GRAMMAR_BYTES, MAX_JSON_DEPTH

KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark", "structural_tag")
# With `any_whitespace=False` (the default) at most this many whitespace characters separate two JSON
# tokens: `{"a": 1}` and one newline are allowed, a run of newlines is not. Unbounded, SmolLM2 spent a
# whole 60-token answer on newlines for 5 of 24 schema prompts; compact (no whitespace at all) pushed
# it off its trained `": "` form and lost 1 of 24; one character lost none (scripts/structured_check.py).
JSON_MAX_WHITESPACE = 1

# JSON Schema keywords that xgrammar 0.2.9 does not enforce: a grammar built from such a schema lets
# through values the schema forbids (each was probed with a violating value: `[1, 1]` under
# `uniqueItems`, `"a"` under `{"enum": ["a", "b"], "not": {"const": "a"}}`, `3` under
# `{"allOf": [{"type": "integer"}, {"minimum": 5}]}`, ...). `oneOf` is matched as `anyOf` (its
# exclusivity is lost). A strict schema that uses one is refused; otherwise it is best effort.
UNENFORCED_KEYWORDS = frozenset({
    "uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "oneOf", "allOf", "contains", "minContains", "maxContains", "propertyNames", "patternProperties",
    "minProperties", "maxProperties", "unevaluatedItems", "contentSchema", "contentMediaType",
    "contentEncoding", "$dynamicRef", "$recursiveRef"})
# The `format` values xgrammar enforces (others, such as "idn-email" or "iri", accept any string).
ENFORCED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer", "uuid"})
# Keywords whose value is one subschema, a map of name -> subschema, or a list of subschemas.
_SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "not", "if", "then",
              "else", "contains", "propertyNames", "unevaluatedItems", "contentSchema")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def check_json_depth(value, what: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise ValueError naming `what` when `value` (parsed JSON) nests arrays and objects deeper than
    `limit` (the outermost counts 1). Iterative: a value nested 100,000 deep costs no recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            raise ValueError(f"{what} is nested deeper than {limit} levels (the limit, MAX_JSON_DEPTH)")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))


def load_json(text: str, what: str):
    """`json.loads` of a caller's text, with ValueError for what json would raise deep inside (a
    RecursionError for text nested a few thousand deep) and for nesting past `MAX_JSON_DEPTH`."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels (the limit, MAX_JSON_DEPTH)") from None
    except ValueError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    check_json_depth(value, what)
    return value


def _subschemas(node: dict):
    """(keyword path, subschema) of each schema directly inside `node`."""
    for key in _SUBSCHEMA:
        if isinstance(node.get(key), dict):
            yield key, node[key]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from ((f"{key}.{name}", sub) for name, sub in node[key].items() if isinstance(sub, dict))
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from ((f"{key}[{i}]", sub) for i, sub in enumerate(node[key]) if isinstance(sub, dict))


def unenforced_keywords(schema) -> list[str]:
    """The JSON Schema keywords of `schema` (and its subschemas) that the grammar backend does not
    enforce, sorted; `format` values it does not know appear as `format: <value>`."""
    found, stack = set(), [schema] if isinstance(schema, dict) else []
    while stack:
        node = stack.pop()
        found.update(k for k in node if k in UNENFORCED_KEYWORDS)
        fmt = node.get("format")
        if isinstance(fmt, str) and node.get("type", "string") == "string" and fmt not in ENFORCED_FORMATS:
            found.add(f"format: {fmt}")
        stack.extend(sub for _, sub in _subschemas(node))
    return sorted(found)


def check_refs(value, what: str) -> None:
    """Raise ValueError when a `$ref` in `value` points outside the document (only `#...` refs are
    resolved; a remote one would otherwise match any JSON)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
                raise ValueError(f"{what} has a $ref {ref!r} outside the schema: only local references "
                                 "('#/$defs/...') are resolved")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


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
        any_whitespace: with `json` / `json_object` (and the JSON sections of a structural tag built by
            the server), whether any run of whitespace may separate JSON tokens. False (the default): at
            most `JSON_MAX_WHITESPACE` (one) character, so a small model cannot spend its budget on
            newlines.
        strict: with `json`, refuse (ValueError listing them) a schema that uses keywords the grammar
            backend cannot enforce (`UNENFORCED_KEYWORDS`, unknown `format`s); without it such a
            schema is enforced as far as the backend can (best effort).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    lark: str | None = None
    structural_tag: dict | str | None = None
    any_whitespace: bool = False
    strict: bool = False

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
        if not all(isinstance(v, bool) for v in (self.json_object, self.any_whitespace, self.strict)):
            raise TypeError("structured outputs' json_object, any_whitespace and strict must be booleans")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is None:
                continue
            what = f"structured outputs' {name}"
            if isinstance(value, str):
                _check_size(len(value.encode()), what)
                value = load_json(value, what)
            elif isinstance(value, dict):
                check_json_depth(value, what)
                try:
                    text = json.dumps(value)
                except (TypeError, ValueError) as exc:
                    raise TypeError(f"{what} must be JSON-serialisable: {exc}") from None
                _check_size(len(text.encode()), what)
            if not isinstance(value, dict):
                raise TypeError(f"{what} must be a JSON object (a dict or its text), got {type(value).__name__}")
            check_refs(value, what)
            unenforced = unenforced_keywords(value) if name == "json" and self.strict else []
            if unenforced:
                raise ValueError(f"structured outputs' json schema is strict, but the grammar backend cannot "
                                 f"enforce {', '.join(unenforced)}")
        for name in ("regex", "grammar", "lark"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured outputs' {name} must be a non-empty string, got {value!r}")
            if value is not None:
                _check_size(len(value.encode()), f"structured outputs' {name}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise TypeError(f"structured outputs' choice must be a non-empty list of non-empty strings, "
                            f"got {self.choice!r}")
        if self.choice is not None:
            _check_size(sum(len(c.encode()) + 3 for c in self.choice), "structured outputs' choice")

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


def _check_size(num_bytes: int, what: str) -> None:
    if num_bytes > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{what} is {num_bytes} bytes, over the limit of {MAX_GRAMMAR_BYTES} (MAX_GRAMMAR_BYTES)")
