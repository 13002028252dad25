"""Tool calls in the model's own form: the grammar that holds the output to it, and the parser that
reads calls back out of the text, token by token, along the same structure.

A `ToolCallFormat` says how one call is written:

    begin + NAME + between + ARGUMENTS (one JSON object) + end

    hermes       <tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>   (Qwen, Hermes; the default)
    llama3_json  {"name": "NAME", "parameters": {...}}                               (Llama 3.1 / 3.2)
    mistral      [TOOL_CALLS][{"name": "NAME", "arguments": {...}}]                  (Mistral v3 templates)
    mistral_args [TOOL_CALLS]NAME[ARGS]{...}                                          (templates with [ARGS])

`format_for_template` picks it from the chat template. `constraint` builds the xgrammar structural
tag: under "auto", free text and, wherever the format's trigger appears, a call of one of the tools
whose arguments are held to its `parameters` schema (at most one whitespace character between JSON
tokens); under "required" or a named function the grammar starts AT the call (the first token is the
call's opening), so the answer is calls only and its `content` is null, as OpenAI answers.
`ToolCallParser` follows the text through the same parts: free text, a call's opening, the
name, the arguments (a JSON scanner that tracks strings, escapes and nesting, so a `</tool_call>`
inside an argument string is argument text), the close. It yields OpenAI's streaming deltas as the
text arrives: a call's id and name once its name is whole, then its arguments piece by piece. The
non-streamed answer is the same parser run over the whole text, so the streamed arguments join to
exactly the non-streamed ones.

An answer cut short (`finish_reason` "length", or aborted) never shows markup as content: a call whose
name is whole is returned with the arguments it has (finish reason "length"; OpenAI returns such a
truncated call too, and the stream has already sent its name), an opening cut before its name is
whole is dropped, as is a possible opening held back at the end of the text. (vLLM's Hermes parser
returns the whole raw text as content when a call's JSON does not parse; its stream, like this one,
keeps the partial call.)
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..structured_outputs import JSON_MAX_WHITESPACE, StructuredOutputs


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes one tool call: `begin` NAME `between` ARGUMENTS `end`; `trigger` (a prefix of
    `begin`) is what opens a call inside free text."""

    name: str
    trigger: str
    begin: str
    between: str
    end: str
    # The markers that are single special tokens in a tokenizer (the text must keep them to be parsed).
    markers: tuple[str, ...] = ()
    # What goes between two calls when the answer is calls only ("required"): the template's own join.
    separator: str = ""


HERMES = ToolCallFormat("hermes", "<tool_call>", '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>",
                        ("<tool_call>", "</tool_call>"), separator="\n")
LLAMA3_JSON = ToolCallFormat("llama3_json", '{"name": "', '{"name": "', '", "parameters": ', "}", separator="; ")
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", '[TOOL_CALLS][{"name": "', '", "arguments": ', "}]",
                         ("[TOOL_CALLS]",))
MISTRAL_ARGS = ToolCallFormat("mistral_args", "[TOOL_CALLS]", "[TOOL_CALLS]", "[ARGS]", "", ("[TOOL_CALLS]", "[ARGS]"))
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS)}
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
MAX_NAME_CHARS = 64


def format_for_template(template) -> ToolCallFormat:
    """The tool-call form a chat template was trained on: Mistral's `[TOOL_CALLS]`, Hermes/Qwen's
    `<tool_call>`, Llama 3's JSON (a template with the `ipython` role that asks for "parameters");
    Hermes otherwise (a template that knows no tools gets the Hermes system prompt)."""
    source = template if isinstance(template, str) else json.dumps(template) if template else ""
    if "[TOOL_CALLS]" in source:
        return MISTRAL_ARGS if "[ARGS]" in source else MISTRAL
    if "<tool_call>" in source:
        return HERMES
    if "ipython" in source and '"parameters"' in source:
        return LLAMA3_JSON
    return HERMES


def forces_calls(choice) -> bool:
    """Whether `choice` makes the answer tool calls only ("required" or a named function)."""
    return choice == "required" or isinstance(choice, dict)


def constraint(fmt: ToolCallFormat, given: list[dict], choice, parallel: bool) -> StructuredOutputs | None:
    """The structural tag that holds an answer to `fmt`'s calls of the `given` tools under `choice`:
    "none": None; "auto": text, and calls wherever the trigger appears; "required": one call or more
    from the first token on (joined by `fmt.separator`), nothing else; {"name": ...}: that one call and
    nothing else. `parallel` False allows one call at most under every choice (nothing follows it)."""
    if choice == "none":
        return None
    chosen = [t for t in given if not isinstance(choice, dict) or t["function"]["name"] == choice["name"]]
    tags = [{"type": "tag", "begin": fmt.begin + t["function"]["name"] + fmt.between,
             "content": {"type": "json_schema", "json_schema": t["function"]["parameters"],
                         "max_whitespace_cnt": JSON_MAX_WHITESPACE},
             "end": fmt.end} for t in chosen]
    if isinstance(choice, dict):  # a named function: exactly that one call, as OpenAI and vLLM answer it
        return StructuredOutputs(structural_tag={"type": "structural_tag", "format": tags[0]})
    if choice == "required":  # the grammar starts at the call: no text before, between or after calls
        return StructuredOutputs(structural_tag={"type": "structural_tag", "format": {
            "type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
            "at_least_one": True, "stop_after_first": not parallel}})
    return StructuredOutputs(structural_tag={"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags,
        "at_least_one": False, "stop_after_first": not parallel}})


