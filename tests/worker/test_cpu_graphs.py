"""Compiled decode steps on CPU (`worker/cpu_graphs.py`): the model's forward compiled by Inductor per
batch bucket, each layer's K/V write and paged attention one opaque op.

The oracle is stock transformers: greedy ids identical to stock `generate` (sdpa, DynamicCache) on a
tiny Llama whose attention is peaked (q and k scaled so that a wrong key or position changes the next
token), and logits within fp32 tolerance of the eager engine's. The model and its compiled graphs are
shared by the module (each compilation takes seconds); every test builds its own engine over it.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hf_paged import Engine, SamplingParams
from hf_paged.attention import cpu_kernel, dispatch
from hf_paged.worker import cpu_graphs
from hf_paged.worker.cpu_graphs import check_cpu_graphs, compile_refusal
from layer_kinds import greedy_alone
from tiny_models import CONFIGS, VOCAB, tiny_model

# Inductor fuses the norms, rotary and MLP element-wise work into other loops than eager's kernels:
# fp32 rounding differs in the last bits, amplified by the peaked attention.
LOGITS_ATOL = 1e-4
NEW_TOKENS = 10
# Prompt lengths (block size 4: most cross a block boundary while they decode), run in steps of 1, 3
# and 8 sequences: batch buckets 1 (its own static graph) and 8 (the graph of every larger bucket).
LENGTHS = {1: [6], 3: [3, 9, 14], 8: [2, 4, 5, 7, 8, 11, 16, 21]}


def _peaked(model):
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10 ** 0.5)  # scores x10: a sharp choice of keys
            layer.self_attn.k_proj.weight.mul_(10 ** 0.5)
    return model


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def models():
    """(the model the engines serve, the same weights under stock sdpa)."""
    return _peaked(tiny_model("llama", "hf_paged")), _peaked(tiny_model("llama", "sdpa"))


def _engine(model, **kwargs):
    kwargs = {"max_num_seqs": 8, "block_size": 4, "num_blocks": 128, "cuda_graph_batch_sizes": (1, 8),
              "cuda_graph_max_seqlens": (16, 64), **kwargs}
    return Engine(model, **kwargs)


def test_default_batch_buckets():
    """By default compiled CPU steps serve batches up to 8 (past a few rows the linears dominate);
    the caller's buckets are taken as given."""
    assert cpu_graphs.batch_buckets(64) == (1, 2, 4, 8)
    assert cpu_graphs.batch_buckets(3) == (1, 2, 3)
    assert cpu_graphs.batch_buckets(64, [16, 1]) == (1, 16)
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        cpu_graphs.batch_buckets(8, [16])


def _run(engine, prompts):
    return engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                                   output_logits=True))


def _assert_same(reference, outputs):
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    for ref, out in zip(reference, outputs):
        torch.testing.assert_close(torch.stack(out.outputs[0].logits), torch.stack(ref.outputs[0].logits),
                                   atol=LOGITS_ATOL, rtol=0)


# ---------------------------------------------------------------------- parity
@pytest.mark.parametrize("num_seqs", sorted(LENGTHS))
def test_compiled_steps_match_stock_and_eager(models, num_seqs):
    model, stock = models
    prompts = _prompts(LENGTHS[num_seqs], seed=num_seqs)
    eager = _run(_engine(model, cpu_graphs=False), prompts)
    engine = _engine(model, cpu_graphs=True)
    compiled = _run(engine, prompts)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.num_replays >= NEW_TOKENS - 2  # every decode step but the last few
    assert {k.batch_size for k in graphs.replayed_keys} == {1 if num_seqs == 1 else 8}
    want = greedy_alone(stock, prompts, NEW_TOKENS)
    assert [o.token_ids for o in compiled] == want
    _assert_same(eager, compiled)


def test_plain_layers_skip_the_eager_layer_code(models, monkeypatch):
    """A plain layer's K/V write and attention skip the eager step's per-layer code (`PagedCache.update`,
    the attention function's checks, the per-layer planning of `dispatch.paged_attention`): decode steps
    call none of them where the native kernel runs, the eager prefill does."""
    model, _ = models
    engine = _engine(model, cpu_graphs=True)
    update, attention, layers, calls = type(engine.cache).update, dispatch.paged_attention, [], []

    def counting(self, key_states, value_states, layer_idx, *args, **kwargs):
        layers.append(layer_idx)
        return update(self, key_states, value_states, layer_idx, *args, **kwargs)

    def counting_attention(*args, **kwargs):
        calls.append(args[0].shape[0])
        return attention(*args, **kwargs)

    monkeypatch.setattr(type(engine.cache), "update", counting)
    monkeypatch.setattr(dispatch, "paged_attention", counting_attention)
    _run(engine, _prompts([5]))
    num_layers = len(model.model.layers)
    assert engine.runner.graphs.num_replays == NEW_TOKENS - 1 and layers == list(range(num_layers))
    if cpu_kernel.load() is not None:  # else every decode layer's attention takes the dispatch
        assert calls == [5] * num_layers  # the prefill's


