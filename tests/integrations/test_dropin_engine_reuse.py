"""The drop-in `generate` keeps one engine per model across calls: its pool and prefix cache survive,
the pool grows when a call needs more, a weights change invalidates cached prefixes, and
`hf_paged.release(model)` frees it."""

from __future__ import annotations

import copy
import pickle

import torch

import hf_paged
from hf_paged.engine import Engine
from tiny_models import VOCAB, left_padded_batch, tiny_model

SYSTEM = 300  # tokens of the shared system prompt


def _batch(call: int, system: list[int]):
    g = torch.Generator().manual_seed(100 + call)
    rows = [system + torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(2, 12, (8,), generator=g)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


def test_successive_calls_share_the_system_prompt_through_one_engine(monkeypatch):
    built = []
    original_init = Engine.__init__

    def counting_init(self, *args, **kwargs):
        built.append(1)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "__init__", counting_init)
    stock = tiny_model("llama")
    model = tiny_model("llama", "hf_paged")
    system = torch.randint(3, VOCAB, (SYSTEM,), generator=torch.Generator().manual_seed(0)).tolist()
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    hits = []
    for call in range(20):
        ids, mask = _batch(call, system)
        out = model.generate(ids, attention_mask=mask, **gen)
        if call in (0, 7, 19):
            assert torch.equal(out, stock.generate(ids, attention_mask=mask, **gen)), call
        hits.append(model.hf_paged_last_metrics["vllm:prefix_cache_hits"])
    assert len(built) == 1  # one engine for all 20 calls
    # The first call computes the system prompt once (its 8 rows share it within the call); every
    # later call takes all of its full blocks from the cache, for all 8 rows.
    full = SYSTEM // 16 * 16
    assert hits[0] == 7 * full
    assert all(h >= 8 * full for h in hits[1:]), hits

    # An optimizer step changes the weights: nothing computed before may be hit.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    model.train()
    loss = model(input_ids=torch.tensor([system[:32]]), labels=torch.tensor([system[:32]])).loss
    loss.backward()
    optimizer.step()
    model.eval()
    ids, mask = _batch(99, system)
    model.generate(ids, attention_mask=mask, **gen)
    assert model.hf_paged_last_metrics["vllm:prefix_cache_hits"] == 7 * full  # only within this call
    assert len(built) == 1

    assert hf_paged.release(model) and not hf_paged.release(model)
    model.generate(ids, attention_mask=mask, **gen)
    assert len(built) == 2


def test_the_pool_grows_when_a_call_needs_more_and_copies_get_no_engine():
    model = tiny_model("llama", "hf_paged")
    small = left_padded_batch([4, 6], seed=1)
    model.generate(small[0], attention_mask=small[1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    slot = model.__dict__["_hf_paged_engine"]
    engine, blocks = slot.engine, slot.engine.cache.pool.num_blocks
    big = left_padded_batch([40, 70, 33, 90, 12, 64], seed=2)
    stock = tiny_model("llama")
    gen = dict(max_new_tokens=30, do_sample=False, pad_token_id=0)
    out = model.generate(big[0], attention_mask=big[1], **gen)
    assert torch.equal(out, stock.generate(big[0], attention_mask=big[1], **gen))
    assert slot.engine is engine and engine.cache.pool.num_blocks > blocks
    twin = copy.deepcopy(model)
    assert twin.__dict__["_hf_paged_engine"].engine is None
    assert pickle.loads(pickle.dumps(model.__dict__["_hf_paged_engine"])).engine is None


def test_a_cast_model_gets_a_new_engine_whose_pool_has_the_new_dtype(monkeypatch):
    """TRL casts the policy to bf16 before its rollouts: the engine kept for the fp32 model (fp32 pool)
    must not serve the bf16 one."""
    built = []
    original = Engine.__init__

    def spy(self, model, *args, **kwargs):
        built.append(next(model.parameters()).dtype)
        original(self, model, *args, **kwargs)

    monkeypatch.setattr(Engine, "__init__", spy)
    ours, stock = tiny_model("llama", "hf_paged"), tiny_model("llama", "sdpa")
    ids, mask = left_padded_batch([5, 12, 9])
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ours.generate(ids, attention_mask=mask, **gen)
    ours.generate(ids, attention_mask=mask, **gen)
    assert built == [torch.float32]  # one engine for both fp32 calls
    ours.to(torch.bfloat16)
    stock.to(torch.bfloat16)
    out = ours.generate(ids, attention_mask=mask, **gen)
    assert built == [torch.float32, torch.bfloat16]
    ref = stock.generate(ids, attention_mask=mask, **gen)
    assert (out == ref).all(dim=1).float().mean() >= 2 / 3  # bf16 rounding may flip a late token
