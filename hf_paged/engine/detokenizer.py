"""Incremental detokenizing: one generated token id in, the text that is now safe to show out.

`IncrementalDetokenizer` turns a request's generated ids into stream deltas that never hold half a
character, and cuts the text before a stop string without ever showing a part of it. Each `add()`
decodes a small window of ids and scans only the new text, so a token costs the same at position
10 and at position 10,000. Torch-free: it needs only a Hugging Face tokenizer's `decode`.

How a token becomes text (the prefix/read-offset scheme of vLLM and `TextStreamer`)::

    ids:     ... p p p | r r | n n n        p: context, already shown    r, n: not shown yet
                       ^ prefix_offset        ^ read_offset
    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    new_text[len(prefix_text):] is shown once new_text ends in a whole character,
    then prefix_offset = read_offset and read_offset = len(ids).

The context tokens keep spaces right: SentencePiece (Metaspace) decoders drop the leading space of
the first token they decode, so a token is always decoded after the one before it, and the first
generated token after the last prompt tokens.

How text becomes a delta (stop strings, `StopStringMatcher`)::

    decoded text:  "... shown text ... | held |"    held: the longest suffix that is a proper
                                                    prefix of some stop string ("Hel" for "Hello")

The held tail is shown as soon as the next text rules the stop string out, or by `finish()`. Each
new character is fed once to a KMP automaton per stop string, so the check is linear in the text
and in the stop strings' length, however long or self-overlapping they are ("aaaa", "abab...abx").
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the first generated token (vLLM uses 5 as well).
NUM_PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, and byte-level tokens carry at least one each, so a text
# that still ends in an unfinished character after this many pending tokens holds invalid bytes.
# They are then shown as '\ufffd', which keeps the decoded window (the cost of add()) bounded.
MAX_PENDING_TOKENS = 8


def find_stop_string(text: str, stop_strings: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Finds the stop string that is complete first in `text[start:]`.

    "First" is the match that ends earliest (for equal ends, the longer one), which is what
    reading the text one character at a time would see, so the result depends on the text only,
    not on how tokens split it.

    Args:
        text: the text to search.
        stop_strings: non-empty stop strings.
        start: index of `text` where a match may begin at the earliest.

    Returns:
        `(index, stop_string)` of the match, `index` being where it starts in `text`, or None.
    """
    best: tuple[int, int, str] | None = None  # (end, -length, stop) orders by end, then longest
    for stop in stop_strings:
        index = text.find(stop, start)
        if index >= 0:
            key = (index + len(stop), -len(stop), stop)
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else (best[0] + best[1], best[2])


def _prefix_function(s: str) -> array:
    """KMP's prefix function: entry i is the length of the longest proper prefix of `s[:i + 1]`
    that is also its suffix. O(len(s)) time, 4 bytes per character."""
    border = array("i", [0]) * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[k] != s[i]:
            k = border[k - 1]
        if s[k] == s[i]:
            k += 1
        border[i] = k
    return border


class StopStringMatcher:
    """Cuts a text that arrives in pieces before its first stop string, holding back what may become one.

    Keeps one KMP automaton per stop string: its state is the length of the longest prefix of the stop
    string that ends the text pushed so far, and a stop string matches when its state reaches its
    length. The held tail is the longest state's prefix, so it is a slice of a stop string, never
    stored::

        pushed:  "... shown ... |aba|"    stops "abab" (state 3) and "aab" (state 1): "aba" is held
        pushed:  "x"                      both states fall to 0: "abax" is shown

    Costs O(total stop length) time and memory to build, and amortised O(1) per pushed character and
    stop string (each character is pushed once; a state falls back at most as often as it rose).
    The first match is `find_stop_string`'s: the one that ends first, for equal ends the longer.

    Args:
        stop_strings: non-empty stop strings.
    """

    def __init__(self, stop_strings: Sequence[str]):
        self.stop_strings = tuple(stop_strings)
        self.stop_hit: str | None = None  # the stop string that matched
        self._borders = [_prefix_function(s) for s in self.stop_strings]
        self._states = [0] * len(self.stop_strings)
        self._held_index = 0  # the held tail is stop_strings[_held_index][:_num_held]
        self._num_held = 0

    def push(self, text: str) -> str:
        """Appends `text`; returns the part now safe to show: the text before the held tail, or
        before the stop string once one matches (`stop_hit` is then set, and later pushes return "")."""
        if self.stop_hit is not None:
            return ""
        held_stop, num_held = self.stop_strings[self._held_index], self._num_held
        match = self._advance(text)
        if match is None:
            self._held_index = max(range(len(self._states)), key=self._states.__getitem__)
            self._num_held = self._states[self._held_index]
            num_shown = num_held + len(text) - self._num_held
        else:
            end, self.stop_hit = match
            num_shown = num_held + end - len(self.stop_hit)  # >= 0: a match begins in held + text
            self._num_held = 0
        # The first num_shown characters of held + text, without copying what stays held.
        return held_stop[: min(num_shown, num_held)] + text[: max(num_shown - num_held, 0)]

    def flush(self) -> str:
        """Ends the text: returns the held tail ("" after a match), which can no longer become a stop string."""
        held = self.stop_strings[self._held_index][: self._num_held]
        self._states = [0] * len(self._states)
        self._num_held = 0
        return held

    def _advance(self, text: str) -> tuple[int, str] | None:
        """Feeds `text` to every automaton; returns `(end, stop)` of the first match, `end` being the
        index in `text` right after it, or None."""
        first: tuple[int, str] | None = None
        for j, stop in enumerate(self.stop_strings):
            state = self._states[j]
            if not state and stop[0] not in text:
                continue  # the common case, at C speed: the state stays 0
            border = self._borders[j]
            for end, char in enumerate(text, 1):
                while state and stop[state] != char:
                    state = border[state - 1]
                if stop[state] == char:
                    state += 1
                    if state == len(stop):  # this stop's first match in text
                        if first is None or (end, -len(stop)) < (first[0], -len(first[1])):
                            first = (end, stop)
                        break
            self._states[j] = state
        return first


