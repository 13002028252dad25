"""The continuous-batching Engine on tiny random-weight models: parity with stock `generate` per prompt
(large pool, chunked prefill, preemption), sampling, streaming, abort, bad input, metrics, and the
drop-in batched `generate`."""

from __future__ import annotations

import argparse
import inspect

import pytest
import torch

import hf_paged
import hf_paged.integrations.batch_generate as batch_generate
from hf_paged import Engine, SamplingParams
from hf_paged.core import BlockManager, BlockPool
from hf_paged.config import EngineConfig, kv_layout
from hf_paged.hf.support import layer_specs_of
from tiny_models import CONFIGS, STOCK_ATTN, VOCAB, left_padded_batch, stock_greedy, tiny_model
from tiny_models import CharTokenizer as _CharTokenizer

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked

NEW = 12
LENGTHS = [5, 40, 17, 70, 1, 33, 16]


def _prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


_stock = stock_greedy


def _assert_no_leak(engine):
    pool = engine.cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


ENGINE_SETUPS = {
    "large_pool": dict(),
    "chunked": dict(max_num_batched_tokens=7),
    "preempting": dict(num_blocks=30, block_size=4),
    "block_size_1_two_seqs": dict(max_num_seqs=2, block_size=1, num_blocks=200),
}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_parity_with_stock_per_prompt(arch):
    prompts = _prompts()
    stock = _stock(arch, prompts, max_new_tokens=NEW, min_new_tokens=NEW)
    model = tiny_model(arch, "hf_paged")
    # A block holds one layer per KV group here (sliding and full layers have their own tables):
    # the same bytes are that many more blocks.
    layout = kv_layout(layer_specs_of(model.config))
    for name, kwargs in ENGINE_SETUPS.items():
        if "num_blocks" in kwargs:
            kwargs = {**kwargs, "num_blocks": kwargs["num_blocks"] * len(layout.groups)}
        if name == "preempting" and layout.is_hybrid:
            # Sliding groups release what leaves their window, so the pool must be tighter to preempt:
            # a few blocks more than the longest request (82 tokens) ever holds at once.
            manager = BlockManager(BlockPool(0), 4, layout.windows)
            kwargs = {**kwargs, "max_num_batched_tokens": 8, "num_blocks": manager.max_blocks_for(82, 8) + 3}
        engine = Engine(model, **kwargs)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
        assert [o.token_ids for o in outs] == stock, f"{arch}/{name}"
        assert all(o.finish_reason == "length" for o in outs)
        _assert_no_leak(engine)
        metrics = engine.metrics()
        if name == "preempting":
            assert metrics["vllm:num_preemptions"] > 0
        if name == "chunked":
            assert max(engine._metrics.iteration_tokens) <= 7


def test_prefix_cache_hits_skip_prefill_and_keep_parity():
    shared = _prompts([48], seed=5)[0]
    prompts = [shared + tail for tail in _prompts([3, 9, 20], seed=6)] + [shared]
    stock = _stock("llama", prompts, max_new_tokens=NEW, min_new_tokens=NEW)
    engine = Engine(tiny_model("llama", "hf_paged"), block_size=16)
    first = engine.generate(prompts[:1], SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
    rest = engine.generate(prompts[1:], SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
    assert [o.token_ids for o in first + rest] == stock
    # 48 shared tokens = 3 blocks; the identical prompt keeps its last token out of the hit (2 blocks).
    assert [o.metrics.num_cached_tokens for o in rest] == [48, 48, 32]
    metrics = engine.metrics()
    assert metrics["vllm:prefix_cache_hits"] == 48 * 2 + 32
    assert metrics["vllm:prompt_tokens"] == sum(len(p) for p in prompts) - (48 * 2 + 32)
    _assert_no_leak(engine)


def test_repetition_penalty_and_min_new_tokens_match_stock():
    prompts = _prompts([6, 30, 11])
    model = tiny_model("llama", "hf_paged")
    greedy = Engine(model).generate(prompts, SamplingParams(max_new_tokens=3))
    eos = greedy[0].token_ids[0]  # make the first greedy token the end-of-sequence token
    stock = _stock("llama", prompts, max_new_tokens=NEW, min_new_tokens=4, repetition_penalty=1.3, eos_token_id=eos)
    engine = Engine(model)
    engine.eos_token_ids = [eos]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=4, repetition_penalty=1.3))
    assert [o.token_ids for o in outs] == stock
    assert eos not in outs[0].token_ids[:4]


def test_stop_token_ids_and_ignore_eos():
    prompt = _prompts([9])[0]
    engine = Engine(tiny_model("llama", "hf_paged"))
    free = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]


