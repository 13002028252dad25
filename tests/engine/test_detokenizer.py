"""IncrementalDetokenizer with the real SmolLM2-135M-Instruct tokenizer (byte-level BPE).

Outputs are encoded strings fed one id at a time after a chat-template prompt, as a model would
produce them. Loading the tokenizer from the converted checkpoint takes well under a second.
"""

from __future__ import annotations

import re
import time
import tracemalloc
from datetime import timedelta

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.defaults.models import DefaultModelNotInstalledError, ensure_default_checkpoint
from hf_paged.engine import detokenizer
from hf_paged.engine.detokenizer import (
    MAX_PENDING_TOKENS,
    NUM_PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    StopStringMatcher,
    find_stop_string,
)

R = "\ufffd"
MULTILINGUAL = (
    "Привет 🙂 世界! 👩‍👩‍👧‍👦 and 🇫🇷 flags. 日本語のテキストと中文。 नमस्ते दुनिया, 한국어 텍스트, "
    "Ελληνικά, مرحبا بالعالم, café naïve — “quotes” …\n\tindented  double  spaces  \n"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    try:
        path = ensure_default_checkpoint()
    except DefaultModelNotInstalledError as error:
        pytest.skip(str(error))
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    messages = [{"role": "user", "content": "Say something in several languages."}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, prompt, ids, **kwargs):
    """Feeds `ids` one by one, stopping at a stop string; returns (detokenizer, add deltas, finish delta)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas = []
    for token_id in ids:
        deltas.append(detok.add(token_id))
        assert detok.text == "".join(deltas)  # the deltas join to the text at every moment
        if detok.stop_hit is not None:
            break
    last = detok.finish()
    assert detok.text == "".join(deltas) + last
    return detok, deltas, last


def byte_token_ids(tokenizer) -> dict[int, int]:
    """Byte value -> id of the byte-level BPE token holding just that byte (GPT-2's byte alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {b: tokenizer.convert_tokens_to_ids(c) for b, c in chars.items()}


# --- plain streaming ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Привет 🙂 世界",
        "👩‍👩‍👧‍👦",
        "👩‍👩‍👧‍👦👨‍👩‍👦 🏳️‍🌈",
        "日本語のテキストと中文の文章です。",
        " leading space, then  two, then\ttab and\nnewline ",
        "   three leading spaces",
        "नमस्ते दुनिया",
        MULTILINGUAL,
    ],
)
def test_streams_text_exactly(tokenizer, prompt, text):
    ids = encode(tokenizer, text)
    detok, deltas, last = stream(tokenizer, prompt, ids)
    assert not any(R in delta for delta in [*deltas, last])
    assert last == ""  # valid text is fully shown by add() already
    assert detok.text == text == tokenizer.decode(ids, skip_special_tokens=True)


def test_matches_decode_with_the_configured_space_cleanup(tokenizer, prompt):
    """SmolLM2 sets clean_up_tokenization_spaces=False, and transformers 5 ignores True for BPE
    tokenizers, so spaces before punctuation survive decode, and the stream keeps them too."""
    text = "Hello . It 's fine , isn 't it ? Yes !"
    ids = encode(tokenizer, text)
    detok, _, _ = stream(tokenizer, prompt, ids)
    assert tokenizer.clean_up_tokenization_spaces is False
    assert detok.text == text == tokenizer.decode(ids) == tokenizer.decode(ids, clean_up_tokenization_spaces=True)


def test_character_shows_once_its_last_byte_arrives(tokenizer, prompt):
    ids = encode(tokenizer, "👩‍👧")  # 👩, zero-width joiner, 👧: each split over several byte tokens
    assert len(ids) > 3
    detok = IncrementalDetokenizer(tokenizer, prompt)
    shown = [detok.add(i) for i in ids]
    assert [s for s in shown if s] == ["👩", "\u200d", "👧"]
    assert detok.finish() == ""


def test_first_token_keeps_its_leading_space(tokenizer, prompt):
    ids = encode(tokenizer, " Hello world")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.add(ids[0]) == " Hello"
    assert detok.add(ids[1]) == " world"


def test_empty_prompt_and_empty_output(tokenizer, prompt):
    for stops in ((), ("STOP",)):
        detok = IncrementalDetokenizer(tokenizer, prompt, stop_strings=stops)
        assert (detok.finish(), detok.text, detok.stop_hit) == ("", "", None)
    detok, deltas, last = stream(tokenizer, [], encode(tokenizer, " Привет"))
    assert detok.text == " Привет"


