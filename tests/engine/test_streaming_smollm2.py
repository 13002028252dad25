"""Streamed text from the real SmolLM2-135M-Instruct through the engine: Cyrillic, CJK and emoji in
prompts and outputs (byte-level BPE splits their characters across tokens), stop strings split
across tokens or starting inside a character, and `skip_special_tokens` per request."""

from __future__ import annotations

import pytest

from hf_paged import Engine, SamplingParams
from hf_paged.defaults.models import load_default

pytestmark = pytest.mark.slow

R = "\ufffd"
QUESTIONS = [
    "Translate to Russian: Hello, my dear friend, how are you today?",
    "请用中文回答：你今天好吗？",
    "Write the Japanese word for cat, then the Korean word for cat.",
    "Привет 🙂 世界! Reply with one friendly sentence and an emoji.",
]
NEW = 40


@pytest.fixture(scope="module")
def setup():
    model, tokenizer = load_default(attn_implementation="hf_paged")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False) for q in QUESTIONS]
    return Engine(model, tokenizer), tokenizer, prompts


def _stream(engine, prompt, params):
    events = list(engine.stream(prompt, params))
    assert [e.finish_reason is not None for e in events].count(True) == 1 and events[-1].finish_reason
    return events


def _assert_clean(events, tokenizer):
    """No half character in any delta; only an output cut inside a character by max_new_tokens may
    end in the replacement character, exactly where stock's decode of those ids does."""
    ids = [e.token_id for e in events if e.token_id is not None]
    stock_text = tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(R in e.text for e in events[:-1])
    assert R not in events[-1].text or (stock_text.endswith(R) and events[-1].finish_reason == "length")
    return ids, stock_text


def test_multibyte_outputs_stream_whole_characters(setup):
    engine, tokenizer, prompts = setup
    saw_split_characters = False
    for prompt in prompts:
        events = _stream(engine, prompt, SamplingParams(max_new_tokens=NEW))
        ids, stock_text = _assert_clean(events, tokenizer)
        text = "".join(e.text for e in events)
        assert text == stock_text  # the deltas join to stock's decode of the same ids
        # A delta of "" on a token that decodes to part of a character: the splitting was exercised.
        saw_split_characters |= any(e.text == "" and e.token_id is not None for e in events)
    assert saw_split_characters
    out = engine.generate(prompts[1], SamplingParams(max_new_tokens=NEW))[0]
    streamed = "".join(e.text for e in _stream(engine, prompts[1], SamplingParams(max_new_tokens=NEW)))
    assert out.text == streamed and any(ord(c) > 0x2E80 for c in out.text)  # CJK really came out


def _split_stop(tokenizer, ids, text):
    """A two-character stop string of the free-run text that spans a token boundary: the last
    character before token i and the first one after it (which may take several byte tokens)."""
    pieces = [tokenizer.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
    clean = [i for i in range(2, len(ids)) if pieces[i] and R not in pieces[i] and text.startswith(pieces[i])]
    for a, b in zip(clean, clean[1:]):
        head = pieces[a]
        stop = text[len(head) - 1: len(head) + 1]
        if len(pieces[b]) > len(head) and not head[-1].isspace() and text.find(stop) == len(head) - 1:
            return stop  # its first occurrence is the one that spans the boundary
    raise AssertionError("no token boundary to split a stop string across")


@pytest.mark.parametrize("index", [0, 1])
def test_a_stop_string_split_across_tokens_is_never_emitted(setup, index):
    engine, tokenizer, prompts = setup
    free = _stream(engine, prompts[index], SamplingParams(max_new_tokens=NEW))
    ids, text = _assert_clean(free, tokenizer)
    stop = _split_stop(tokenizer, ids, text)
    cut = text.find(stop)
    events = _stream(engine, prompts[index], SamplingParams(max_new_tokens=NEW, stop=[stop]))
    shown = ""
    for event in events:
        shown += event.text
        assert stop not in shown and (R not in event.text)
    out = events[-1]
    assert out.finish_reason == "stop" and shown == text[:cut]


def test_a_stop_string_inside_an_emoji_cuts_before_it(setup):
    """'😊' is four bytes, several byte-level tokens: the stop begins inside a character."""
    engine, tokenizer, prompts = setup
    free = "".join(e.text for e in _stream(engine, prompts[1], SamplingParams(max_new_tokens=NEW)))
    if "😊" not in free:
        pytest.skip("the model did not produce the emoji this time")
    events = _stream(engine, prompts[1], SamplingParams(max_new_tokens=NEW, stop=["😊"]))
    shown = "".join(e.text for e in events)
    assert shown == free[: free.find("😊")] and "😊" not in shown


def test_skip_special_tokens_is_honoured_per_request(setup):
    engine, tokenizer, prompts = setup
    short = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                          tokenize=False)
    kept = _stream(engine, short, SamplingParams(max_new_tokens=60, skip_special_tokens=False))
    skipped = _stream(engine, short, SamplingParams(max_new_tokens=60, skip_special_tokens=True))
    assert kept[-1].finish_reason == skipped[-1].finish_reason == "stop"  # it ended with <|im_end|>
    kept_text, skipped_text = "".join(e.text for e in kept), "".join(e.text for e in skipped)
    assert kept_text.endswith(tokenizer.eos_token) and tokenizer.eos_token not in skipped_text
    assert kept_text == skipped_text + tokenizer.eos_token