def test_stop_strings_cut_text_and_stream_text_deltas():
    tok = _CharTokenizer()
    engine = Engine(tiny_model("llama", "hf_paged"), tok)
    free = engine.generate(["hello"], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
    assert free.text == tok.decode(free.token_ids)
    stop = free.text[5:7]
    cut = free.text.find(stop)
    out = engine.generate(["hello"], SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == free.text[:cut]
    events = list(engine.stream("hello", SamplingParams(max_new_tokens=NEW, ignore_eos=True)))
    assert "".join(e.text for e in events) == free.text
    assert [e.token_id for e in events] == free.token_ids
    assert [e.finish_reason for e in events] == [None] * (NEW - 1) + ["length"]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    prompts = _prompts([6, 30, 11, 50])
    model = tiny_model("llama", "hf_paged")
    params = SamplingParams(max_new_tokens=NEW, temperature=1.3, top_k=50, top_p=0.9, seed=1234)
    alone = Engine(model).generate([prompts[0]], params)[0].token_ids
    again = Engine(model).generate([prompts[0]], params)[0].token_ids
    others = [SamplingParams(max_new_tokens=NEW + i, temperature=0.8, seed=i) for i in range(3)]
    batched = Engine(model, max_num_batched_tokens=16).generate(prompts, [params] + others)[0].token_ids
    assert alone == again == batched
    other_seed = Engine(model).generate([prompts[0]], SamplingParams(max_new_tokens=NEW, temperature=1.3, seed=99))
    assert other_seed[0].token_ids != alone  # sampling really samples (a fixed seed pair, checked once)
    greedy = Engine(model).generate([prompts[0]], SamplingParams(max_new_tokens=NEW))[0].token_ids
    top1 = Engine(model).generate([prompts[0]], SamplingParams(max_new_tokens=NEW, temperature=1.0, top_k=1))
    assert top1[0].token_ids == greedy


def test_unseeded_sampling_follows_torch_manual_seed():
    prompt = _prompts([8])[0]
    engine = Engine(tiny_model("llama", "hf_paged"))
    torch.manual_seed(7)
    a = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, temperature=1.0))[0].token_ids
    torch.manual_seed(7)
    b = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, temperature=1.0))[0].token_ids
    assert a == b


def test_abort_mid_stream_frees_blocks_and_others_finish():
    prompts = _prompts([20, 40, 33])
    stock = _stock("llama", prompts, max_new_tokens=NEW, min_new_tokens=NEW)
    engine = Engine(tiny_model("llama", "hf_paged"), block_size=4)
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(3):
        engine.step()
    victim = engine.core.requests[ids[1]].request
    held = len(victim.seq.block_table)
    assert held > 0
    free_before = engine.cache.pool.num_free_blocks
    out = engine.abort(ids[1])
    assert out.finish_reason == "abort" and len(out.token_ids) == 3  # one token per step, the prefill too
    assert engine.cache.pool.num_free_blocks == free_before + held
    assert engine.abort(ids[1]) is None  # already gone
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.token_ids
    assert finished == {ids[0]: stock[0], ids[2]: stock[2]}
    _assert_no_leak(engine)
    assert engine.metrics()["num_requests_aborted"] == 1


def test_stream_yields_in_order_and_closing_it_aborts():
    prompts = _prompts([12, 25])
    engine = Engine(tiny_model("llama", "hf_paged"))
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)
    expected = [o.token_ids for o in engine.generate(prompts, params)]
    seen = {0: [], 1: []}
    for event in engine.stream(prompts, params):
        seen[event.index].append(event.token_id)
    assert [seen[0], seen[1]] == expected
    stream = engine.stream(prompts, params)
    next(stream)
    assert engine.cache.pool.num_free_blocks < engine.cache.pool.num_blocks
    stream.close()
    assert not engine.has_unfinished_requests()
    _assert_no_leak(engine)


