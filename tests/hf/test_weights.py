"""The prefix cache never serves K/V computed under other weights.

Each common way of changing weights (an optimizer step, `p.data.copy_`, `p.data = t`,
`load_state_dict`, `model.to(dtype)`, PEFT adapter switches) runs on one persistent `Engine`: generate,
change the weights, generate the same prompt again, and compare with stock transformers under the new
weights. Each also runs with detection disabled (the fingerprint patched to a constant), which must
serve the stale prefix and change the greedy output, so the engine tests cannot pass by accident.
A write the sampled checksum cannot see is fixed by `hf_paged.invalidate`.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import hf_paged
import hf_paged.engine.engine as engine_module
import hf_paged.hf as hf_module
import hf_paged.hf.planning as planning_module
import hf_paged.hf.weights as weights_module
from hf_paged import Engine, SamplingParams
from hf_paged.hf.weights import weights_fingerprint
from tiny_models import VOCAB, tiny_model

BLOCK_SIZE = 4
NEW = 10
# 40 tokens = 10 full blocks; an identical prompt keeps its last block out of the hit (36 tokens).
PROMPT = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
PARAMS = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)
# peft 0.21 calls a transformers method that transformers 5 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _hits(engine) -> int:
    return engine.metrics()["vllm:prefix_cache_hits"]


def _generate(engine) -> list[int]:
    return engine.generate([PROMPT], PARAMS)[0].token_ids


def _stock(model) -> list[int]:
    """Stock greedy generate (sdpa, DynamicCache) with `model`'s current weights, on the same model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation("sdpa")
    try:
        ids = torch.tensor([PROMPT])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False)
    finally:
        base.set_attn_implementation("hf_paged")
    return out[0, len(PROMPT):].tolist()


def _disable_detection(monkeypatch) -> None:
    """Make every weights fingerprint the same constant, wherever it was imported."""
    for module in (weights_module, hf_module, planning_module, engine_module):
        if hasattr(module, "weights_fingerprint"):
            monkeypatch.setattr(module, "weights_fingerprint", lambda model: 0)


# ---------------------------------------------------------------- the changes
def _other_weights() -> dict[str, torch.Tensor]:
    """A different random model's state dict (same architecture): a weight sync's new weights."""
    return tiny_model("llama", seed=1).state_dict()


def _optimizer_step(model):
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([PROMPT])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.eval()


def _data_copy(model):  # how EMA and RL weight sync write: no version counter bump
    new = _other_weights()
    for name, p in model.named_parameters():
        p.data.copy_(new[name])


def _data_assign(model):
    new = _other_weights()
    for name, p in model.named_parameters():
        p.data = new[name].clone()


def _load_state_dict(model):
    model.load_state_dict(_other_weights())


def _to_dtype_round_trip(model):
    # float8_e5m2 (2 mantissa bits): rounding alone changes this tiny model's greedy tokens, which
    # fp16 or bf16 rounding does not (their round trips are checked in test_fingerprint_sees).
    model.to(torch.float8_e5m2).to(torch.float32)


