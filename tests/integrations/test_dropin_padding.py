"""Left padding whose ids are not `pad_token_id`: the drop-in `generate` still gives stock's output.

Stock hands its logits processors the padded `input_ids`, so its n-gram ban and its multi-token bad
words see the ids under the attention mask's zeros, whatever `pad_token_id` says (a tokenizer's pad
id that the generation config does not name, or padding built by hand). The engine never sees the
padding; `_padding_visible_to_processors` must hand such calls to stock from the padding ids
themselves. The model's head is biased toward the padding id 123, so greedy decoding keeps producing
it and the padding's n-grams / bad words really change stock's tokens (the engine's own output differs
from stock's here: the case is not vacuous).
"""

from __future__ import annotations

import pytest
import torch

import hf_paged  # noqa: F401  (installs the generate patch)
from hf_paged.engine import Engine
from hf_paged.sampling_params import SamplingParams
from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked

PADDING = 123  # the id under the mask; the generation config's pad_token_id is 0
OTHER = 77  # a second padding id, mixed into one row's padding
WIDTH = 9


def _pair(bias: float):
    """(stock, hf_paged) tiny Llamas with the same weights and a head bias toward PADDING."""
    models = []
    for attn in ("sdpa", "hf_paged"):
        model = tiny_model("llama", attn)
        head = model.lm_head
        biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
        with torch.no_grad():
            biased.weight.copy_(head.weight)
            biased.bias.zero_()
            biased.bias[PADDING] = bias
        model.lm_head = biased
        models.append(model.eval())
    return models


def _batch():
    """Rows of 9, 4 and 1 real tokens (none of them a padding id), left-padded with PADDING; the
    last row's padding mixes in OTHER."""
    g = torch.Generator().manual_seed(5)
    real = [t for t in torch.randint(3, VOCAB, (40,), generator=g).tolist() if t not in (PADDING, OTHER)]
    rows = [real[:9], real[9:13], real[13:14]]
    paddings = [[], [PADDING] * 5, [PADDING, PADDING, PADDING, OTHER, OTHER, PADDING, OTHER, PADDING]]
    input_ids = torch.tensor([pad + row for pad, row in zip(paddings, rows)])
    attention_mask = torch.tensor([[0] * len(pad) + [1] * len(row) for pad, row in zip(paddings, rows)])
    assert input_ids.shape == (3, WIDTH)
    return input_ids, attention_mask, rows


def _cases():
    _, _, rows = _batch()
    return {
        "ngram1": dict(no_repeat_ngram_size=1),
        "ngram2": dict(no_repeat_ngram_size=2),
        "ngram3": dict(no_repeat_ngram_size=3),
        # Row 2's last padding id and its one real token, then PADDING: stock bans it at row 2's first step.
        "bad_words": dict(bad_words_ids=[[PADDING, rows[2][0], PADDING], [9]]),
        "bad_words_other": dict(bad_words_ids=[[OTHER, PADDING, rows[2][0], PADDING]]),
    }


GEN = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=2)


@pytest.mark.parametrize("name", list(_cases()))
def test_padding_ids_other_than_pad_token_id_give_stocks_output(name):
    stock, ours = _pair(bias=6.0)
    input_ids, attention_mask, rows = _batch()
    kwargs = {**GEN, **_cases()[name]}
    ref = stock.generate(input_ids, attention_mask=attention_mask, **kwargs)
    out = ours.generate(input_ids, attention_mask=attention_mask, **kwargs)
    assert torch.equal(out, ref), (name, out[:, WIDTH:].tolist(), ref[:, WIDTH:].tolist())
    # Not vacuous: the engine alone (which never sees the padding) decodes differently.
    params = SamplingParams(max_new_tokens=8, no_repeat_ngram_size=kwargs.get("no_repeat_ngram_size", 0),
                            bad_words_ids=kwargs.get("bad_words_ids"))
    engine = [o.outputs[0].token_ids for o in Engine(ours).generate(rows, params)]
    assert engine != ref[:, WIDTH:].tolist(), name


def test_the_engine_still_serves_when_the_padding_cannot_matter(engine_calls):
    """No padding id among a row's tokens, and no bad word holding one: the engine serves the call."""
    stock, ours = _pair(bias=0.0)
    input_ids, attention_mask, _ = _batch()
    for extra in (dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=3), dict(bad_words_ids=[[5, 6, 9]])):
        engine_calls.clear()
        kwargs = {**GEN, **extra}
        ref = stock.generate(input_ids, attention_mask=attention_mask, **kwargs)
        out = ours.generate(input_ids, attention_mask=attention_mask, **kwargs)
        assert not set(out[:, WIDTH:].flatten().tolist()) & {PADDING, OTHER}  # the premise
        assert torch.equal(out, ref) and engine_calls == [True], extra
