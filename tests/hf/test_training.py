"""A model loaded with "hf_paged" trains and evaluates like stock, and generate/train/generate works."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_paged.hf.cache import PagedCache
from tiny_models import with_cache, left_padded_batch, tiny_model

# The dense path is transformers' own sdpa/eager, so fp32 gradients agree to rounding.
GRAD_ATOL = 1e-6


def _loss_and_grads(model, input_ids, attention_mask):
    model.zero_grad()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    loss = model(input_ids, attention_mask=attention_mask, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch,stock", [("llama", "sdpa"), ("gemma2", "eager"), ("qwen2", "sdpa")])
def test_gradients_match_stock(arch, stock):
    input_ids, attention_mask = left_padded_batch([7, 30, 18], seed=3)
    model = tiny_model(arch, stock).train()
    ref_loss, ref_grads = _loss_and_grads(model, input_ids, attention_mask)
    model.set_attn_implementation("hf_paged")
    loss, grads = _loss_and_grads(model, input_ids, attention_mask)
    torch.testing.assert_close(loss, ref_loss, atol=GRAD_ATOL, rtol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=GRAD_ATOL, rtol=1e-5, msg=name)


def _train_step(model, input_ids, attention_mask, lr=0.5):
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()


def test_generate_train_generate_matches_stock():
    input_ids, attention_mask = left_padded_batch([9, 21], seed=4)
    stock = tiny_model("llama")
    paged = copy.deepcopy(stock)
    paged.set_attn_implementation("hf_paged")
    for model in (stock, paged):
        model.outputs = [model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10,
                                        do_sample=False)]
        _train_step(model, input_ids, attention_mask)
        model.outputs.append(model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10,
                                            do_sample=False))
    assert torch.equal(paged.outputs[0], stock.outputs[0])
    assert torch.equal(paged.outputs[1], stock.outputs[1])
    assert not torch.equal(stock.outputs[0], stock.outputs[1])  # the step really changed the model


def test_prefix_cache_is_not_reused_after_weights_change():
    """A cache reused across requests must not serve K/V computed with the old weights."""
    input_ids, attention_mask = left_padded_batch([40], seed=5)  # 2 full blocks of 16
    stock = tiny_model("llama")
    paged = copy.deepcopy(stock)
    paged.set_attn_implementation("hf_paged")
    cache = PagedCache(paged.config)

    first = paged.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, **with_cache(cache))
    cache.reset()
    again = paged.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, **with_cache(cache))
    assert torch.equal(first, again)
    assert cache.pool.num_prefix_hits == 2  # unchanged weights: the prompt's blocks were reused

    for model in (stock, paged):
        _train_step(model, input_ids, attention_mask, lr=2.0)
    cache.reset()
    after = paged.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, **with_cache(cache))
    expected = stock.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    assert cache.pool.num_prefix_hits == 2  # no stale hit after the optimizer step
    assert torch.equal(after, expected)
    assert not torch.equal(after, first)
