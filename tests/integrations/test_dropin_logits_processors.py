"""A drop-in `generate` call's own `logits_processor` list and `prefix_allowed_tokens_fn` run in the engine,
and see what they see in stock's loop: the same calls, each with stock's `input_ids` (left padding, a pad
column for a row that ended) and the same scores for the live rows. Stateful processors therefore behave
as in stock, and greedy output is stock's token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from hf_paged import Engine, SamplingParams
from hf_paged.engine.core import InvalidDistributionError
from tiny_models import VOCAB, left_padded_batch, tiny_model

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked


class Recorder(LogitsProcessor):
    """Records every call; bans, per row, the token after its last one (so it depends on input_ids), and
    ends row `end_row` at output step `end_step` by forcing the EOS token (2)."""

    def __init__(self, width: int, end_row: int | None = None, end_step: int = 3):
        self.calls, self.width, self.end_row, self.end_step = [], width, end_row, end_step

    def __call__(self, input_ids, scores):
        self.calls.append((input_ids.clone(), scores.clone()))
        out = scores.clone()
        out[torch.arange(len(out)), (input_ids[:, -1] + 1) % scores.shape[-1]] = -float("inf")
        if self.end_row is not None and input_ids.shape[1] - self.width == self.end_step:
            out[self.end_row, 2] = 1e4
        return out


def _run(model, ids, mask, processor, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          eos_token_id=2, logits_processor=LogitsProcessorList([processor]), **kwargs)


def _live_scores(scores, ids, width):
    """The rows still running at this call (no EOS among their generated tokens)."""
    live = ~(ids[:, width:] == 2).any(dim=1)
    return scores[live].nan_to_num(neginf=-1e9)


@pytest.mark.parametrize("end_row", [None, 1], ids=["all-run", "a-row-ends-early"])
def test_processors_see_stocks_calls_and_greedy_output_is_stocks(engine_calls, end_row):
    ids, mask = left_padded_batch([7, 4, 9], seed=3)
    model = tiny_model("llama")
    allowed = list(range(3, 120))  # prefix_allowed_tokens_fn: a second processor, placed first as in stock
    ref_rec = Recorder(ids.shape[1], end_row)
    ref = _run(model, ids, mask, ref_rec, prefix_allowed_tokens_fn=lambda b, s: allowed + [2])
    model.set_attn_implementation("hf_paged")
    rec = Recorder(ids.shape[1], end_row)
    ours = _run(model, ids, mask, rec, prefix_allowed_tokens_fn=lambda b, s: allowed + [2])
    assert engine_calls == [True] and model.hf_paged_last_metrics["num_steps"] >= 10
    assert torch.equal(ours, ref)
    if end_row is not None:
        assert (ref[end_row, ids.shape[1] + 4:] == 0).all()  # stock padded the row that ended
    assert len(rec.calls) == len(ref_rec.calls) == 10
    for (a, sa), (b, sb) in zip(ref_rec.calls, rec.calls):
        assert torch.equal(a, b)  # stock's input_ids: padding, tokens, pads after a row ended
        torch.testing.assert_close(_live_scores(sb, b, ids.shape[1]), _live_scores(sa, a, ids.shape[1]),
                                   atol=1e-4, rtol=1e-4)


def test_sampled_samples_keep_stocks_row_order_and_every_processor_applies(engine_calls):
    ids, mask = left_padded_batch([5, 8], seed=4)
    model = tiny_model("llama", "hf_paged")
    rec = Recorder(ids.shape[1])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=3,
                         pad_token_id=0, eos_token_id=2, logits_processor=LogitsProcessorList([rec]))
    assert engine_calls == [True] and out.shape[0] == 6
    for t, (call_ids, _) in enumerate(rec.calls):  # row i*3+j: prompt i's sample j, as stock orders them
        assert torch.equal(call_ids, out[:, : ids.shape[1] + t])
    gen = out[:, ids.shape[1]:]
    assert not (gen[:, 1:] == (gen[:, :-1] + 1) % VOCAB).any()  # the ban held at every step of every sample


def test_rows_whose_prefills_end_in_different_steps_still_sample_together():
    # 8 tokens a step: the 5-token prompt is ready in step 1, the 30-token one in step 4. Each call of the
    # processor still has both rows, at the same step, and the output is the engine's without it.
    model = tiny_model("llama", "hf_paged")
    calls = []

    def processor(rows, token_ids, num_prompt, scores):
        calls.append([(r, len(t) - p) for r, t, p in zip(rows, token_ids, num_prompt)])
        return scores

    prompts = [list(range(3, 8)), list(range(10, 40))]
    engine = Engine(model, max_num_batched_tokens=8, max_num_seqs=4)
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    hooked = engine.generate(prompts, SamplingParams(max_new_tokens=6, batch_processor=processor))
    assert [o.token_ids for o in hooked] == [o.token_ids for o in plain]
    assert calls == [[(0, t), (1, t)] for t in range(6)]


def test_a_processor_that_raises_ends_the_call_with_its_error_and_the_engine_goes_on(engine_calls):
    ids, mask = left_padded_batch([6, 3], seed=5)
    model = tiny_model("llama", "hf_paged")

    class Broken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - ids.shape[1] == 2:
                raise KeyError("no such state")
            return scores

    with pytest.raises(KeyError, match="no such state"):  # what stock raises from the same processor
        _run(model, ids, mask, Broken())
    fine = _run(model, ids, mask, Recorder(ids.shape[1]))
    assert fine.shape == (2, ids.shape[1] + 10) and engine_calls == [True]  # (the raising call returned nothing)


class Spoiler(LogitsProcessor):
    """Fills every score of row `row` with `fill`, and makes token 17 of every other row NaN."""

    def __init__(self, fill: float, row: int = 1):
        self.fill, self.row = fill, row

    def __call__(self, input_ids, scores):
        out = scores.clone()
        out[:, 17] = float("nan")
        out[self.row] = self.fill
        return out


@pytest.mark.parametrize("fill", [float("nan"), -float("inf")], ids=["nan", "-inf"])
def test_a_processor_that_leaves_nothing_to_sample_raises_as_in_stock(engine_calls, fill):
    """Every score of a row NaN or -inf: stock's sampling raises (torch.multinomial refuses the NaN
    probabilities) where the engine drew tokens anyway (a NaN was made finite; an all -inf row gave
    garbage). Greedy raises on neither side: argmax takes the first NaN (token 17 here) or, in a row
    all -inf, token 0."""
    ids, mask = left_padded_batch([6, 3], seed=7)
    model = tiny_model("llama")
    kwargs = dict(attention_mask=mask, max_new_tokens=4, pad_token_id=0, logits_processor=LogitsProcessorList([
        Spoiler(fill)]))
    with pytest.raises(RuntimeError, match="(?i)nan"):
        model.generate(ids, do_sample=True, **kwargs)
    greedy = model.generate(ids, do_sample=False, **kwargs)
    assert greedy[:, ids.shape[1]:].tolist() == [[17] * 4, [0] * 4]
    model.set_attn_implementation("hf_paged")
    with pytest.raises(InvalidDistributionError, match="(?i)nan"):  # a RuntimeError, as stock's
        model.generate(ids, do_sample=True, **kwargs)
    assert torch.equal(model.generate(ids, do_sample=False, **kwargs), greedy)
    assert engine_calls == [True]  # (the raising call returned nothing)


def test_a_row_left_nothing_to_sample_ends_alone_and_the_engine_goes_on():
    """In the engine, the row whose batch processor left no token to sample ends with that error; its
    batch's other row and a request without the processor finish as they would without it."""
    model = tiny_model("llama", "hf_paged")

    def processor(rows, token_ids, num_prompt, scores):
        out = scores.clone()
        out[[k for k, r in enumerate(rows) if r == 1]] = -float("inf")
        return out

    prompts = [list(range(3, 9)), list(range(20, 31)), list(range(40, 44))]
    sampled = SamplingParams(max_new_tokens=5, temperature=0.8, seed=3)
    engine = Engine(model, max_num_seqs=4)
    plain = engine.generate(prompts, sampled)
    spoiled = SamplingParams(max_new_tokens=5, temperature=0.8, seed=3, batch_processor=processor)
    out = engine.generate(prompts, [spoiled, spoiled, sampled])
    assert out[1].finish_reason == "error" and isinstance(out[1].error, InvalidDistributionError)
    assert "no token to sample" in str(out[1].error)
    assert [out[0].token_ids, out[2].token_ids] == [plain[0].token_ids, plain[2].token_ids]
    assert engine.cache.pool.num_free_blocks == engine.cache.pool.num_blocks


