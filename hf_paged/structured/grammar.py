"""The grammar backend (xgrammar, the `structured` extra): compile, match, mask.

* `Grammars`: one per engine (its tokenizer, the model's logits width and end-of-sequence ids);
  compiles each distinct `StructuredOutputs` once, on its own compile threads within a time limit, and
  keeps the compiled grammars up to a byte budget (a JSON schema takes a few ms, a regex under one; a
  10,000-value enum up to a second and ~30 MiB).
* `GrammarState`: one request's matcher. The engine advances it only when it commits tokens, all of
  them or none (`accept`), so a step that fails leaves no trace in it; a draft is checked against it
  before verification (`valid_prefix`).
* `GrammarMasks.apply`: one step's token bitmask for every constrained row (each request's next
  position, and each draft position of a verify row), filled in one batched call and applied to the
  logits in one pass: masked tokens become -inf. A request whose fills take longer than the per-step
  budget (an ambiguous grammar's grow with its output) is flagged (`GrammarState.error`); the engine
  ends it when it commits the step, so it cannot slow the requests batched with it for long.

A grammar that is complete allows only the end-of-sequence tokens, so a constrained request ends when
its output is whole.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections import OrderedDict, deque

import numpy as np
import torch

from ..config import DEFAULT_GRAMMAR_CACHE_BYTES, DEFAULT_GRAMMAR_COMPILE_TIMEOUT_SECONDS
from ..optional import require
from ..structured_outputs import JSON_MAX_WHITESPACE, StructuredOutputs

_LOG_PREFIX = re.compile(r"\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's "[hh:mm:ss] file.cc:94: " before a reason
# Compiles run on at most MAX_CONCURRENT_COMPILES threads of an engine (one compile per distinct
# constraint: equal ones wait for the same), and at most MAX_PENDING_COMPILES run or wait to (more are
# refused at once). A compile past its time limit cannot be interrupted (xgrammar's C++ runs to its
# end): it finishes in the background on its thread, holding it. These two bounds keep such compiles
# from piling up (threads, CPU, memory); a queued compile whose requests all gave up never starts.
MAX_CONCURRENT_COMPILES = 2
MAX_PENDING_COMPILES = 32
# Compile threads (and the workers xgrammar starts from them) run at this nice value (Linux): they take
# the CPU the engine leaves. At equal priority on 2 cores, a plain 8-token request took 6-13 s instead
# of 0.5 s beside one compile (torch's threads waiting on each other); at 19, 0.65 s. Beside a CPU
# engine that keeps both cores busy, a compile is then slower (a 1.2 s schema took 18 s).
COMPILE_NICENESS = 19
# A constraint whose compile ran past the time limit is remembered (by digest, at most
# MAX_REMEMBERED_SLOW) and refused at once for REMEMBER_SLOW_SECONDS: its compile is not repeated for
# each retry, and one that was only starved of the CPU (see above) is tried again later.
MAX_REMEMBERED_SLOW = 4096
REMEMBER_SLOW_SECONDS = 600.0
# What a compiled grammar costs the process, per byte xgrammar reports (`memory_size_bytes`): with 50
# distinct 10,000-value enums through one engine, RSS settled at 2.4-2.6x the reported bytes the cache
# kept (compile transients, and the heap keeps part of what an eviction frees). Counted at 3x, RSS stays
# within the budget (benchmarks/grammar_limits.py).
MEMORY_OVERHEAD = 3.0
# A request's masks may be over the per-step budget in this many steps (first fills can be slow while
# xgrammar's caches warm); its next step over the budget ends it.
SLOW_MASK_STEPS_ALLOWED = 2


def xgrammar():
    return require("xgrammar", "structured", "structured outputs")


class Grammars:
    """Compiles and keeps the constraints of one engine's requests.

    A constraint compiles on one of `MAX_CONCURRENT_COMPILES` compile threads, never on the caller's
    (`submit`; `compile` waits for it). Compiled grammars are kept for reuse up to `cache_bytes`
    (`CompiledGrammar.memory_size_bytes` x `MEMORY_OVERHEAD`), least recently used evicted first; one larger than the whole
    budget serves its requests and is not kept.

    Args:
        tokenizer: the engine's transformers tokenizer.
        vocab_size: the model's logits width (ids past the tokenizer's are never allowed).
        stop_token_ids: the ids that end a request (a complete grammar allows only these).
        cache_bytes: the compiled grammars kept, in bytes (0 keeps none).
        compile_timeout_seconds: a request waits this long for its grammar, then fails with a
            ValueError naming the limit; a constraint whose compile ran longer is then refused at once
            for `REMEMBER_SLOW_SECONDS` (None: no limit).
        mask_budget_seconds: each request's mask fills may take this long per step (its
            `GrammarState`'s budget, see `GrammarMasks.apply`); None: no budget (stock `generate`'s
            `GrammarLogitsProcessor` has no way to end one row).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                 cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
                 compile_timeout_seconds: float | None = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_SECONDS,
                 mask_budget_seconds: float | None = None):
        xgr = xgrammar()
        self.vocab_size = vocab_size
        self.cache_bytes = cache_bytes
        self.compile_timeout_seconds = compile_timeout_seconds
        self.mask_budget_seconds = mask_budget_seconds
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # cached here, by `StructuredOutputs.key`
        self._cache: OrderedDict[tuple, tuple[object, int]] = OrderedDict()  # key -> (compiled, its bytes)
        self.cached_bytes = 0
        self._jobs: dict[tuple, _Job] = {}  # compiles running or queued, by key
        self._queue: deque[_Job] = deque()  # those queued, in arrival order
        self._num_running = 0
        self._too_slow: OrderedDict[bytes, float] = OrderedDict()  # digest of a too slow key -> when
        self._lock = threading.Lock()  # all of the above: intake threads, compile threads, event loops
        self.num_compiled = 0

    def state(self, spec: StructuredOutputs, compiled=None) -> "GrammarState":
        """A fresh matcher for `spec` (compiled on first use, unless `compiled`: its grammar from
        `submit`). Raises ValueError naming the problem when the schema, regex or grammar does not
        compile, or not within the time limit."""
        return GrammarState(compiled if compiled is not None else self.compile(spec), self.mask_budget_seconds)

    def compile(self, spec: StructuredOutputs):
        """`spec`'s compiled grammar, waiting for it at most the time limit (see `submit`)."""
        return self.submit(spec).result()

    @property
    def num_compiling(self) -> int:
        """Compiles running or queued (a compile past its time limit runs until it ends)."""
        with self._lock:
            return len(self._jobs)

    def submit(self, spec: StructuredOutputs) -> "Compiling":
        """Start compiling `spec` (or join its compile under way, or take it from the cache); wait with
        `Compiling.result` or `result_async`.

        Raises:
            ValueError/TypeError: a malformed constraint; one whose compile ran past the time limit
                before; or `MAX_PENDING_COMPILES` compiles already running or queued.
        """
        spec.validate()
        key = spec.key()
        with self._lock:
            if self._is_remembered_slow(key):
                raise self._too_slow_error(spec.kind)
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return Compiling(self, spec.kind, compiled=hit[0])
            job = self._jobs.get(key)
            if job is not None and self._is_overdue(job):
                self._remember_slow(key)
                raise self._too_slow_error(spec.kind)
            if job is None:
                if len(self._jobs) >= MAX_PENDING_COMPILES:
                    raise ValueError(f"structured outputs: {len(self._jobs)} grammars are compiling or waiting "
                                     "to (the most an engine queues); try again later")
                job = self._jobs[key] = _Job(key, spec)
                self._queue.append(job)
            job.num_waiting += 1
            self._start_compiles()
        return Compiling(self, spec.kind, job=job)

    def _start_compiles(self) -> None:
        """Start queued compiles on free compile threads (under `_lock`)."""
        while self._queue and self._num_running < MAX_CONCURRENT_COMPILES:
            job = self._queue.popleft()
            job.started = time.monotonic()
            self._num_running += 1
            threading.Thread(target=self._run, args=(job,), name="hf_paged-grammar-compile", daemon=True).start()

    def _run(self, job: "_Job") -> None:
        """A compile thread: compile, keep the result (unless it took longer than the limit: that
        constraint is then refused at once for a while), start the next queued compile, then hand the
        result over."""
        _yield_the_cpu()
        try:
            compiled, error = self._compile_checked(job.spec), None
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            compiled, error = None, exc
        with self._lock:
            self._num_running -= 1
            del self._jobs[job.key]
            if compiled is not None:
                if self._is_overdue(job):
                    self._remember_slow(job.key)
                else:
                    self.num_compiled += 1
                    self._keep(job.key, compiled)
            self._start_compiles()
        if error is not None:
            job.future.set_exception(error)
        else:  # a waiter that joined late, within its own limit, still gets it
            job.future.set_result(compiled)

    def _compile_checked(self, spec: StructuredOutputs):
        try:
            return self._compile(spec)
        except RuntimeError as exc:  # xgrammar's errors for a bad schema, regex or grammar
            reason = _LOG_PREFIX.sub("", str(exc)).strip()
            raise ValueError(f"structured outputs: the {spec.kind} does not compile: {reason}") from None

    def _keep(self, key: tuple, compiled) -> None:
        """Cache `compiled`, evicting the least recently used past the byte budget (under `_lock`)."""
        size = int(compiled.memory_size_bytes * MEMORY_OVERHEAD)
        if size > self.cache_bytes:
            return  # it serves the requests that asked for it, and goes with them
        old = self._cache.pop(key, None)
        self.cached_bytes += size - (old[1] if old is not None else 0)
        self._cache[key] = (compiled, size)
        while self.cached_bytes > self.cache_bytes:
            _, (_, evicted) = self._cache.popitem(last=False)
            self.cached_bytes -= evicted

    def leave(self, job: "_Job") -> None:
        """A waiter of `job` is done (`Compiling`: its result, or it gave up): a queued compile nobody
        waits for any more is dropped."""
        with self._lock:
            job.num_waiting -= 1
            if not job.num_waiting and job.started is None and self._jobs.get(job.key) is job:
                self._queue.remove(job)
                del self._jobs[job.key]

    def timed_out(self, job: "_Job", kind: str) -> ValueError:
        """A waiter of `job` gave up at the time limit (`Compiling`): the error it raises. If the compile
        itself ran that long, its constraint is refused at once for `REMEMBER_SLOW_SECONDS`."""
        with self._lock:
            if self._is_overdue(job):
                self._remember_slow(job.key)
            return self._timeout_error(kind, job.started is not None)

    def _is_overdue(self, job: "_Job") -> bool:
        limit = self.compile_timeout_seconds
        return limit is not None and job.started is not None and time.monotonic() - job.started >= limit

    def _is_remembered_slow(self, key: tuple) -> bool:
        if not self._too_slow:
            return False
        digest = _digest(key)
        when = self._too_slow.get(digest)
        if when is not None and time.monotonic() - when >= REMEMBER_SLOW_SECONDS:
            del self._too_slow[digest]
            return False
        return when is not None

    def _remember_slow(self, key: tuple) -> None:
        digest = _digest(key)
        self._too_slow[digest] = time.monotonic()
        self._too_slow.move_to_end(digest)
        while len(self._too_slow) > MAX_REMEMBERED_SLOW:
            self._too_slow.popitem(last=False)

    def _timeout_error(self, kind: str, started: bool) -> ValueError:
        busy = "" if started else (f"; it waited for one of the {MAX_CONCURRENT_COMPILES} compile threads, "
                                   "busy with other grammars")
        return ValueError(f"structured outputs: the {kind} did not compile within "
                          f"{self.compile_timeout_seconds:g} s (grammar_compile_timeout_seconds){busy}")

    def _too_slow_error(self, kind: str) -> ValueError:
        return ValueError(f"structured outputs: the {kind} did not compile within {self.compile_timeout_seconds:g} s "
                          f"(grammar_compile_timeout_seconds) when it was last tried; it is refused at once for "
                          f"{REMEMBER_SLOW_SECONDS:g} s after that")

    def _compile(self, spec: StructuredOutputs):
        c, kind = self._compiler, spec.kind
        if kind in ("json", "json_object"):
            # json_object: any object (a schema without properties leaves them free, strict mode or not).
            schema = '{"type": "object"}' if kind == "json_object" else (
                spec.json if isinstance(spec.json, str) else json.dumps(spec.json))
            if spec.any_whitespace:
                return c.compile_json_schema(schema, any_whitespace=True, strict_mode=True)
            return c.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE,
                                         strict_mode=True)
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


