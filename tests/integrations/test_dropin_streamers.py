"""Drop-in `generate` with a streamer runs through the engine and feeds the streamer exactly what
stock feeds it: the prompt ids, then one `[batch]` tensor per step (finished rows get the pad id),
then `end()`."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

import hf_paged
from tiny_models import left_padded_batch, tiny_model

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts: list[list] = []
        self.ended = 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_streamer_gets_stocks_puts_for_a_padded_batch_with_early_stops(arch, engine_streams):
    input_ids, attention_mask = left_padded_batch([5, 17, 9], seed=3)
    model = tiny_model(arch)
    probe = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
    eos = int(probe[1, input_ids.shape[1] + 3])  # row 1 stops after 4 tokens, others maybe later
    gen = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    stock = Recorder()
    ref = model.generate(input_ids, attention_mask=attention_mask, streamer=stock, **gen)
    model.set_attn_implementation("hf_paged")
    ours = Recorder()
    out = model.generate(input_ids, attention_mask=attention_mask, streamer=ours, **gen)
    assert engine_streams == [3]  # the engine served it
    assert torch.equal(out, ref)
    assert ours.puts == stock.puts and ours.ended == stock.ended == 1


def test_streamer_with_scores_falls_back_to_stock_and_is_fed_once(engine_streams):
    input_ids, attention_mask = left_padded_batch([4, 6], seed=1)
    model = tiny_model("llama", "hf_paged")
    ours = Recorder()
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False, streamer=ours,
                   output_scores=True, return_dict_in_generate=True)
    assert engine_streams == [] and len(ours.puts) == 1 + 5 and ours.ended == 1


@pytest.mark.slow
def test_text_iterator_streamer_in_a_thread_yields_stocks_text_on_smollm2(engine_streams):
    from hf_paged.defaults.models import load_default

    model, tokenizer = load_default()
    chat = [{"role": "user", "content": "Name three colours of the rainbow, then say goodbye in French."}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)

    def streamed(m):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        worker = threading.Thread(target=m.generate, kwargs=dict(**inputs, max_new_tokens=48, do_sample=False,
                                                                 streamer=streamer))
        worker.start()
        text = "".join(streamer)
        worker.join()
        return text

    stock = streamed(model)
    model.set_attn_implementation("hf_paged")
    try:
        ours = streamed(model)
    finally:
        model.set_attn_implementation("sdpa")
    assert engine_streams == [1]
    assert ours == stock and len(stock) > 20
    assert hf_paged  # the package is imported (its generate patch is installed)