def test_a_processor_of_a_built_in_type_goes_to_stock_which_replaces_its_own(engine_calls):
    ids, mask = left_padded_batch([6, 3], seed=6)
    model = tiny_model("llama")
    mine = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, repetition_penalty=1.2,
                         logits_processor=mine)
    model.set_attn_implementation("hf_paged")
    ours = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, repetition_penalty=1.2,
                          logits_processor=mine)
    assert engine_calls == [False] and torch.equal(ours, ref)


def test_a_batch_processor_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match="batch_processor"):
        SamplingParams(batch_processor=3).validate()


def test_lockstep_defers_a_partial_batch_and_ends_one_that_never_comes_together():
    from hf_paged.engine.lockstep import MAX_LOCKSTEP_WAITS, Lockstep, LockstepError

    a, b = object(), object()  # two batch processors; r3 has none
    live = {"r0": a, "r1": a, "r2": b, "r3": None}
    lockstep = Lockstep()
    assert lockstep.deferred(dict(live), live) == (set(), {})  # every batch samples whole
    for _ in range(MAX_LOCKSTEP_WAITS - 1):  # r1 never samples: r0 waits, b's batch is whole
        assert lockstep.deferred({"r0": a, "r2": b, "r3": None}, live) == ({"r0"}, {})
    assert lockstep.deferred(dict(live), live) == (set(), {})  # the batch came together: its wait starts afresh
    for _ in range(MAX_LOCKSTEP_WAITS):
        assert lockstep.deferred({"r0": a, "r2": b}, live) == ({"r0"}, {})
    deferred, ended = lockstep.deferred({"r0": a, "r2": b}, live)
    assert deferred == {"r0"} and set(ended) == {"r0", "r1"}  # the whole batch ends, the waiting row too
    assert isinstance(ended["r1"], LockstepError) and "1000 steps" in str(ended["r1"])