def test_prompt_ending_inside_a_character(tokenizer):
    """A prompt whose last bytes start a character: the output is decoded without that context."""
    ids = encode(tokenizer, "🙂🙂")
    cut = 1  # the prompt holds only the first byte token of the first emoji
    detok, deltas, last = stream(tokenizer, ids[:cut], ids[cut:])
    assert detok.text == tokenizer.decode(ids[cut:])  # leading orphan bytes show as '\ufffd'


# --- special tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, prompt, skip):
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    ids = encode(tokenizer, "Hi there") + [im_end, endoftext] + encode(tokenizer, " more 世界") + [im_end]
    detok, deltas, last = stream(tokenizer, prompt, ids, skip_special_tokens=skip)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) is (not skip)
    assert ("<|endoftext|>" in detok.text) is (not skip)


def test_skipped_special_tokens_do_not_widen_the_window(tokenizer, prompt):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    spy = DecodeSpy(tokenizer)
    detok = IncrementalDetokenizer(spy, prompt)
    spy.calls.clear()
    for _ in range(100):
        assert detok.add(im_end) == ""
    assert spy.calls == []
    assert detok.add(encode(tokenizer, " ok")[0]) == " ok"


@pytest.mark.parametrize("skip", [True, False])
def test_stop_string_on_special_token_text(tokenizer, prompt, skip):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "Done.") + [im_end] + encode(tokenizer, " after")
    detok, deltas, last = stream(tokenizer, prompt, ids, skip_special_tokens=skip, stop_strings=["<|im_end|>"])
    if skip:  # the special token has no text, so it cannot match
        assert (detok.text, detok.stop_hit) == ("Done. after", None)
    else:
        assert (detok.text, detok.stop_hit) == ("Done.", "<|im_end|>")


# --- stop strings -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("Привет 🙂 世界! Пока", "世界"),  # two CJK characters over five byte tokens
        ("Привет 🙂 世界! Пока", "界"),  # its first byte shares no token with the text before
        ("This is the end of it", "the end"),  # several whole tokens
        ("This is the end of it", "he en"),  # begins and ends inside tokens
        ("नमस्ते दुनिया", "दुनिया"),  # its first byte arrives in one token with the space before it
        ("한국어 텍스트 more", "텍스트"),
        ("👩‍👩‍👧‍👦 family", "👧"),  # inside an emoji ZWJ sequence
        ("👩‍👩‍👧‍👦 family", "\u200d👧"),  # begins with the joiner
    ],
)
def test_stop_string_cuts_the_text(tokenizer, prompt, text, stop):
    ids = encode(tokenizer, text)
    detok, deltas, last = stream(tokenizer, prompt, ids, stop_strings=[stop])
    full = tokenizer.decode(ids)
    assert detok.stop_hit == stop
    assert detok.text == full[: full.index(stop)]
    assert not any(R in delta for delta in [*deltas, last])
    # Nothing of the stop string was ever shown: every delta lies inside the cut text.
    assert "".join(deltas) == detok.text and last == ""
    with pytest.raises(RuntimeError, match="already matched"):
        detok.add(ids[-1])
    assert detok.finish() == ""


def test_stop_prefix_is_held_then_released(tokenizer, prompt):
    ids = encode(tokenizer, "Hello there")
    assert len(ids) == 2
    detok = IncrementalDetokenizer(tokenizer, prompt, stop_strings=["Hello world"])
    assert detok.add(ids[0]) == ""  # "Hello" may become "Hello world"
    assert detok.add(ids[1]) == "Hello there"  # " there" rules it out
    assert (detok.finish(), detok.stop_hit, detok.text) == ("", None, "Hello there")