@pytest.mark.parametrize(
    "prompt, params, error, match",
    [
        ([], SamplingParams(), ValueError, "empty"),
        ([3] * 600, SamplingParams(), ValueError, "max_model_len=512"),
        ([3] * 100, SamplingParams(max_new_tokens=400), ValueError, "pool has only"),
        ([5, 6], SamplingParams(max_new_tokens=0), ValueError, "max_new_tokens"),
        ([5, 6], SamplingParams(max_new_tokens=-3), ValueError, "max_new_tokens"),
        ([5, VOCAB], SamplingParams(), ValueError, "vocabulary"),
        ([-1, 5], SamplingParams(), ValueError, "vocabulary"),
        ([5, 2.5], SamplingParams(), TypeError, "ints"),
        ("a string", SamplingParams(), TypeError, "tokenizer"),
        ([5, 6], SamplingParams(temperature=-1), ValueError, "temperature"),
        ([5, 6], SamplingParams(top_p=0), ValueError, "top_p"),
        ([5, 6], SamplingParams(min_new_tokens=9, max_new_tokens=4), ValueError, "min_new_tokens"),
        ([5, 6], SamplingParams(stop="x"), ValueError, "tokenizer"),
    ],
)
def test_bad_request_is_reported_alone_and_the_others_complete(prompt, params, error, match):
    good = _prompts([9, 30])
    stock = _stock("llama", good, max_new_tokens=NEW, min_new_tokens=NEW)
    engine = Engine(tiny_model("llama", "hf_paged"), num_blocks=20, block_size=16)
    ok = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)
    outs = engine.generate([good[0], prompt, good[1]], [ok, params, ok])
    assert outs[1].finish_reason == "error" and isinstance(outs[1].error, error)
    assert match in str(outs[1].error)
    assert [outs[0].token_ids, outs[2].token_ids] == stock
    with pytest.raises(error, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests()
    _assert_no_leak(engine)


def test_engine_config_errors():
    model = tiny_model("llama", "hf_paged")
    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine(model, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(model, max_num_batched_tokens=-1)
    with pytest.raises(ValueError, match="block_size"):
        Engine(model, block_size=0)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp4'"):
        Engine(model, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_quant_scheme"):
        Engine(model, kv_cache_dtype="fp8", kv_quant_scheme="static")
    engine = Engine(model)
    engine.add_request([5, 6], request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], request_id="a")
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([[5], [6]], [SamplingParams()] * 3)



def test_attention_backend_option_wins_over_the_environment(monkeypatch):
    """`Engine(attention_backend=...)` picks the backend every step runs first, over HF_PAGED_BACKEND;
    an unknown name is refused before anything runs; the outputs stay stock's."""
    prompts = _prompts([9, 30])
    stock = _stock("llama", prompts, max_new_tokens=4, min_new_tokens=4)
    model = tiny_model("llama", "hf_paged")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        Engine(model, attention_backend="cuda-magic")
    monkeypatch.setenv("HF_PAGED_BACKEND", "cpu")
    engine = Engine(model, attention_backend="torch")
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=4, min_new_tokens=4))
    assert [o.token_ids for o in outs] == stock
    assert engine.kv.step.plan.backend == "torch"
    assert EngineConfig().attention_backend is None and "attention_backend" in EngineConfig().engine_kwargs()


def test_engine_defaults_are_engine_configs():
    """`Engine`'s keyword defaults are `EngineConfig`'s, and a config builds an engine."""
    defaults = {name: p.default for name, p in inspect.signature(Engine).parameters.items()}
    for name, value in EngineConfig().engine_kwargs().items():
        assert defaults[name] == value, name
    engine = Engine(tiny_model("llama", "hf_paged"), **EngineConfig(max_num_seqs=3, block_size=8).engine_kwargs())
    assert (engine.max_num_seqs, engine.block_size) == (3, 8)


def test_engine_config_command_line_flags():
    parser = EngineConfig.add_cli_args(argparse.ArgumentParser())
    assert EngineConfig.from_cli_args(parser.parse_args([])) == EngineConfig()
    args = parser.parse_args(["--max-num-seqs", "3", "--block-size", "32", "--num-blocks", "7",
                              "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8", "--cuda-graph-batch-sizes", "1", "4"])
    config = EngineConfig.from_cli_args(args, max_model_len=99)
    assert config == EngineConfig(max_num_seqs=3, block_size=32, num_blocks=7, enable_prefix_caching=False,
                                  kv_cache_dtype="fp8", cuda_graph_batch_sizes=(1, 4), max_model_len=99)
    some = EngineConfig.add_cli_args(argparse.ArgumentParser(), ["max_num_seqs"])
    assert vars(some.parse_args([])) == {"max_num_seqs": EngineConfig.max_num_seqs}
    assert f"(default {EngineConfig.max_num_seqs})" in some.format_help()
    with pytest.raises(ValueError, match="not EngineConfig fields"):
        EngineConfig.add_cli_args(argparse.ArgumentParser(), ["max_num_seq"])


