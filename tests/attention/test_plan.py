"""The attention plan (`attention/plan.py`): FlashInfer's split of `plan()` once per step and `run()`
per layer.

Checked here: one plan per forward step (never per layer), launch plans made once per layer kind,
no HF_PAGED_* environment read and no tuning lookup in the per-layer path, and the split-K scratch
reused across layers and across steps of the same shapes. The kernels' own parity is the other
attention tests'; these compare the planned launches with the unplanned ones and the reference.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import pytest
import torch

import hf_paged
from hf_paged.attention import dispatch, reference
from hf_paged.attention.metadata import build_packed_metadata
from hf_paged.attention.plan import StepPlan
from hf_paged.attention.workspace import Workspace
from tiny_models import VOCAB, tiny_model

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="runs the Triton kernels under the interpreter (no CUDA)")


class EnvironSpy(MutableMapping):
    """Stands in for `os.environ`, recording every HF_PAGED_* key read and whether a layer read it."""

    def __init__(self, environ):
        self._environ = environ
        self.in_layer = False
        self.reads: list[tuple[str, bool]] = []  # (key, read inside a layer's store_kv / attention)

    def _note(self, key):
        if isinstance(key, str) and key.startswith("HF_PAGED"):
            self.reads.append((key, self.in_layer))

    def __getitem__(self, key):
        self._note(key)
        return self._environ[key]

    def get(self, key, default=None):
        self._note(key)
        return self._environ.get(key, default)

    def __contains__(self, key):
        self._note(key)
        return key in self._environ

    def __setitem__(self, key, value):
        self._environ[key] = value

    def __delitem__(self, key):
        del self._environ[key]

    def __iter__(self):
        return iter(self._environ)

    def __len__(self):
        return len(self._environ)

    def copy(self):
        return dict(self._environ)


def _spy_engine_run(monkeypatch, backend: str, prompts, max_new_tokens: int):
    """Generate through the engine, recording every plan built, every layer call and every HF_PAGED_*
    environment read. Returns (plans, number of forwards, layer calls, env spy, outputs, engine)."""
    monkeypatch.setenv("HF_PAGED_BACKEND", backend)
    spy = EnvironSpy(os.environ)
    monkeypatch.setattr(os, "environ", spy)
    plans, layer_calls = [], []
    make_plan = dispatch.plan

    def counting_plan(*args, **kwargs):
        plans.append(make_plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(dispatch, "plan", counting_plan)
    for name in ("store_kv", "paged_attention"):
        original = getattr(dispatch, name)

        def in_layer(*args, _original=original, _name=name, **kwargs):
            if _name == "paged_attention":
                layer_calls.append(kwargs["plan"])
            spy.in_layer = True
            try:
                return _original(*args, **kwargs)
            finally:
                spy.in_layer = False

        monkeypatch.setattr(dispatch, name, in_layer)

    # Planning a layer kind (on its first layer) may read the tuning's environment; nothing else may.
    plan_triton = StepPlan._plan_triton

    def planning(self, *args, **kwargs):
        was, spy.in_layer = spy.in_layer, False
        try:
            return plan_triton(self, *args, **kwargs)
        finally:
            spy.in_layer = was

    monkeypatch.setattr(StepPlan, "_plan_triton", planning)
    model = tiny_model("llama", "hf_paged")
    engine = hf_paged.Engine(model, block_size=4, max_num_batched_tokens=8)
    forwards = []
    run_forward = engine.runner.forward
    engine.runner.forward = lambda *a, **k: forwards.append(1) or run_forward(*a, **k)
    outs = engine.generate(prompts, hf_paged.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    return plans, len(forwards), layer_calls, spy, outs, model


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_one_plan_per_step_and_no_environment_read_per_layer(monkeypatch, backend):
    """Prompts of 3, 9 and 6 tokens through 8-token steps (chunked prefill, mixed prefill and decode
    steps, then decode): every forward builds exactly one plan, which every layer's attention gets;
    each plan makes one launch plan (llama: one layer kind, one KV group), not one per layer; the
    backend is read from the environment once per step and never inside a layer."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 6)]
    plans, num_forwards, layer_calls, spy, outs, model = _spy_engine_run(monkeypatch, backend, prompts, 4)
    num_layers = model.config.num_hidden_layers

    assert num_forwards >= 5 and len(plans) == num_forwards
    assert len(layer_calls) == num_forwards * num_layers
    for step, plan in enumerate(plans):  # each step's layers all got that step's plan
        assert all(p is plan for p in layer_calls[step * num_layers:(step + 1) * num_layers])
        assert plan.backend == backend and plan.num_layer_plans == 1
    reads_in_layers = [key for key, in_layer in spy.reads if in_layer]
    assert reads_in_layers == []
    assert [key for key, _ in spy.reads].count("HF_PAGED_BACKEND") == num_forwards
    assert all(len(o.token_ids) == 4 for o in outs)