class _JSONScan:
    """Where one JSON object ends, fed a character at a time: nesting, strings and escapes tracked."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False

    def feed(self, ch: str) -> bool:
        """Take one character; True once the object it began is closed."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
            self.started = True
        elif ch in "}]":
            self.depth -= 1
        return self.started and self.depth == 0


class ToolCallParser:
    """Reads one answer's free text and tool calls as the text arrives (see the module docstring).

    `feed(text)` returns OpenAI chat deltas: `{"content": ...}`, a call's opening
    `{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments": ""}}]}`, and
    its argument pieces `{"tool_calls": [{"index", "function": {"arguments": ...}}]}`. Text that may
    still become a call's opening is held back until it is decided; all other text is sent at once.
    `finish(cut)` returns the last deltas; `content` and `calls` then hold the whole answer.

    Args:
        fmt: how the model writes a call.
        calls_only: the grammar allows calls only (`forces_calls`): the text between calls (the
            separator) is no content, and no content delta is sent.
    """

    def __init__(self, fmt: ToolCallFormat, calls_only: bool = False):
        self.fmt = fmt
        self.calls_only = calls_only
        self.state = "text"  # text -> begin -> name -> arguments -> end -> text
        self.pending = ""  # text received, not yet placed
        self.content = ""
        self.calls: list[dict] = []  # {"id", "type": "function", "function": {"name", "arguments"}}
        self._scan = _JSONScan()

    def feed(self, text: str) -> list[dict]:
        self.pending += text
        out: list[dict] = []
        while self.pending and self._advance(out):
            pass
        return out

    def finish(self, cut: bool = False) -> list[dict]:
        """The end of the text. A call cut in its arguments keeps the arguments it has; an opening cut
        before its name is whole is dropped (it is markup, and names no call). Text held back as a
        possible opening is content if the answer ended by itself, dropped if it was `cut` short (a
        "length" or aborted finish)."""
        out: list[dict] = []
        if self.state == "text" and self.pending and not cut:
            self._text(self.pending, out)
        elif self.state == "arguments" and self.pending:
            self._arguments(self.pending, out)
        self.pending = ""
        self.state = "text"
        return out

    # ------------------------------------------------------------------ the states
    def _advance(self, out: list[dict]) -> bool:
        """Place as much of `pending` as can be decided; False when it must wait for more text."""
        fmt, text = self.fmt, self.pending
        if self.state == "text":
            at = text.find(fmt.trigger)
            if at < 0:
                keep = _held_prefix(text, fmt.trigger)
                self._text(text[: len(text) - keep], out)
                self.pending = text[len(text) - keep:]
                return False
            self._text(text[:at], out)
            self.pending, self.state = text[at:], "begin"
            return True
        if self.state == "begin":
            if text.startswith(fmt.begin):
                self.pending, self.state = text[len(fmt.begin):], "name"
                return True
            if fmt.begin.startswith(text):
                return False
            self._text(fmt.trigger, out)  # the trigger was text after all
            self.pending, self.state = text[len(fmt.trigger):], "text"
            return True
        if self.state == "name":
            n = 0
            while n < len(text) and text[n] in _NAME_CHARS:
                n += 1
            rest = text[n:]
            if 0 < n <= MAX_NAME_CHARS and rest.startswith(fmt.between):
                call = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                        "function": {"name": text[:n], "arguments": ""}}
                self.calls.append(call)
                out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                                            "function": {"name": call["function"]["name"], "arguments": ""}}]})
                self.pending, self.state, self._scan = rest[len(fmt.between):], "arguments", _JSONScan()
                return True
            if n <= MAX_NAME_CHARS and fmt.between.startswith(rest):
                return False  # the name, or the text after it, goes on
            self._text(fmt.begin, out)  # not a call: its opening was text
            self.state = "text"
            return True
        if self.state == "arguments":
            for i, ch in enumerate(text):
                if self._scan.feed(ch):
                    self._arguments(text[: i + 1], out)
                    self.pending, self.state = text[i + 1:], "end"
                    return True
            self._arguments(text, out)
            self.pending = ""
            return False
        # "end": the close, after at most a little whitespace the grammar allows
        stripped = text.lstrip()
        if stripped.startswith(fmt.end):
            self.pending, self.state = stripped[len(fmt.end):], "text"
            return True
        if fmt.end.startswith(stripped):
            return False
        self.state = "text"  # an unexpected close: whatever follows is text
        return True

    def _text(self, text: str, out: list[dict]) -> None:
        if text and not self.calls_only:
            self.content += text
            out.append({"content": text})

    def _arguments(self, text: str, out: list[dict]) -> None:
        if text:
            self.calls[-1]["function"]["arguments"] += text
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": text}}]})


def _held_prefix(text: str, trigger: str) -> int:
    """How many characters at the end of `text` could be the start of `trigger`."""
    for n in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-n:]):
            return n
    return 0


def split(text: str, fmt: ToolCallFormat, calls_only: bool = False, cut: bool = False
          ) -> tuple[str | None, list[dict]]:
    """The content and `tool_calls` of a whole answer (`ToolCallParser`'s `calls_only` and `cut`). The
    content is None beside calls when it is only whitespace, and None when all the text was markup."""
    parser = ToolCallParser(fmt, calls_only)
    parser.feed(text)
    parser.finish(cut)
    if not parser.calls:
        return (parser.content if parser.content or not text else None), []
    return parser.content.strip() or None, parser.calls
