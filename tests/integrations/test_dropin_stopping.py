"""Stopping criteria through the engine: stop strings, lm-evaluation-harness's multi-token EOS
criterion (copied here), per-row custom criteria and `max_time` give stock's output, and the engine
served each call (spy on `Engine.stream`)."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_paged  # noqa: F401
from tiny_models import left_padded_batch, tiny_model

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked


class StopRowAfter(StoppingCriteria):
    """Stops one row once it has `n` new tokens (a per-row [batch] bool result)."""

    def __init__(self, row: int, width: int, n: int):
        self.row, self.width, self.n = row, width, n
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[self.row] = input_ids.shape[1] - self.width >= self.n
        return done


class MultiTokenEOSCriteria(StoppingCriteria):
    """lm-evaluation-harness's criterion (`lm_eval.models.utils.MultiTokenEOSCriteria`), as it is
    written there: per-row state, the decoded tail of each row, one bool for the whole batch."""

    def __init__(self, sequence: str, tokenizer, initial_decoder_input_length: int, batch_size: int):
        self.initial_decoder_input_length = initial_decoder_input_length
        self.done_tracker = [False] * batch_size
        self.sequence = sequence
        self.sequence_ids = tokenizer.encode(sequence, add_special_tokens=False)
        self.sequence_id_len = len(self.sequence_ids) + 2
        self.tokenizer = tokenizer

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        lookback_ids_batch = input_ids[:, self.initial_decoder_input_length:]
        lookback_ids_batch = lookback_ids_batch[:, -self.sequence_id_len:]
        lookback_tokens_batch = self.tokenizer.batch_decode(lookback_ids_batch)
        for i, done in enumerate(self.done_tracker):
            if not done:
                self.done_tracker[i] = self.sequence in lookback_tokens_batch[i]
        return False not in self.done_tracker


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_custom_criterion_that_stops_row_2_early_matches_stock(arch, engine_streams):
    input_ids, attention_mask = left_padded_batch([5, 17, 9, 12], seed=6)
    width = input_ids.shape[1]
    stock = tiny_model(arch, "eager" if arch == "gemma2" else "sdpa")
    ours = tiny_model(arch, "hf_paged")
    gen = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=2)
    ref = stock.generate(input_ids, attention_mask=attention_mask, stopping_criteria=StoppingCriteriaList(
        [StopRowAfter(2, width, 3)]), **gen)
    criterion = StopRowAfter(2, width, 3)
    out = ours.generate(input_ids, attention_mask=attention_mask, stopping_criteria=StoppingCriteriaList([criterion]),
                        **gen)
    assert engine_streams == [4]
    assert torch.equal(out, ref)
    assert torch.all(out[2, width + 3:] == 0)  # row 2 stopped after 3 tokens, padded like stock
    assert criterion.calls == out.shape[1] - width  # once per step, as stock calls it


def test_max_time_zero_stops_after_one_step_like_stock(engine_streams):
    input_ids, attention_mask = left_padded_batch([5, 8], seed=7)
    stock, ours = tiny_model("llama"), tiny_model("llama", "hf_paged")
    gen = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=2, max_time=0.0)
    ref = stock.generate(input_ids, attention_mask=attention_mask, **gen)
    out = ours.generate(input_ids, attention_mask=attention_mask, **gen)
    assert engine_streams == [2] and torch.equal(out, ref) and out.shape[1] == input_ids.shape[1] + 1


def test_stop_strings_without_a_tokenizer_raise_stocks_error():
    ours = tiny_model("llama", "hf_paged")
    ids, mask = left_padded_batch([4], seed=1)
    with pytest.raises(ValueError, match="tokenizer"):
        ours.generate(ids, attention_mask=mask, max_new_tokens=3, stop_strings=["x"], pad_token_id=0)


@pytest.fixture(scope="module")
def smollm2():
    from hf_paged.defaults.models import load_default

    return load_default()


CHATS = ["List three fruits, one per line.", "Say hello and introduce yourself in one sentence.",
         "Write two short sentences about the sea."]


def _chat_batch(tokenizer):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in CHATS]
    return tokenizer(texts, return_tensors="pt", padding=True)


@pytest.mark.slow
def test_stop_strings_and_lm_eval_criterion_match_stock_on_smollm2(smollm2, engine_streams):
    model, tokenizer = smollm2
    inputs = _chat_batch(tokenizer)
    width = inputs["input_ids"].shape[1]
    gen = dict(max_new_tokens=40, do_sample=False)
    cases = [
        dict(stop_strings=["\n", "five"], tokenizer=tokenizer),
        dict(stopping_criteria=StoppingCriteriaList([MultiTokenEOSCriteria(s, tokenizer, width, len(CHATS))
                                                     for s in (".", "\n\n")])),
    ]
    plain = model.generate(**inputs, **gen)
    try:
        for case in cases:
            model.set_attn_implementation("sdpa")
            ref = model.generate(**inputs, **gen, **_fresh(case, tokenizer, width))
            model.set_attn_implementation("hf_paged")
            out = model.generate(**inputs, **gen, **_fresh(case, tokenizer, width))
            assert torch.equal(out, ref), tokenizer.batch_decode(out[:, width:])
            assert not torch.equal(out, plain)  # the criteria really stopped something
    finally:
        model.set_attn_implementation("sdpa")
    assert engine_streams == [len(CHATS)] * len(cases)


def _fresh(case: dict, tokenizer, width: int) -> dict:
    """The case with new criterion objects (lm-eval's keep state between calls)."""
    if "stopping_criteria" not in case:
        return case
    return dict(stopping_criteria=StoppingCriteriaList([MultiTokenEOSCriteria(c.sequence, tokenizer, width,
                                                                              len(c.done_tracker))
                                                        for c in case["stopping_criteria"]]))