def test_backend_switch_between_steps_is_obeyed(monkeypatch):
    """The backend is the plan's: a step planned under one HF_PAGED_BACKEND keeps it for all its
    layers, and the next step reads the environment afresh."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    meta = build_packed_metadata(q_lens=[1], seq_lens=[1], copies=[], device=torch.device("cpu"),
                                 slots=[[0]], block_tables=[[0]])
    plan = dispatch.plan(meta)
    monkeypatch.setenv("HF_PAGED_BACKEND", "bogus")  # read by the next plan only
    key_cache, value_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    dispatch.store_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), key_cache, value_cache, meta.slot_mapping, plan=plan)
    assert plan.backend == "torch" and key_cache[0, 0].eq(1).all()
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND"):
        dispatch.plan(meta)


# ---------------------------------------------------------------------------------------------- #
# The Triton decode plan: tiling, splits, config and scratch chosen once, reused by every layer


def _decode_step(seq_lens, block_size, num_kv_heads, group, head_dim, seed):
    """A decode step (one query per sequence) over random, non-contiguous block tables: the step's
    metadata, and per layer the query and K/V caches (three layers)."""
    gen = torch.Generator().manual_seed(seed)
    tables, next_free = [], 0
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    for n in seq_lens:
        count = -(-n // block_size)
        tables.append(order[next_free:next_free + count])
        next_free += count
    slots = [[t[(n - 1) // block_size] * block_size + (n - 1) % block_size] for t, n in zip(tables, seq_lens)]
    meta = build_packed_metadata(q_lens=[1] * len(seq_lens), seq_lens=seq_lens, copies=[],
                                 device=torch.device("cpu"), slots=slots, block_tables=tables)
    layers = []
    for _ in range(3):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        layers.append((torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen),
                       torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)))
    return meta, layers


def _attend(meta, query, key_cache, value_cache, plan):
    return dispatch.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                    meta.cu_seqlens_q, meta.max_seqlen_q, meta.max_seqlen_k, 0.125, plan=plan)


@needs_interpreter
def test_decode_plan_is_made_once_and_its_scratch_reused(monkeypatch):
    """Two steps of the same shapes, three layers each, with two splits of the key axis (300 keys):
    the tiling, split count and config are chosen on each step's first layer only, the partial
    outputs and log-sum-exps are views of the same workspace memory in every layer and step, and the
    output matches the reference and the unplanned launch exactly."""
    from hf_paged.attention.triton import decode

    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    calls = {"default_num_splits": 0, "plan_config": 0, "tuning_key": 0}
    for name in calls:
        original = getattr(decode, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(decode, name, counted)
    workspace = Workspace()
    pointers = set()
    for step in range(2):
        meta, layers = _decode_step([300, 40], 16, num_kv_heads=2, group=3, head_dim=32, seed=step)
        plan = dispatch.plan(meta, workspace)
        for query, key_cache, value_cache in layers:
            out = _attend(meta, query, key_cache, value_cache, plan)
            (launch,) = plan.launch_plans
            assert launch.num_splits == 2
            pointers.add((launch.partial_out.data_ptr(), launch.partial_lse.data_ptr()))
            expected = reference.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                                 meta.cu_seqlens_q, meta.max_seqlen_q, meta.max_seqlen_k, 0.125)
            torch.testing.assert_close(out.double(), expected.double(), atol=1e-5, rtol=1e-5)  # fp32
            assert torch.equal(out, _attend(meta, query, key_cache, value_cache, None))
        assert plan.num_layer_plans == 1
        if step == 0:
            assert workspace.num_allocations == 2  # partial outputs and log-sum-exps
            planned = dict(calls)
    assert len(pointers) == 1 and workspace.num_allocations == 2
    # The second step planned once more (its first layer); its other layers looked nothing up. The
    # unplanned launches (one per layer) plan for themselves each time.
    assert all(calls[name] - planned[name] == planned[name] for name in calls)
    assert planned["default_num_splits"] == 1 + 3


@needs_interpreter
def test_smaller_steps_reuse_the_scratch_and_plans_refuse_other_shapes(monkeypatch):
    """A step needing less scratch than an earlier one takes a view of the same buffer; a launch
    plan used with inputs of other shapes is refused rather than launched out of bounds."""
    from hf_paged.attention.triton import decode

    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    workspace = Workspace()
    big, big_layers = _decode_step([300, 40, 260], 16, num_kv_heads=1, group=2, head_dim=16, seed=3)
    small, small_layers = _decode_step([280, 9], 16, num_kv_heads=1, group=2, head_dim=16, seed=4)
    plans = []
    for meta, layers in ((big, big_layers), (small, small_layers)):
        plans.append(dispatch.plan(meta, workspace))
        _attend(meta, *layers[0], plans[-1])
    (first,), (second,) = (p.launch_plans for p in plans)
    assert first.num_splits == second.num_splits == 2
    assert first.partial_out.data_ptr() == second.partial_out.data_ptr() and workspace.num_allocations == 2
    query, key_cache, value_cache = small_layers[0]
    with pytest.raises(ValueError, match="the plan was made for"):
        decode.paged_decode(query, key_cache, value_cache, small.block_tables, small.seq_lens, small.cu_seqlens_q,
                            1, small.max_seqlen_k, 0.125, plan=first)