def _lora_model(*adapters: str):
    """A tiny llama wrapped by peft with LoRA adapters on q/k/v (so they change K/V). Random, non-zero
    `lora_B` (init_lora_weights=False), different per adapter; the first adapter is active."""
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", "hf_paged")
    peft_model = None
    for seed, name in enumerate(adapters, start=1):
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                                 init_lora_weights=False)
        torch.manual_seed(seed)
        if peft_model is None:
            peft_model = peft.get_peft_model(model, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    peft_model.set_adapter(adapters[0])
    return peft_model.eval()


def _lora_disabled():
    peft_model = _lora_model("one")
    peft_model.base_model.disable_adapter_layers()
    return peft_model


def _plain():
    return tiny_model("llama", "hf_paged")


CHANGES = {
    "optimizer_step": (_plain, _optimizer_step),
    "data_copy_": (_plain, _data_copy),
    "data_assign": (_plain, _data_assign),
    "load_state_dict": (_plain, _load_state_dict),
    "to_dtype_round_trip": (_plain, _to_dtype_round_trip),
    "peft_set_adapter": (lambda: _lora_model("one", "two"), lambda m: m.set_adapter("two")),
    "peft_disable_adapters": (lambda: _lora_model("one"), lambda m: m.base_model.disable_adapter_layers()),
    "peft_enable_adapters": (_lora_disabled, lambda m: m.base_model.enable_adapter_layers()),
}


@pytest.mark.parametrize("detection", [True, False], ids=["detected", "detection_disabled"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_weight_change_never_serves_a_stale_prefix(change, detection, monkeypatch):
    make, apply_change = CHANGES[change]
    model = make()
    if not detection:
        _disable_detection(monkeypatch)
    engine = Engine(model, block_size=BLOCK_SIZE)
    before = _generate(engine)
    hits_before, epoch_before = _hits(engine), engine.cache.weights.epoch
    apply_change(model)
    after = _generate(engine)
    hits_after, epoch_after = _hits(engine), engine.cache.weights.epoch
    expected = _stock(model)
    assert expected != before  # the change is large enough to move the greedy tokens
    if detection:
        assert after == expected
        assert hits_after == hits_before  # nothing computed under the old weights was served
        assert epoch_after == epoch_before + 1
        assert _generate(engine) == expected
        assert engine.cache.weights.epoch == epoch_after  # nothing changed since: no new epoch
    else:  # what the detection prevents: the stale prefix is served, and the output is wrong
        assert hits_after > hits_before
        assert after != expected


@pytest.mark.parametrize("detection", [True, False], ids=["detected", "detection_disabled"])
def test_peft_disable_adapter_context(detection, monkeypatch):
    """`PeftModel.disable_adapter()` switches adapters off for a `with` block, and back on after."""
    model = _lora_model("one")
    if not detection:
        _disable_detection(monkeypatch)
    engine = Engine(model, block_size=BLOCK_SIZE)
    with_adapter = _generate(engine)
    with model.disable_adapter():
        hits = _hits(engine)
        without = _generate(engine)
        expected = _stock(model)
        served_stale = _hits(engine) > hits
    assert expected != with_adapter
    if detection:
        assert without == expected and not served_stale
        hits = _hits(engine)
        assert _generate(engine) == with_adapter == _stock(model)  # enabled again
        assert _hits(engine) == hits  # blocks cached while disabled are not served
    else:
        assert served_stale and without != expected


def _write_unseen(model) -> int:
    """Add 1.0 through `.data` (no version bump) to the embedding rows of the prompt's tokens, keeping
    only rows where the fingerprint does not change (no sampled element). Returns how many rows."""
    embedding = model.get_input_embeddings().weight
    fingerprint = weights_fingerprint(model)
    num_rows = 0
    for token in sorted(set(PROMPT)):
        saved = embedding.data[token].clone()
        embedding.data[token] += 1.0
        if weights_fingerprint(model) == fingerprint:
            num_rows += 1
        else:
            embedding.data[token] = saved  # bit for bit: the fingerprint is as before
    assert weights_fingerprint(model) == fingerprint
    return num_rows


def test_invalidate_covers_a_write_the_checksum_cannot_see():
    model = tiny_model("llama", "hf_paged")
    engine = Engine(model, block_size=BLOCK_SIZE)
    before = _generate(engine)
    assert _write_unseen(model) >= len(set(PROMPT)) // 2
    expected = _stock(model)
    assert expected != before
    hits = _hits(engine)
    assert _generate(engine) != expected and _hits(engine) > hits  # the blind spot: served stale
    hf_paged.invalidate(model)
    hits = _hits(engine)
    assert _generate(engine) == expected
    assert _hits(engine) == hits


# ---------------------------------------------------------------- the fingerprint alone
def _no_grad_in_place(model):
    with torch.no_grad():
        model.lm_head.weight.mul_(1.01)


def _detach_copy(model):
    weight = model.lm_head.weight
    weight.detach().copy_(torch.zeros_like(weight))


def _data_copy_one_parameter(model):
    weight = model.model.layers[2].mlp.down_proj.weight
    weight.data.copy_(torch.randn_like(weight))


def _data_assign_same_values(model):
    weight = model.model.norm.weight
    weight.data = weight.data.clone()


def _new_parameter(model):
    model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight.detach().clone())


def _disable_one_layer(peft_model):
    peft_model.get_base_model().model.layers[1].self_attn.k_proj.enable_adapters(False)


def _set_lora_scale(peft_model):
    for module in peft_model.modules():
        if hasattr(module, "set_scale") and hasattr(module, "scaling"):
            module.set_scale("one", 3.0)


FINGERPRINT_CHANGES = {
    "optimizer_step": (_plain, _optimizer_step),
    "no_grad_in_place": (_plain, _no_grad_in_place),
    "detach_copy_": (_plain, _detach_copy),
    "data_in_place": (_plain, lambda m: m.model.norm.weight.data.mul_(1.01)),
    "data_copy_one_parameter": (_plain, _data_copy_one_parameter),
    "data_assign_same_values": (_plain, _data_assign_same_values),
    "new_parameter": (_plain, _new_parameter),
    "load_state_dict": (_plain, _load_state_dict),
    "half": (_plain, lambda m: m.half()),
    "to_bfloat16": (_plain, lambda m: m.to(torch.bfloat16)),
    "fp16_round_trip": (_plain, lambda m: m.half().float()),
    "bf16_round_trip": (_plain, lambda m: m.to(torch.bfloat16).to(torch.float32)),
    "invalidate": (_plain, hf_paged.invalidate),
    "invalidate_submodule": (_plain, lambda m: hf_paged.invalidate(m.lm_head)),
    "peft_set_adapter": (lambda: _lora_model("one", "two"), lambda m: m.set_adapter("two")),
    "peft_layer_enable_adapters": (lambda: _lora_model("one"), _disable_one_layer),
    "peft_merge": (lambda: _lora_model("one"), lambda m: m.merge_adapter()),
    "peft_set_scale": (lambda: _lora_model("one"), _set_lora_scale),
    "peft_delete_adapter": (lambda: _lora_model("one", "two"), lambda m: m.delete_adapter("two")),
}


@pytest.mark.parametrize("change", sorted(FINGERPRINT_CHANGES))
def test_fingerprint_sees(change):
    """The fingerprint of the model the engine holds (peft's inner model for a `PeftModel`) changes."""
    make, apply_change = FINGERPRINT_CHANGES[change]
    model = make()
    watched = model.get_base_model() if hasattr(model, "get_base_model") else model
    before = weights_fingerprint(watched)
    apply_change(model)
    assert weights_fingerprint(watched) != before


def test_invalidate_through_a_wrapper():
    peft_model = _lora_model("one")
    inner = peft_model.get_base_model()
    before = weights_fingerprint(inner)
    hf_paged.invalidate(peft_model)
    assert weights_fingerprint(inner) != before


@pytest.mark.parametrize("make", [_plain, lambda: _lora_model("one", "two")], ids=["plain", "peft"])
def test_fingerprint_is_stable(make):
    """Nothing but a weight change moves it: not a forward, not train()/eval()."""
    model = make()
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        model(input_ids=ids)
    model.train()
    model.eval()
    assert weights_fingerprint(model) == before


def test_fingerprint_holds_no_parameter_memory():
    """`p.data = t` frees the old tensor as it would without hf_paged."""
    model = tiny_model("llama")
    weights_fingerprint(model)
    weight = model.lm_head.weight
    old = StorageWeakRef(weight.untyped_storage())
    weight.data = torch.randn_like(weight)
    gc.collect()
    assert old.expired()
    weights_fingerprint(model)


def test_fingerprint_of_unusual_parameters():
    """Meta, empty, non-contiguous and tied parameters: no error, and the readable ones are watched."""
    model = torch.nn.Module()
    model.meta = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    model.empty = torch.nn.Parameter(torch.empty(0))
    model.transposed = torch.nn.Parameter(torch.randn(8, 40).t())  # non-contiguous: read by take
    model.child = torch.nn.Linear(3, 3)
    model.tied = model.child  # a shared module: walked twice, which changes nothing
    model.register_module("gone", None)
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before
    model.transposed.data.mul_(2)
    assert weights_fingerprint(model) != before