def test_resize_grows_the_limits_and_never_shrinks_them():
    model = tiny_model("llama", "hf_paged")
    prompts = _prompts([5, 40, 17])
    engine = Engine(model, max_num_seqs=2, num_blocks=8, block_size=4, max_model_len=64)
    assert (engine.max_num_seqs, engine.num_kv_blocks, engine.num_used_kv_blocks) == (2, 8, 0)
    engine.resize(max_num_seqs=1, max_model_len=10, num_blocks=4)  # smaller: all kept
    assert (engine.max_num_seqs, engine.max_model_len, engine.num_kv_blocks) == (2, 64, 8)
    engine.resize(max_num_seqs=3, num_blocks=40)
    engine.resize(max_model_len=128)
    assert (engine.max_num_seqs, engine.max_model_len, engine.num_kv_blocks) == (3, 128, 40)
    for bad in (dict(max_num_seqs=0), dict(max_model_len=1), dict(num_blocks=True), dict(num_blocks=2.0)):
        with pytest.raises(ValueError):
            engine.resize(**bad)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
    assert [o.token_ids for o in outs] == _stock("llama", prompts, max_new_tokens=NEW, min_new_tokens=NEW)
    assert engine.num_used_kv_blocks == 0
    _assert_no_leak(engine)


def test_kv_transfer_info_describes_the_pool():
    engine = Engine(tiny_model("llama", "hf_paged"), num_blocks=12, block_size=4, enable_hybrid_kv=False)
    engine.generate([[3, 4]], SamplingParams(max_new_tokens=1))  # allocates every layer's K/V
    engine.check_kv_transferable()
    info = engine.kv_transfer_info()
    assert {k: info[k] for k in ("num_blocks", "free_blocks", "block_size")} == dict(num_blocks=12, free_blocks=12,
                                                                                      block_size=4)
    assert info["kv_dtype"] == next(engine.model.parameters()).dtype and info["kv_numel_per_token"] > 0


def test_a_forward_that_raises_loses_no_request():
    prompts = _prompts([20, 9])
    stock = _stock("llama", prompts, max_new_tokens=NEW, min_new_tokens=NEW)
    model = tiny_model("llama", "hf_paged")
    engine = Engine(model, block_size=4)
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()
    engine.step()
    layer = model.model.layers[1].mlp
    original = layer.forward

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    layer.forward = boom
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    layer.forward = original
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.token_ids
    assert finished == dict(zip(ids, stock))
    _assert_no_leak(engine)


def test_metrics_use_vllm_names_and_add_up():
    prompts = _prompts([10, 50, 30])
    engine = Engine(tiny_model("llama", "hf_paged"), max_num_batched_tokens=32)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))
    m = engine.metrics()
    for key in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                "vllm:request_queue_time_seconds", "vllm:e2e_request_latency_seconds"):
        assert key in m
    assert m["vllm:generation_tokens"] == 3 * NEW and m["vllm:request_success"] == 3
    assert m["vllm:prompt_tokens"] == 90 and m["vllm:prefix_cache_queries"] == 90
    assert m["vllm:time_to_first_token_seconds"]["count"] == 3
    assert m["vllm:inter_token_latency_seconds"]["count"] == 3 * (NEW - 1)
    assert m["vllm:kv_cache_usage_perc"] == 0.0 and m["vllm:num_requests_running"] == 0
    assert sum(m["vllm:iteration_tokens_total"]["sum"] for _ in [0]) == 90 + 3 * (NEW - 1)
    for o in outs:
        r = o.metrics
        assert 0 <= r.queue_time <= r.time_to_first_token <= r.e2e_latency
        assert len(r.inter_token_latencies) == NEW - 1
    assert "generation throughput" in engine.metrics_summary()


def test_weights_change_invalidates_the_prefix_cache():
    prompt = _prompts([40])[0]
    model = tiny_model("llama", "hf_paged")
    engine = Engine(model)
    params = SamplingParams(max_new_tokens=4)
    engine.generate([prompt], params)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    out = engine.generate([prompt], params)[0]
    assert out.metrics.num_cached_tokens == 0  # nothing computed under the old weights is reused
    stock_model = tiny_model("llama", "sdpa")
    with torch.no_grad():
        stock_model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    ids = torch.tensor([prompt])
    assert out.token_ids == stock_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                                 do_sample=False)[0, 40:].tolist()


