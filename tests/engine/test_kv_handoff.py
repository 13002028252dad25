"""Moving a prompt's K/V from one engine to another (what disaggregated prefill/decode does): an
engine that computed the prompt and its first token exports the K/V as one buffer; a second engine
imports it into its own blocks (learning their prefix hashes) and resumes after the first token,
giving exactly what one engine gives."""

from __future__ import annotations

import pytest
import torch

from hf_paged import Engine, SamplingParams
from tiny_models import VOCAB, tiny_model

PROMPTS = [list(range(3, 3 + n)) for n in (1, 15, 16, 17, 54)]


def _run(engine: Engine, **add) -> list[int]:
    rid = engine.add_owned_request(inbox=None, **add)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
        assert engine.has_unfinished_requests()


def _engines(**kwargs):
    model = tiny_model("llama", "hf_paged")
    a, b = Engine(model, block_size=16, **kwargs), Engine(model, block_size=16, **kwargs)
    for e in (a, b):  # a warm-up forward allocates every layer's tensors
        e.generate([[5, 6]], SamplingParams(max_new_tokens=1))
    return a, b


@pytest.mark.parametrize("prompt", PROMPTS, ids=lambda p: f"len{len(p)}")
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_prefill_on_one_engine_decode_on_another_equals_one_engine(prompt, temperature):
    a, b = _engines()
    params = SamplingParams(max_new_tokens=9, temperature=temperature, seed=11, repetition_penalty=1.3)
    whole = a.generate([prompt], params)[0].token_ids
    first = a.generate([prompt], SamplingParams(max_new_tokens=1, temperature=temperature, seed=11,
                                                repetition_penalty=1.3), retain_kv=True)[0]
    [seq] = a.kept_kv(first.request_id)
    kv = a.export_kv(seq)
    a.free_kv([seq])
    assert kv.is_contiguous() and kv.numel() == len(prompt) * a.cache.kv.kv_numel_per_token()
    forwarded = b.metrics()["num_forward_tokens"]
    imported = b.import_kv(prompt, kv)
    out = _run(b, prompt=prompt, sampling_params=params, request_id=None, kv_prefix=imported,
               resume_tokens=first.token_ids)
    assert out.token_ids == whole and out.finish_reason == "length"
    assert b.metrics()["num_forward_tokens"] - forwarded == len(whole) - 1  # the prompt was never computed


def test_imported_blocks_serve_the_prefix_cache():
    a, b = _engines()
    prompt = list(range(3, 51))  # three full blocks
    first = a.generate([prompt], SamplingParams(max_new_tokens=1), retain_kv=True)[0]
    [seq] = a.kept_kv(first.request_id)
    b.free_kv([b.import_kv(prompt, a.export_kv(seq))])
    before = b.metrics()["vllm:prefix_cache_hits"]
    again = b.generate([prompt + [60]], SamplingParams(max_new_tokens=2))[0]
    assert b.metrics()["vllm:prefix_cache_hits"] - before == 48
    assert again.token_ids == a.generate([prompt + [60]], SamplingParams(max_new_tokens=2))[0].token_ids


def test_streamed_text_of_a_resumed_request_joins_to_its_text():
    from tiny_models import CharTokenizer

    model = tiny_model("llama", "hf_paged")
    tok = CharTokenizer()
    a, b = Engine(model, tok, block_size=16), Engine(model, tok, block_size=16)
    b.generate([[5, 6]], SamplingParams(max_new_tokens=1))  # allocates its layers' tensors
    prompt = list(range(3, 23))
    whole = a.generate([prompt], SamplingParams(max_new_tokens=6))[0]
    first = a.generate([prompt], SamplingParams(max_new_tokens=1), retain_kv=True)[0]
    [seq] = a.kept_kv(first.request_id)
    from hf_paged.engine.delivery import Inbox

    inbox = Inbox(wants_tokens=True)
    b.add_owned_request(prompt, SamplingParams(max_new_tokens=6), None, inbox, streamed=True,
                        kv_prefix=b.import_kv(prompt, a.export_kv(seq)), resume_tokens=first.token_ids)
    deltas, final = [], None
    while final is None:
        b.step()
        for event, output in inbox.take_all():
            if event is not None and event.text:
                deltas.append(event.text)
            if output is not None:
                final = output
    assert final.token_ids == whole.token_ids and "".join(deltas) == final.text == whole.text


@pytest.mark.parametrize("bad, message", [
    (dict(resume_tokens=[VOCAB + 1]), "vocab"),
    (dict(resume_tokens=list(range(3, 12))), "max_new_tokens"),
])
def test_bad_resume_tokens_are_refused(bad, message):
    a, _ = _engines()
    with pytest.raises(ValueError, match=message):
        a.add_owned_request([5, 6, 7], SamplingParams(max_new_tokens=9), None, None, **bad)


def test_a_buffer_of_the_wrong_size_is_refused_and_stores_nothing():
    a, b = _engines()
    used = b.cache.pool.num_used_blocks
    with pytest.raises(ValueError, match="does not hold"):
        b.import_kv([5, 6, 7], torch.zeros(b.cache.kv.kv_numel_per_token() * 2))
    assert b.cache.pool.num_used_blocks == used