def test_only_the_stop_prefix_is_held(tokenizer, prompt):
    """Holds back the longest suffix that starts a stop string, not a fixed max_len - 1 characters."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop_strings=["<END>", "xyzzy-long-stop-string"])
    shown = [detok.add(i) for i in encode(tokenizer, "Some text <")]
    assert "".join(shown) == "Some text "  # only "<" is held
    shown = [detok.add(i) for i in encode(tokenizer, "b> and x")]
    assert "".join(shown) == "<b> and "  # "<b" ruled out "<END>"; "x" may start the long one


def test_finish_flushes_a_pending_stop_prefix(tokenizer, prompt):
    ids = encode(tokenizer, "Say Hello wor")
    detok, deltas, last = stream(tokenizer, prompt, ids, stop_strings=["Hello world"])
    assert "".join(deltas) == "Say "  # "Hello wor" may still become "Hello world"
    assert last == "Hello wor"
    assert detok.text == "Say Hello wor" and detok.stop_hit is None


def test_first_completed_stop_string_wins(tokenizer, prompt):
    ids = encode(tokenizer, "xx abcd yy")
    detok, _, _ = stream(tokenizer, prompt, ids, stop_strings=["abcd", "bc"])
    assert (detok.stop_hit, detok.text) == ("bc", "xx a")
    detok, _, _ = stream(tokenizer, prompt, ids, stop_strings=["d yy", "abcd"])
    assert (detok.stop_hit, detok.text) == ("abcd", "xx ")


def test_stop_string_completed_by_finish(tokenizer, prompt):
    """Bytes that never complete are flushed as '\ufffd' by finish(), and may still match."""
    bytes_ = byte_token_ids(tokenizer)
    ids = encode(tokenizer, "ok") + [bytes_[0xE4]]  # the first byte of a 3-byte character
    detok = IncrementalDetokenizer(tokenizer, prompt, stop_strings=[R])
    assert [detok.add(i) for i in ids] == ["ok", ""]
    assert detok.finish() == "" and (detok.stop_hit, detok.text) == (R, "ok")


def test_find_stop_string():
    assert find_stop_string("abcd", ["abcd", "bc"]) == (1, "bc")  # ends first
    assert find_stop_string("abcd", ["cd", "bcd"]) == (1, "bcd")  # same end: the longer
    assert find_stop_string("abcabc", ["abc"], start=1) == (3, "abc")
    assert find_stop_string("abc", ["x"]) is None
    assert find_stop_string("abc", []) is None


def test_rejects_bad_stop_strings(tokenizer, prompt):
    with pytest.raises(TypeError):
        IncrementalDetokenizer(tokenizer, prompt, stop_strings="stop")
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizer, prompt, stop_strings=["ok", ""])


def test_add_after_finish_raises(tokenizer, prompt):
    detok = IncrementalDetokenizer(tokenizer, prompt)
    detok.add(encode(tokenizer, "Hi")[0])
    assert detok.finish() == "" and detok.is_finished
    assert detok.finish() == ""
    with pytest.raises(RuntimeError, match="after finish"):
        detok.add(0)


def test_replacement_char_stop_never_sees_pending_bytes(tokenizer, prompt):
    """'\ufffd' as a stop string: half-received characters are never text, so it never matches."""
    ids = encode(tokenizer, MULTILINGUAL)
    detok, _, _ = stream(tokenizer, prompt, ids, stop_strings=[R])
    assert (detok.stop_hit, detok.text) == (None, MULTILINGUAL)


# --- invalid bytes ------------------------------------------------------------------------------


def test_unfinished_character_is_flushed_by_finish(tokenizer, prompt):
    bytes_ = byte_token_ids(tokenizer)
    ids = encode(tokenizer, " ok ") + [bytes_[0xF0], bytes_[0x9F]]  # 2 of the 4 bytes of an emoji
    detok, deltas, last = stream(tokenizer, prompt, ids)
    assert not any(R in delta for delta in deltas)
    assert last == R and detok.text == tokenizer.decode(ids) == " ok " + R


def test_invalid_bytes_show_once_followed_by_text(tokenizer, prompt):
    bytes_ = byte_token_ids(tokenizer)
    ids = [bytes_[0xE4], *encode(tokenizer, "a")]  # a lead byte cut short by an ASCII letter
    detok, deltas, last = stream(tokenizer, prompt, ids)
    assert deltas == ["", R + "a"] and detok.text == tokenizer.decode(ids)


def test_endless_invalid_bytes_keep_the_window_bounded(tokenizer, prompt):
    bytes_ = byte_token_ids(tokenizer)
    ids = [bytes_[0x80]] * 50  # lone continuation bytes: text that ends in '\ufffd' forever
    spy = DecodeSpy(tokenizer)
    detok, deltas, last = stream(spy, prompt, ids)
    assert "".join(deltas)  # shown before finish()
    # The window: one forced step (MAX_PENDING_TOKENS + 1 tokens) as context, plus as many pending.
    assert max(spy.calls) <= 2 * (MAX_PENDING_TOKENS + 1)
    assert detok.text == tokenizer.decode(ids) == R * 50


# --- properties ---------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_text_slices_stream_exactly(tokenizer, prompt, data):
    """Any slice of the text, streamed: no '\ufffd' ever, and the text is decode(ids) at the end."""
    start = data.draw(st.integers(0, len(MULTILINGUAL) - 1))
    stop = data.draw(st.integers(start + 1, len(MULTILINGUAL)))
    ids = encode(tokenizer, MULTILINGUAL[start:stop])
    detok, deltas, last = stream(tokenizer, prompt, ids)
    assert not any(R in delta for delta in [*deltas, last])
    assert detok.text == tokenizer.decode(ids) == MULTILINGUAL[start:stop]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_id_slices_stream_like_decode(tokenizer, prompt, data):
    """Slices of ids may cut characters at both ends. After each token the text is the longest
    decoded prefix that does not end in an unfinished character; after finish(), decode(ids)."""
    all_ids = encode(tokenizer, MULTILINGUAL)
    start = data.draw(st.integers(0, len(all_ids) - 1))
    stop = data.draw(st.integers(start + 1, len(all_ids)))
    prompt_ids = prompt + all_ids[:start] if data.draw(st.booleans()) else prompt
    ids = all_ids[start:stop]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    expected = ""
    for i, token_id in enumerate(ids):
        detok.add(token_id)
        decoded = tokenizer.decode(ids[: i + 1])
        if not decoded.endswith(R):
            expected = decoded
        assert detok.text == expected
    detok.finish()
    assert detok.text == tokenizer.decode(ids)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_random_stop_strings_cut_like_find(tokenizer, prompt, data):
    """A stop string drawn from the text cuts it where str.find would, and is never shown."""
    start = data.draw(st.integers(0, len(MULTILINGUAL) - 1))
    length = data.draw(st.integers(1, 12))
    stop = MULTILINGUAL[start : start + length]
    ids = encode(tokenizer, MULTILINGUAL)
    detok, deltas, last = stream(tokenizer, prompt, ids, stop_strings=[stop])
    assert detok.stop_hit == stop
    assert detok.text == MULTILINGUAL[: MULTILINGUAL.index(stop)]
    assert not any(R in delta for delta in [*deltas, last])


# --- cost per token -----------------------------------------------------------------------------


class DecodeSpy:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.calls: list[int] = []

    def decode(self, ids, **kwargs):
        self.calls.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_add_decodes_a_bounded_window(tokenizer, prompt):
    ids = encode(tokenizer, MULTILINGUAL * 20)  # thousands of tokens
    assert len(ids) > 2000
    spy = DecodeSpy(tokenizer)
    detok = IncrementalDetokenizer(spy, prompt, stop_strings=["never appears in the text"])
    calls_per_add = []
    for token_id in ids:
        spy.calls = []
        detok.add(token_id)
        calls_per_add.append(spy.calls)
    detok.finish()
    assert detok.text == MULTILINGUAL * 20
    # At most two decodes per token: the window, and the slid window once text is shown. The
    # window holds the last shown step (the prompt context at first) and the pending tokens: a
    # valid character spans at most 4 byte tokens.
    assert max(map(len, calls_per_add)) <= 2
    assert max(max(c, default=0) for c in calls_per_add) <= NUM_PROMPT_CONTEXT_TOKENS + 4


def test_stop_check_feeds_each_character_once(tokenizer, prompt, monkeypatch):
    pushed = []
    push = StopStringMatcher.push

    def spy(self, text):
        pushed.append(len(text))
        return push(self, text)

    monkeypatch.setattr(StopStringMatcher, "push", spy)
    stops = ["never appears in the text", "dox"]  # "do" of "double" is held, then released
    text = MULTILINGUAL * 20
    detok, deltas, last = stream(tokenizer, prompt, encode(tokenizer, text), stop_strings=stops)
    assert detok.text == text and detok.stop_hit is None
    # The held tail is never fed again: each character is pushed once, in one step's new text.
    assert sum(pushed) == len(text)
    assert max(pushed) < 32


# --- adversarial stop strings -------------------------------------------------------------------

# Stop strings that overlap themselves and each other ("aaaa", "abab...abx", prefixes and suffixes
# of one another, duplicates), over multi-byte characters and '\ufffd'. None holds "\n": the chat
# prompt ends in "\n", so a stop string cannot begin in the prompt, which stock's check would see.
UNITS = ["a", "b", "x", " ", "é", "世", "🙂", R]


@st.composite
def adversarial_stops(draw) -> list[str]:
    period = st.sampled_from(["a", "ab", "aab", "aba", "é", "🙂", R, "世a"])
    tail = st.sampled_from(["", "x", "a", "b", "é", R])
    stop = st.one_of(
        st.builds(lambda p, n, t: p * n + t, period, st.integers(1, 12), tail),
        st.lists(st.sampled_from(UNITS), min_size=1, max_size=8).map("".join),
    )
    stops = draw(st.lists(stop, min_size=1, max_size=4))
    for s in draw(st.lists(st.sampled_from(stops), max_size=3)):
        k = draw(st.integers(1, len(s)))
        stops.append(draw(st.sampled_from([s[:k], s[-k:], s])))
    return draw(st.permutations(stops))


@st.composite
def text_near(draw, stops: list[str]) -> str:
    """Stop strings, their prefixes and suffixes, and single characters: matches, near misses and
    long held tails all occur."""
    pieces = []
    for _ in range(draw(st.integers(0, 10))):
        stop = draw(st.sampled_from(stops))
        k = draw(st.integers(0, len(stop)))
        pieces.append(draw(st.one_of(st.sampled_from([stop, stop[:k], stop[k:]]), st.sampled_from(UNITS))))
    return "".join(pieces)


def naive_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """`text` cut before its first stop string, read one character at a time (the longest of those
    ending at the same character), and that stop string."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text.endswith(stop, 0, end):
                return text[: end - len(stop)], stop
    return text, None