# ---------------------------------------------------------------------- drop-in batched generate
@pytest.fixture
def engine_calls(monkeypatch):
    calls = []
    original = batch_generate.Engine.generate

    def spy(self, *args, **kwargs):
        calls.append(args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(batch_generate.Engine, "generate", spy)
    return calls


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen2"])
def test_dropin_generate_runs_through_the_engine_and_matches_stock(arch, engine_calls):
    input_ids, attention_mask = left_padded_batch([5, 17, 33, 16], seed=1)
    stock = tiny_model(arch, STOCK_ATTN.get(arch, "sdpa"))
    model = tiny_model(arch, "hf_paged")
    for kwargs in (dict(max_new_tokens=NEW), dict(max_new_tokens=NEW, eos_token_id=[5, 7, 9, 11, 13, 17, 19]),
                   dict(max_new_tokens=5, return_dict_in_generate=True)):
        ref = stock.generate(input_ids, attention_mask=attention_mask, do_sample=False, **kwargs)
        n = len(engine_calls)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, **kwargs)
        assert len(engine_calls) == n + 1
        assert model.hf_paged_last_metrics["kv_peak_blocks"] > 0
        assert type(out) is type(ref)
        if kwargs.get("return_dict_in_generate"):
            ref, out = ref.sequences, out.sequences
        assert out.shape == ref.shape and torch.equal(out, ref)


def test_dropin_generate_pads_rows_that_stop_early_like_stock(engine_calls):
    input_ids, attention_mask = left_padded_batch([5, 17, 33, 16], seed=1)
    stock = tiny_model("llama", "sdpa")
    ref = stock.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=NEW)
    first_tokens = ref[:, input_ids.shape[1]].tolist()
    eos = first_tokens[0]  # row 0 stops at once; the others run on
    ref = stock.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=NEW,
                         eos_token_id=eos, pad_token_id=0)
    out = tiny_model("llama", "hf_paged").generate(input_ids, attention_mask=attention_mask, do_sample=False,
                                                  max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert engine_calls and torch.equal(out, ref)
    assert (out[0, input_ids.shape[1] + 1:] == 0).all()


def test_dropin_generate_falls_back_where_the_engine_cannot_follow(engine_calls):
    input_ids, attention_mask = left_padded_batch([5, 17], seed=1)
    model = tiny_model("llama", "hf_paged")
    stock = tiny_model("llama", "sdpa")
    for kwargs in (dict(sequence_bias={(5, 6): -1.0}), dict(num_beams=2), dict(suppress_tokens=[5])):
        out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=6, **kwargs)
        ref = stock.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=6, **kwargs)
        seq = out.sequences if hasattr(out, "sequences") else out
        ref_seq = ref.sequences if hasattr(ref, "sequences") else ref
        assert torch.equal(seq, ref_seq)
    assert not engine_calls
    model.hf_paged_use_engine = False
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3)
    assert not engine_calls
    # Right-padded rows are not the engine's: stock generate runs them (padding stored and masked).
    right_padded = attention_mask.flip(1)
    del model.hf_paged_use_engine
    ids = input_ids.flip(1)
    out = model.generate(ids, attention_mask=right_padded, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(out, stock.generate(ids, attention_mask=right_padded, max_new_tokens=3, do_sample=False,
                                           pad_token_id=0))
    assert not engine_calls


def test_engine_switches_a_model_to_hf_paged():
    model = tiny_model("llama", "sdpa")
    Engine(model)
    assert model.config._attn_implementation == hf_paged.ATTN_IMPLEMENTATION


def test_dropin_sampling_runs_through_the_engine_and_follows_manual_seed(engine_calls):
    input_ids, attention_mask = left_padded_batch([5, 17, 33], seed=4)
    model = tiny_model("llama", "hf_paged")
    kwargs = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=NEW, min_new_tokens=NEW)
    torch.manual_seed(3)
    a = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    torch.manual_seed(3)
    b = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    torch.manual_seed(4)
    c = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    assert len(engine_calls) == 3
    assert a.shape == (3, input_ids.shape[1] + NEW) and torch.equal(a[:, : input_ids.shape[1]], input_ids)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_string_prompt_with_a_lone_surrogate_is_refused_by_name():
    """No tokenizer encodes a lone surrogate (the fast ones raise an opaque TypeError): the engine names
    it, and the other prompts of the call still run."""
    engine = Engine(tiny_model("llama", "hf_paged"), _CharTokenizer(), num_blocks=32, block_size=4)
    with pytest.raises(ValueError, match=r"the prompt holds a lone surrogate \(U\+D800 at character 3\)"):
        engine.add_request("ab\ud800c")
    bad, good = engine.generate(["ab\udfff", "abc"], SamplingParams(max_new_tokens=2))
    assert bad.finish_reason == "error" and "lone surrogate" in str(bad.error)
    assert good.finish_reason == "length" and len(good.token_ids) == 2