def test_layers_with_features_take_the_eager_layer_code():
    """A sliding window (Mistral's; softcaps and sinks go the same way) runs the eager step's own layer
    code inside the compiled forward: same tokens as stock, logits as the eager engine's."""
    arch = "mistral"
    model = tiny_model(arch, "hf_paged")
    prompts = _prompts([17], seed=2)  # past the window while it decodes
    eager = _run(_engine(model, cpu_graphs=False), prompts)
    engine = _engine(model, cpu_graphs=True)
    outputs = _run(engine, prompts)
    assert engine.runner.graphs.num_replays == NEW_TOKENS - 1
    _assert_same(eager, outputs)
    stock = tiny_model(arch, "sdpa")
    assert [o.token_ids for o in outputs] == greedy_alone(stock, prompts, NEW_TOKENS)


@pytest.mark.parametrize("kernel", ["hf_paged", "stock"])
def test_either_linear_kernel(monkeypatch, kernel):
    """The graph's linears call whichever kernel measured faster when it compiled: `hf.linear`'s (an
    opaque op) or `F.linear`'s; both give stock's tokens and the eager engine's logits."""
    monkeypatch.setattr(cpu_graphs, "faster_linear_kernel", lambda model, rows: kernel)
    model = tiny_model("llama", "hf_paged", seed=4)  # its own compiled forward
    prompts = _prompts([7], seed=4)
    eager = _run(_engine(model, cpu_graphs=False), prompts)
    engine = _engine(model, cpu_graphs=True)
    outputs = _run(engine, prompts)
    forward = cpu_graphs.compiled_forward(model, "cache")
    assert engine.runner.graphs.num_replays == NEW_TOKENS - 1 and set(forward.linear_kernels.values()) == {kernel}
    _assert_same(eager, outputs)
    assert [o.token_ids for o in outputs] == greedy_alone(tiny_model("llama", "sdpa", seed=4), prompts, NEW_TOKENS)


# ---------------------------------------------------------------------- what moves under the graphs
def test_weights_changed_in_place_are_followed(models):
    """An in-place update (an optimizer step, `load_state_dict`) keeps the compiled code, which reads the
    weights as inputs: the next steps compute with the new values, as stock does."""
    model, stock = models
    prompts = _prompts([4, 9, 13], seed=5)
    engine = _engine(model, cpu_graphs=True)
    _run(engine, prompts)
    saved = [p.detach().clone() for p in model.parameters()]
    try:
        with torch.no_grad():
            for params in (model.parameters(), stock.parameters()):
                for p in params:
                    if p.dim() == 2:
                        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
        captured = engine.runner.graphs.capture.num_captures
        after = _run(engine, prompts)
        assert engine.runner.graphs.capture.num_captures == captured  # nothing recompiled or recaptured
        want = greedy_alone(stock, prompts, NEW_TOKENS)
        assert [o.token_ids for o in after] == want
        _assert_same(_run(_engine(model, cpu_graphs=False), prompts), after)
    finally:
        with torch.no_grad():
            for params in (model.parameters(), stock.parameters()):
                for p, old in zip(params, saved):
                    p.copy_(old)


def test_pool_growth_recaptures(models):
    model, stock = models
    prompts = _prompts([3, 6, 10], seed=7)
    engine = _engine(model, cpu_graphs=True, num_blocks=48)
    first = _run(engine, prompts)
    graphs = engine.runner.graphs
    captured = graphs.capture.num_captures
    engine.resize(num_blocks=96)  # new KV tensors
    again = _run(engine, prompts)
    assert graphs.capture.num_captures > captured
    _assert_same(first, again)
    assert [o.token_ids for o in again] == greedy_alone(stock, prompts, NEW_TOKENS)


