"""The grammar backend (xgrammar, the `structured` extra): compile, match, mask.

* `Grammars`: one per engine (its tokenizer, the model's logits width and end-of-sequence ids);
  compiles each distinct `StructuredOutputs` once and caches it (a JSON schema takes a few ms, a regex
  under one).
* `GrammarState`: one request's matcher. The engine advances it only when it commits tokens, all of
  them or none (`accept`), so a step that fails leaves no trace in it; a draft is checked against it
  before verification (`valid_prefix`).
* `GrammarMasks.apply`: one step's token bitmask for every constrained row (each request's next
  position, and each draft position of a verify row), filled in one batched call and applied to the
  logits in one pass: masked tokens become -inf.

A grammar that is complete allows only the end-of-sequence tokens, so a constrained request ends when
its output is whole.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import numpy as np
import torch

from ..optional import require
from ..structured_outputs import StructuredOutputs

_LOG_PREFIX = re.compile(r"\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's "[hh:mm:ss] file.cc:94: " before a reason
MAX_CACHED_GRAMMARS = 512  # compiled grammars kept per engine (least recently used evicted first)


def xgrammar():
    return require("xgrammar", "structured", "structured outputs")


class Grammars:
    """Compiles and caches the constraints of one engine's requests.

    Args:
        tokenizer: the engine's transformers tokenizer.
        vocab_size: the model's logits width (ids past the tokenizer's are never allowed).
        stop_token_ids: the ids that end a request (a complete grammar allows only these).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        xgr = xgrammar()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # cached here, by `StructuredOutputs.key`
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()  # intake threads compile concurrently
        self.num_compiled = 0

    def state(self, spec: StructuredOutputs) -> "GrammarState":
        """A fresh matcher for `spec` (compiled on first use). Raises ValueError naming the problem when
        the schema, regex or grammar does not compile."""
        return GrammarState(self.compile(spec))

    def compile(self, spec: StructuredOutputs):
        spec.validate()
        key = spec.key()
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        try:
            compiled = self._compile(spec)
        except RuntimeError as exc:  # xgrammar's errors for a bad schema, regex or grammar
            reason = _LOG_PREFIX.sub("", str(exc)).strip()
            raise ValueError(f"structured outputs: the {spec.kind} does not compile: {reason}") from None
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs):
        c, kind = self._compiler, spec.kind
        if kind == "json":
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return c.compile_json_schema(schema, any_whitespace=spec.any_whitespace, strict_mode=True,
                                         **({} if spec.any_whitespace else {"separators": (",", ":")}))
        if kind == "json_object":
            if spec.any_whitespace:
                return c.compile_builtin_json_grammar()
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "choice":  # an EBNF alternation of string literals (JSON escapes are EBNF's)
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in spec.choice))
        if kind == "grammar":
            return c.compile_grammar(spec.grammar)
        if kind == "lark":
            return c.compile_lark(spec.lark)
        tag = spec.structural_tag if isinstance(spec.structural_tag, str) else json.dumps(spec.structural_tag)
        return c.compile_structural_tag(tag)


class GrammarState:
    """One request's position in its grammar. Used by one thread at a time (the engine's step)."""

    def __init__(self, compiled):
        self.compiled = compiled
        self.matcher = xgrammar().GrammarMatcher(compiled)

    def fresh(self) -> "GrammarState":
        """A matcher at the start of the same grammar (another sample of the request)."""
        return GrammarState(self.compiled)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token_ids) -> bool:
        """Advance by `token_ids`, all of them or none: False (and no change) if the grammar rejects one."""
        m = self.matcher
        for i, token in enumerate(token_ids):
            if not m.accept_token(int(token)):
                if i:
                    m.rollback(i)
                return False
        return True

    def advance(self, token_ids) -> int:
        """Accept `token_ids` up to the first the grammar rejects (or its end); how many it took. The
        caller rolls them back (`matcher.rollback`)."""
        m, n = self.matcher, 0
        for token in token_ids:
            if m.is_terminated() or not m.accept_token(int(token)):
                break
            n += 1
        return n

    def valid_prefix(self, token_ids) -> int:
        """How many of `token_ids` (a draft) the grammar accepts in a row; the state is unchanged."""
        n = self.advance(token_ids)
        if n:
            self.matcher.rollback(n)
        return n


class GrammarMasks:
    """Applies a step's grammar masks; owns the reused bitmask buffer (one per sampler)."""

    def __init__(self):
        self._buffer = None  # int32 [rows, ceil(vocab / 32)], on the CPU
        self._batch = xgrammar().BatchGrammarMatcher(max_threads=1)  # a fill is ~µs a row: no threads

    def _bitmask(self, num_rows: int, vocab: int) -> torch.Tensor:
        width = (vocab + 31) // 32
        if self._buffer is None or self._buffer.shape[0] < num_rows or self._buffer.shape[1] != width:
            self._buffer = xgrammar().allocate_token_bitmask(max(num_rows, 8), vocab)
        out = self._buffer[:num_rows]
        out.fill_(-1)  # every token allowed
        return out

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, GrammarState, tuple[int, ...]]]) -> None:
        """Mask `logits` in place for the constrained `rows`: (logits row, the request's grammar state,
        the draft tokens before this position). The plain rows' masks are filled by one batched call (a
        verify row's by accepting its drafts on the matcher and rolling them back), and every mask is
        applied in one pass.

        logits: [num_rows, vocab] fp32, on any device.
        """
        vocab = logits.shape[-1]
        bitmask = self._bitmask(logits.shape[0], vocab)  # [num_rows, ceil(vocab / 32)] int32
        plain, plain_rows, masked = [], [], []
        for row, state, extra in rows:
            matcher = state.matcher
            if not extra:
                if not matcher.is_terminated():  # a terminated matcher has no next token (its request ended)
                    plain.append(matcher)
                    plain_rows.append(row)
                    masked.append(row)
                continue
            # A draft position: the mask after the drafts before it. A draft the grammar rejects makes
            # the rows after it moot (verification stops there); they keep the last valid state's mask.
            n = state.advance(extra)
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row)
                masked.append(row)
            if n:
                matcher.rollback(n)
        if plain:
            self._batch.batch_fill_next_token_bitmask(plain, bitmask, indices=plain_rows)
        if not masked:
            return
        if logits.device.type == "cpu":
            # xgrammar's CPU kernel is single-threaded at ~0.1 ms a row; unpacking with torch measures
            # ~3x faster at 64 rows of 49k.
            _apply_torch(logits, bitmask, masked)
        else:
            xgrammar().apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                                   indices=masked, vocab_size=vocab)


def _apply_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits[rows, j] = -inf where bit j of bitmask[rows] is 0. logits: [n, vocab] fp32 CPU;
    bitmask: [n, ceil(vocab / 32)] int32 CPU. Bits unpack with numpy (little-endian words, so byte k
    of a row holds its tokens 8k..8k+7); 64 x 49k rows take ~4 ms, ~2.5x xgrammar's CPU kernel."""
    vocab = logits.shape[-1]
    whole = len(rows) == logits.shape[0]
    index = None if whole else torch.tensor(rows, dtype=torch.long)
    bits = bitmask if whole else bitmask.index_select(0, index)
    allowed = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]  # [r, vocab] 0/1
    banned = torch.from_numpy(allowed).view(torch.bool).logical_not_()
    if whole:
        logits.masked_fill_(banned, float("-inf"))
    else:
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, float("-inf")))