class _Job:
    """One constraint's compile: queued (`started` None), then running on a compile thread."""

    def __init__(self, key: tuple, spec: StructuredOutputs):
        self.key, self.spec = key, spec
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.started: float | None = None  # time.monotonic() when its thread took it
        self.num_waiting = 0  # requests waiting for it (under `Grammars._lock`)


class Compiling:
    """A constraint's compile from `Grammars.submit`, waited for once, by a blocking `result()` or an
    awaited `result_async()`: each returns the compiled grammar, or raises the ValueError of a grammar
    that does not compile, or not within the time limit (counted from `submit`)."""

    def __init__(self, grammars: Grammars, kind: str, job: _Job | None = None, compiled=None):
        self._grammars, self._kind, self._job, self._compiled = grammars, kind, job, compiled
        limit = grammars.compile_timeout_seconds
        self._deadline = None if limit is None else time.monotonic() + limit

    def result(self):
        if self._job is None:
            return self._compiled
        try:
            return self._job.future.result(self._remaining())
        except concurrent.futures.TimeoutError:
            raise self._grammars.timed_out(self._job, self._kind) from None
        finally:
            self._grammars.leave(self._job)

    async def result_async(self):
        """`result()` for a coroutine: the event loop is never blocked."""
        if self._job is None:
            return self._compiled
        try:
            # shield: giving up (a timeout, or its caller cancelled) leaves the compile to the others
            # waiting for it, and to the cache.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._job.future)), self._remaining())
        except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11 on
            raise self._grammars.timed_out(self._job, self._kind) from None
        finally:
            self._grammars.leave(self._job)

    def _remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