def test_steps_past_the_largest_length_bucket_extend_it(models):
    """An engine that widened (drop-in `generate` sizes its engine by its first call) decodes past its
    largest `max_seqlen_k` bucket: it doubles until the step fits, and the step still runs compiled."""
    model, stock = models
    prompts = _prompts([3, 20], seed=9)
    engine = _engine(model, cpu_graphs=True, cuda_graph_max_seqlens=(8,))
    outputs = _run(engine, prompts)
    graphs = engine.runner.graphs
    assert graphs.max_seqlens == (8, 32)  # 21 keys at the first step
    assert graphs.num_replays == NEW_TOKENS - 1
    assert [o.token_ids for o in outputs] == greedy_alone(stock, prompts, NEW_TOKENS)


# ---------------------------------------------------------------------- falling back, turning on
def test_compile_failure_falls_back_to_eager(monkeypatch, caplog):
    """Inductor failing (no compiler, an op it cannot lower) turns compiled steps off for good, with a
    warning; the step that tried runs eagerly and nothing is lost."""
    def failing(gm, example_inputs, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_graphs, "_backend", failing)
    model = tiny_model("llama", "hf_paged", seed=3)  # its own compiled forward, compiled with the failing backend
    prompts = _prompts([4, 7])
    eager = _run(_engine(model, cpu_graphs=False), prompts)
    engine = _engine(model, cpu_graphs=True)
    with caplog.at_level(logging.WARNING):
        outputs = _run(engine, prompts)
    _assert_same(eager, outputs)
    assert engine.runner.graphs is None and "decode steps run eagerly" in caplog.text
    assert engine.metrics()["vllm:num_preemptions"] == 0  # no step failed


def test_auto_compiles_after_eager_decode_steps_and_the_default_never_compiles(models, monkeypatch):
    """Unset, HF_PAGED_CPU_GRAPHS leaves every step eager; `auto` starts compiled steps once the engine has
    run `CPU_GRAPHS_COMPILE_AFTER_STEPS` decode steps eagerly (a short run never waits for the compiler);
    0 / 1 as cpu_graphs=False / True."""
    model, stock = models
    monkeypatch.setattr(cpu_graphs, "CPU_GRAPHS_COMPILE_AFTER_STEPS", 4)
    monkeypatch.delenv(cpu_graphs.ENVIRONMENT_VARIABLE, raising=False)
    engine = _engine(model)
    prompts = _prompts([5], seed=11)
    assert [o.token_ids for o in _run(engine, prompts)] == greedy_alone(stock, prompts, NEW_TOKENS)
    assert engine.runner.graphs is None and check_cpu_graphs(None, model, torch.device("cpu")) is None
    monkeypatch.setenv(cpu_graphs.ENVIRONMENT_VARIABLE, "auto")
    engine = _engine(model)
    assert engine.runner.graphs is None
    outputs = _run(engine, prompts)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.num_replays == NEW_TOKENS - 1 - 4  # the prefill samples the first token
    assert [o.token_ids for o in outputs] == greedy_alone(stock, prompts, NEW_TOKENS)
    monkeypatch.setenv(cpu_graphs.ENVIRONMENT_VARIABLE, "0")
    assert _engine(model).runner.graphs is None and check_cpu_graphs(None, model, torch.device("cpu")) is None
    monkeypatch.setenv(cpu_graphs.ENVIRONMENT_VARIABLE, "1")
    assert check_cpu_graphs(None, model, torch.device("cpu")) == 0 and _engine(model).runner.graphs is not None
    monkeypatch.setenv(cpu_graphs.ENVIRONMENT_VARIABLE, "yes")
    with pytest.raises(ValueError, match="HF_PAGED_CPU_GRAPHS must be 0, 1 or auto"):
        _engine(model)
    assert _engine(model, cpu_graphs=False).runner.graphs is None


def test_refusals():
    """Models the compiled step cannot serve stay eager (cpu_graphs=True says why), as CUDA graphs refuse
    them; nothing is compiled to find out."""
    cpu = torch.device("cpu")
    recurrent = tiny_model("qwen3_5", "hf_paged")
    assert "recurrent layers" in compile_refusal(recurrent, cpu)
    assert check_cpu_graphs(None, recurrent, cpu) is None
    with pytest.raises(ValueError, match="cpu_graphs=True: compiled decode steps cannot serve recurrent"):
        check_cpu_graphs(True, recurrent, cpu)
    llama = tiny_model("llama", "hf_paged")
    assert compile_refusal(llama, cpu) is None
    assert "need a CPU model" in compile_refusal(llama, torch.device("cuda"))
    config = CONFIGS["llama"]()
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    dynamic = type(llama)(config)
    assert "length-dependent RoPE" in compile_refusal(dynamic, cpu)