def naive_shown(text: str, stops: list[str]) -> str:
    """What may show of `text`: cut before a stop string, else without its longest suffix that is
    a proper prefix of a stop string."""
    cut, stop = naive_cut(text, stops)
    if stop is not None:
        return cut
    held = max((k for s in stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - held]


def encode_by_character(tokenizer, text: str) -> list[int]:
    """ASCII runs encoded whole, other characters one at a time: no token holds bytes of two characters."""
    return [i for run in re.findall(r"[\x00-\x7f]+|[^\x00-\x7f]", text) for i in encode(tokenizer, run)]


def stream_checking_each_step(tokenizer, prompt, ids, stops, skip_special_tokens=True):
    """Streams `ids` until a stop string; after each token whose text ends in a whole character,
    checks that all but the held tail shows. Returns the detokenizer and the index of the stop's token."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens, stop_strings=stops)
    deltas, hit_at = [], None
    for i, token_id in enumerate(ids):
        deltas.append(detok.add(token_id))
        decoded = tokenizer.decode(ids[: i + 1], skip_special_tokens=skip_special_tokens)
        if not decoded.endswith(R):  # else a character may be unfinished, and the stream waits
            assert detok.text == "".join(deltas) == naive_shown(decoded, stops)
        if detok.stop_hit is not None:
            hit_at = i
            break
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    return detok, hit_at


@settings(max_examples=200, deadline=timedelta(seconds=5))
@given(data=st.data())
def test_adversarial_stop_strings_cut_like_a_naive_scan(tokenizer, prompt, data):
    """Any tokenization, special tokens shown or skipped: each step shows all but the held tail, and
    the text is decode(ids) cut before the first stop string."""
    stops = data.draw(adversarial_stops())
    text = data.draw(text_near(stops))
    ids = (encode_by_character if data.draw(st.booleans()) else encode)(tokenizer, text)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for index in data.draw(st.lists(st.integers(0, len(ids)), max_size=2)):
        ids.insert(index, im_end)
    skip = data.draw(st.booleans())
    detok, _ = stream_checking_each_step(tokenizer, prompt, ids, stops, skip)
    assert (detok.text, detok.stop_hit) == naive_cut(tokenizer.decode(ids, skip_special_tokens=skip), stops)


@settings(max_examples=8, deadline=timedelta(seconds=10))  # building StopStringCriteria takes ~0.3 s
@given(data=st.data())
def test_adversarial_stop_strings_stop_at_stocks_token(tokenizer, prompt, data):
    """The stop hits at the token where transformers' `StopStringCriteria` (generate's
    `stop_strings`) first stops, run on the prompt and the generated ids.

    The ids are restricted to what both see alike. Stock matches the UTF-8 bytes of the raw tokens:
    it sees special tokens' text (skip_special_tokens=True drops it), so there are none; it sees a
    stop string once its last byte arrives, which the stream shows only once no character is left
    unfinished, so no token holds bytes of two characters (`encode_by_character`); and the output
    holds no '\ufffd', which the stream cannot tell from an unfinished character (stop strings do).
    """
    from transformers.generation.stopping_criteria import StopStringCriteria

    stops = data.draw(adversarial_stops())
    text = data.draw(text_near(stops)).replace(R, "")
    ids = encode_by_character(tokenizer, text)
    detok, hit_at = stream_checking_each_step(tokenizer, prompt, ids, stops)
    assert (detok.text, detok.stop_hit) == naive_cut(text, stops)

    criteria = StopStringCriteria(tokenizer, stops)
    sequence = torch.tensor([prompt + ids])
    stock_hit_at = next((i for i in range(len(ids)) if criteria(sequence[:, : len(prompt) + i + 1], None)[0]), None)
    assert hit_at == stock_hit_at


@pytest.mark.parametrize(
    "stops",
    [
        pytest.param(["ab" * 2_500 + "x"], id="5k"),
        pytest.param(["ab" * 5_000 + "x"], id="10k"),
        pytest.param(["ab" * 10_000 + "x"], id="20k"),
        pytest.param(["ab" * 20_000 + "x"], id="40k"),
        pytest.param(["ab" * 25_000 + "x", "ab" * 24_999 + "bb", "ab" * 20_000 + "a" * 10_000,
                      "ab" * 2_500 + "ba" * 22_500], id="4x50k"),
    ],
)
def test_long_stop_strings_cost_linear_memory_and_time(tokenizer, prompt, stops):
    """Long, self-overlapping stop strings, and a text that stays a prefix of them for thousands of
    characters: memory and time grow linearly with the stop strings' length (they grew with its
    square: 13 / 49 / 194 / 767 MiB for one stop string of 5k / 10k / 20k / 40k characters)."""
    num_chars = sum(map(len, stops))
    tracemalloc.start()
    try:
        IncrementalDetokenizer(tokenizer, prompt, stop_strings=stops)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * num_chars + 256 * 1024  # the prefix functions take 4 bytes per character

    text = "ab" * 2_000
    ids = encode(tokenizer, text)
    started = time.perf_counter()
    detok = IncrementalDetokenizer(tokenizer, prompt, stop_strings=stops)
    assert "".join(detok.add(i) for i in ids) == ""  # it may still become every stop string: all held
    assert detok.add(encode(tokenizer, "!")[0]) == text + "!"  # "!" rules them all out
    elapsed = time.perf_counter() - started
    # About 0.25 s for 200k characters, 2,000 tokens' decoding included (one 40k stop string took
    # 1.1 s to build before); the bound leaves room for a loaded machine.
    assert elapsed < 0.25 + 3.5e-6 * num_chars


@pytest.mark.parametrize("run", [8, 9, 12])
def test_real_replacement_characters_never_force_out_a_split_character(tokenizer, prompt, run):
    """Hypothesis found it: a run of real U+FFFD characters (one token each) keeps the text ending in
    '\\ufffd', which the stream cannot tell from an unfinished character; past `MAX_PENDING_TOKENS` it
    used to show everything pending, the first bytes of a split character (世) too, as '\\ufffd', so a
    stop string of '\\ufffd's matched text decode(ids) does not hold. Now it shows only up to the last
    token boundary that splits no character."""
    replacement = tokenizer.convert_tokens_to_ids("ï¿½")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    split = encode(tokenizer, "世")
    ids = [im_end] + [replacement] * 3 + [im_end] + [replacement] * run + split + encode(tokenizer, " ok")
    stops = ["\ufffd" * 11, "a"]
    detok, _ = stream_checking_each_step(tokenizer, prompt, ids, stops, skip_special_tokens=False)
    assert (detok.text, detok.stop_hit) == naive_cut(tokenizer.decode(ids, skip_special_tokens=False), stops)