def _digest(key: tuple) -> bytes:
    return hashlib.sha256(repr(key).encode()).digest()


def _yield_the_cpu() -> None:
    """Lower this thread's CPU priority to `COMPILE_NICENESS` (Linux, where a nice value is a thread's
    own and the threads it starts inherit it; elsewhere the thread keeps its priority)."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
        except OSError:
            pass


class GrammarState:
    """One request's position in its grammar. Used by one thread at a time (the engine's step).

    Attributes:
        mask_budget_seconds: how long its mask fills may take per step (None: no budget).
        error: set when its fills were over the budget in more than `SLOW_MASK_STEPS_ALLOWED` steps:
            why its request must end (the engine ends it with this when it commits the step).
    """

    def __init__(self, compiled, mask_budget_seconds: float | None = None):
        self.compiled = compiled
        self.matcher = xgrammar().GrammarMatcher(compiled)
        self.mask_budget_seconds = mask_budget_seconds
        self.num_slow_masks = 0
        self.error: str | None = None

    def fresh(self) -> "GrammarState":
        """A matcher at the start of the same grammar (another sample of the request)."""
        return GrammarState(self.compiled, self.mask_budget_seconds)

    def note_mask_seconds(self, seconds: float) -> None:
        """Charge one step's mask fills; past the budget too often, set `error`."""
        budget = self.mask_budget_seconds
        if budget is None or seconds <= budget or self.error is not None:
            return
        self.num_slow_masks += 1
        if self.num_slow_masks > SLOW_MASK_STEPS_ALLOWED:
            self.error = (f"structured outputs: the grammar's token mask took {seconds * 1e3:.0f} ms, over the "
                          f"{budget * 1e3:g} ms budget per step (grammar_mask_budget_seconds)")

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

        Each state with a budget is charged its fills (`GrammarState.note_mask_seconds`): a verify
        row's as it is filled; a plain row's only when the batched call took longer than the budget,
        by filling each plain row again on its own (the normal path times one call). A state already
        flagged (`error`) gets no mask: its request ends with this step, its token unused.

        logits: [num_rows, vocab] fp32, on any device.
        """
        vocab = logits.shape[-1]
        bitmask = self._bitmask(logits.shape[0], vocab)  # [num_rows, ceil(vocab / 32)] int32
        plain, plain_rows, masked = [], [], []
        spent: dict[GrammarState, float] = {}  # seconds of fills per state, where measured
        for row, state, extra in rows:
            matcher = state.matcher
            if state.error is not None:
                continue
            if not extra:
                if not matcher.is_terminated():  # a terminated matcher has no next token (its request ended)
                    plain.append(state)
                    plain_rows.append(row)
                    masked.append(row)
                continue
            # A draft position: the mask after the drafts before it. A draft the grammar rejects makes
            # the rows after it moot (verification stops there); they keep the last valid state's mask.
            began = time.perf_counter()
            n = state.advance(extra)
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row)
                masked.append(row)
            if n:
                matcher.rollback(n)
            spent[state] = spent.get(state, 0.0) + time.perf_counter() - began
        if plain:
            began = time.perf_counter()
            self._batch.batch_fill_next_token_bitmask([s.matcher for s in plain], bitmask, indices=plain_rows)
            elapsed = time.perf_counter() - began
            budget = min((s.mask_budget_seconds for s in plain if s.mask_budget_seconds is not None), default=None)
            if budget is not None and elapsed > budget:
                self._time_each(plain, plain_rows, bitmask, elapsed, spent)
        for state, seconds in spent.items():
            state.note_mask_seconds(seconds)
        if not masked:
            return
        if logits.device.type == "cpu":
            # xgrammar's CPU kernel is single-threaded at ~0.1 ms a row; unpacking with torch measures
            # ~3x faster at 64 rows of 49k.
            _apply_torch(logits, bitmask, masked)
        else:
            xgrammar().apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                                   indices=masked, vocab_size=vocab)

    @staticmethod
    def _time_each(states: list[GrammarState], rows: list[int], bitmask: torch.Tensor, elapsed: float,
                   spent: dict) -> None:
        """The batched fill of `states` took `elapsed`, over a budget: which of them took it? Each fills
        its row again (the same mask), timed on its own."""
        if len(states) == 1:
            spent[states[0]] = spent.get(states[0], 0.0) + elapsed
            return
        for state, row in zip(states, rows):
            began = time.perf_counter()
            state.matcher.fill_next_token_bitmask(bitmask, row)
            spent[state] = spent.get(state, 0.0) + time.perf_counter() - began


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