class IncrementalDetokenizer:
    """Streams one request's generated tokens as text deltas, and cuts it at a stop string.

    Guarantees:

    * No delta holds '\\ufffd' for a character whose bytes are still arriving. The character
      shows once complete; bytes that never complete (the model produced invalid UTF-8) show as
      '\\ufffd' once followed by other text, after `MAX_PENDING_TOKENS` tokens, or at `finish()`.
    * The deltas returned by `add()` and `finish()` join to `text`, at every moment.
    * Text that may still become a stop string is held back, and shown as soon as it cannot.
      Once a stop string is complete, `text` ends right before it; neither it nor anything after
      it is ever shown, and `add()` raises (`stop_hit` tells the caller to stop generating).
    * Each `add()` makes at most two `decode` calls, on a window of the last shown step's tokens
      (the prompt context at first) and the pending ones: for valid UTF-8 at most
      `NUM_PROMPT_CONTEXT_TOKENS + 4` ids, and never more than `2 * (MAX_PENDING_TOKENS + 1)`.
      The stop-string check feeds each new character once to `StopStringMatcher`: amortised
      O(1) per character and stop string, and O(total stop length) memory and set-up.

    After `finish()`, `text` equals `tokenizer.decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)` cut before the stop string, for byte-level BPE tokenizers
    (GPT-2 style, as SmolLM2's), where decoding concatenates bytes, so a window decoded on its own
    gives the same characters as the same ids inside a full decode. Two departures, both deliberate:

    * Tokenization-space cleanup (" ." -> ".") is never applied: it rewrites text across token
      boundaries, so it cannot be streamed. transformers 5 skips it for BPE tokenizers anyway, so
      for those plain `decode(ids)` is matched too.
    * SentencePiece (Metaspace) tokenizers: `decode(ids)` drops the first output token's leading
      space; here the prompt context keeps it, as it appears after the prompt.

    Special tokens the tokenizer skips with `skip_special_tokens=True` are left out of the window
    altogether; with `skip_special_tokens=False` they show as their text (`"<|im_end|>"`).

    Args:
        tokenizer: a Hugging Face tokenizer (only `decode`, `all_special_ids` and
            `added_tokens_decoder` are used).
        prompt_token_ids: the prompt; its last `NUM_PROMPT_CONTEXT_TOKENS` ids are context only.
        skip_special_tokens: as in `tokenizer.decode`.
        stop_strings: strings that end the output; the text is cut before the first to complete
            (see `find_stop_string`). Duplicates are ignored.

    Raises:
        TypeError: if `stop_strings` is one string rather than a list of them.
        ValueError: if a stop string is empty.

    Example::

        detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop_strings=["\\n\\n"])
        for token_id in generated:
            print(detok.add(token_id), end="")
            if detok.stop_hit:
                break
        print(detok.finish())
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop_strings: Iterable[str] = (),
    ):
        if isinstance(stop_strings, str):
            raise TypeError("stop_strings must be a list of strings, not one string")
        stops = tuple(dict.fromkeys(stop_strings))
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stops!r}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_kwargs: dict | None = None
        self.stop_strings = stops
        self._stops = StopStringMatcher(stops) if stops else None
        self._skipped = self._skipped_ids() if skip_special_tokens else frozenset()

        context = [int(t) for t in prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:]]
        context = [t for t in context if t not in self._skipped]
        context_text = self._decode(context) if context else ""
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: its tail would swallow the output's first bytes.
            context, context_text = [], ""
        self._window: list[int] = context  # ids[prefix_offset:]
        self._read_offset = len(context)  # in the window
        self._prefix_text = context_text  # decode(window[:read_offset])

        self._chunks: list[str] = []  # the deltas shown so far
        self._stop_hit: str | None = None
        self._is_finished = False

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stop_hit

    @property
    def is_finished(self) -> bool:
        """Whether `finish()` was called."""
        return self._is_finished

    @property
    def text(self) -> str:
        """The text shown so far: all deltas joined (cut before the stop string once matched)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        """Appends one generated token.

        Args:
            token_id: the token.

        Returns:
            The text that is now safe to show; "" while a character or a possible stop string is
            incomplete.

        Raises:
            RuntimeError: after a stop string was matched or `finish()` was called.
        """
        if self._stop_hit is not None:
            raise RuntimeError(f"stop string {self._stop_hit!r} already matched; stop adding tokens")
        if self._is_finished:
            raise RuntimeError("add() after finish()")
        token_id = int(token_id)
        if token_id in self._skipped:
            return ""  # decode would drop it; keeping it would only widen the window
        self._window.append(token_id)
        new_text = self._decode(self._window)
        num_pending = len(self._window) - self._read_offset
        is_complete = len(new_text) > len(self._prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)
        if not is_complete and num_pending <= MAX_PENDING_TOKENS:
            return ""  # the bytes of a character are still arriving
        if not is_complete:  # too long pending: show what no character split can change, keep the rest
            return self._push(self._advance_to(self._last_whole_cut(new_text), new_text))
        return self._push(self._advance(new_text))

    def _last_whole_cut(self, new_text: str) -> int:
        """The last token boundary of the pending tokens whose decoded prefix is a prefix of `new_text`:
        no character is split there. A '\ufffd' ending the text may be a real one (a token for U+FFFD)
        or the bytes of an unfinished character; only the latter change once more tokens come."""
        for cut in range(len(self._window) - 1, self._read_offset, -1):
            if new_text.startswith(self._decode(self._window[:cut])):
                return cut
        return len(self._window)

    def _advance_to(self, cut: int, new_text: str) -> str:
        """Takes the text of the window's first `cut` tokens; the tokens after stay pending."""
        if cut >= len(self._window):
            return self._advance(new_text)
        delta = self._decode(self._window[:cut])[len(self._prefix_text):]
        start = self._read_offset  # the window keeps the tokens read so far as the context of the rest
        self._window = self._window[start:]
        self._read_offset = cut - start
        self._prefix_text = self._decode(self._window[:self._read_offset])
        return delta

    def finish(self) -> str:
        """Flushes what is held back: unfinished bytes (as '\\ufffd') and a possible stop prefix.

        A stop string completed by the flushed text still cuts it. Calling it again returns "".

        Returns:
            The last delta.
        """
        if self._is_finished:
            return ""
        self._is_finished = True
        if self._stop_hit is not None:
            return ""
        delta = ""
        if self._read_offset < len(self._window):
            delta = self._advance(self._decode(self._window))
        out = self._push(delta)
        if self._stops is not None:
            out += self._emit(self._stops.flush())  # "" after a match
        return out

    def _advance(self, new_text: str) -> str:
        """Takes the window's new text and slides the window to start at the last read offset."""
        delta = new_text[len(self._prefix_text):]
        self._window = self._window[self._read_offset:]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    def _push(self, delta: str) -> str:
        """Runs newly decoded text through the stop-string check; returns what may be shown."""
        if self._stops is None or not delta:
            return self._emit(delta)
        shown = self._stops.push(delta)
        self._stop_hit = self._stops.stop_hit
        return self._emit(shown)

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        if self._decode_kwargs is None:  # a tokenizer-like object whose decode has no cleanup switch
            try:
                text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                             clean_up_tokenization_spaces=False)
                self._decode_kwargs = {"clean_up_tokenization_spaces": False}
                return text
            except TypeError:
                self._decode_kwargs = {}
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens, **self._decode_kwargs)

    def _skipped_ids(self) -> frozenset[int]:
        """Special token ids that `decode(..., skip_special_tokens=True)` drops."""
        candidates = set(getattr(self.tokenizer, "all_special_ids", ()))
        added = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        candidates.update(i for i, token in added.items() if getattr(token, "special", False))
        return frozenset(i for i in candidates if self._decode([i]) == "")
