"""CUDA graphs for decode steps (`worker/cuda_graphs.py`).

On CPU the whole flow runs up to the capture call: `EagerGraphCapture` stands in for
`torch.cuda.CUDAGraph` (it records the captured callable and replays it eagerly on the same static
buffers and frozen host values), so bucket choice, padding, the static buffers and the engine's
routing are checked against the eager engine with the torch backend and with the Triton kernels
under the interpreter. The `cuda`-marked tests capture real graphs on a GPU.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_paged
from hf_paged import Engine, SamplingParams
from hf_paged.attention import dispatch
from hf_paged.worker.cuda_graphs import (
    DecodeBatch,
    EagerGraphCapture,
    GraphKey,
    InputLayout,
    batch_size_buckets,
    max_seqlen_buckets,
    smallest_bucket,
)
from tiny_models import CONFIGS, VOCAB, tiny_model

HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="runs the Triton kernels under the interpreter (no CUDA)")
# fp32 end to end; a padded batch runs the same row-local maths as the unpadded one.
LOGITS_ATOL = 1e-5


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _engine(model, graphs=None, capture=None, **kwargs):
    """An engine with graphs off, or on through `capture` (default: the eager stand-in) for the
    given (batch buckets, max_seqlen_k buckets)."""
    kwargs = {"max_num_seqs": 4, "block_size": 4, "num_blocks": 256, **kwargs}
    engine = Engine(model, **kwargs)
    if graphs is not None:
        engine.runner.enable_cuda_graphs(*graphs, capture=capture if capture is not None else EagerGraphCapture())
    return engine


def _assert_same(eager, graphed, atol=LOGITS_ATOL, margin=0.0):
    """Identical greedy tokens and logits within `atol`. With `margin` (GPU, where a padded batch may
    take other GEMM kernels), a request may part ways only at a near-tie: where the reference's
    logits of the two tokens differ by less than `margin`; its logits are compared up to there."""
    if not margin:
        assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for ref, out in zip(eager, graphed):
        a, b = ref.token_ids, out.token_ids
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if same < min(len(a), len(b)):
            row = ref.outputs[0].logits[same].float()
            assert (row[a[same]] - row[b[same]]).abs() < margin, f"{ref.request_id}: a clear greedy choice changed"
        else:
            assert a == b
        torch.testing.assert_close(torch.stack(out.outputs[0].logits[:same + 1]).float(),
                                   torch.stack(ref.outputs[0].logits[:same + 1]).float(), atol=atol, rtol=0)


# ---------------------------------------------------------------------- buckets and keys
def test_default_buckets():
    assert batch_size_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_size_buckets(48) == (1, 2, 4, 8, 16, 32, 48)  # max_num_seqs itself: every step fits one
    assert batch_size_buckets(1) == (1,)
    assert batch_size_buckets(8, [8, 2, 2]) == (2, 8)
    assert max_seqlen_buckets(2048) == (256, 512, 1024, 2048)
    assert max_seqlen_buckets(3000) == (256, 512, 1024, 2048, 3000)
    assert max_seqlen_buckets(100) == (100,)
    for bad in ([0], [65], [2.0], []):
        with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
            batch_size_buckets(64, bad)
    with pytest.raises(ValueError, match="cuda_graph_max_seqlens"):
        max_seqlen_buckets(512, [0, 256])


def test_smallest_bucket_at_the_edges():
    buckets = (1, 2, 4, 8)
    assert smallest_bucket(buckets, 4) == 4  # exactly a bucket
    assert smallest_bucket(buckets, 5) == 8  # one over
    assert smallest_bucket(buckets, 1) == 1
    assert smallest_bucket(buckets, 9) is None  # over the largest


def test_key_for_at_the_edges():
    engine = _engine(tiny_model("llama", "hf_paged"), graphs=((1, 2, 4), (16, 32, 64)))
    graphs = engine.runner.graphs
    assert graphs.key_for(4, 32) == GraphKey(4, 32)  # exactly both buckets
    assert graphs.key_for(3, 33) == GraphKey(4, 64)  # one over a seqlen bucket: the next one
    assert graphs.key_for(2, 17) == GraphKey(2, 32)
    assert graphs.key_for(1, 1) == GraphKey(1, 16)
    assert graphs.key_for(5, 16) is None  # more sequences than the largest bucket
    assert graphs.key_for(4, 65) is None  # longer than the largest bucket
    assert graphs.width_for(64) == 16 and graphs.width_for(65) == 17


# ---------------------------------------------------------------------- static inputs
def test_pack_pads_rows_harmlessly():
    """Real rows as given; padding rows are one token at position 0, seq_len 1, block table zeros,
    slot -1 (nothing written); cu_seqlens_q and the logits index are the identity; segments aligned."""
    layout = InputLayout(batch_size=4, width=3, num_groups=2)
    batch = DecodeBatch(token_ids=[11, 12], positions=[5, 8], seq_lens=[6, 9],
                        group_slots=[[21, 36], [41, -1]],
                        group_block_tables=[[[5, 1], [9, 3, 7]], [[-1, 1], [9, 3, 7, 8]]])
    long, ints = layout.pack(batch)

    def seg(buf, spans, name):
        offset, shape = spans[name]
        assert offset % 16 == 0  # 16-element alignment, for Triton's pointer specialisation
        return buf[offset: offset + int(np.prod(shape))].reshape(shape)

    L, I = layout.long_spans, layout.int_spans
    assert seg(long, L, "input_ids").tolist() == [[11, 12, 0, 0]]
    assert seg(long, L, "positions").tolist() == [[5, 8, 0, 0]]
    assert seg(long, L, "logits_index").tolist() == [0, 1, 2, 3]
    assert seg(long, L, "slot_mapping0").tolist() == [21, 36, -1, -1]
    assert seg(long, L, "slot_mapping1").tolist() == [41, -1, -1, -1]
    assert seg(ints, I, "seq_lens").tolist() == [6, 9, 1, 1]
    assert seg(ints, I, "cu_seqlens_q").tolist() == [0, 1, 2, 3, 4]
    assert seg(ints, I, "block_tables0").tolist() == [[5, 1, 0], [9, 3, 7], [0, 0, 0], [0, 0, 0]]
    # a released sliding-window entry reads as the row's first held block; past `width` is dropped
    assert seg(ints, I, "block_tables1").tolist() == [[1, 1, 0], [9, 3, 7], [0, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="does not fit"):
        InputLayout(batch_size=1, width=3, num_groups=2).pack(batch)


# ---------------------------------------------------------------------- engine parity
def _parity(arch, lengths, new_tokens, graphs, **engine_kwargs):
    """Greedy runs with and without graphs; returns the graphed engine and its routing log."""
    prompts = _prompts(lengths)
    params = [SamplingParams(max_new_tokens=n, output_logits=True, ignore_eos=True) for n in new_tokens]
    eager = _engine(tiny_model(arch, "hf_paged"), **engine_kwargs).generate(prompts, params)
    engine = _engine(tiny_model(arch, "hf_paged"), graphs=graphs, **engine_kwargs)
    log = _record_routing(engine)
    graphed = engine.generate(prompts, params)
    _assert_same(eager, graphed)
    assert all(replays == int(fits) for _, fits, replays in log), log
    return engine, log


def _check_replays(engine, expect_batches, expect_seqlens):
    used = set(engine.runner.graphs.replayed_keys)
    assert {k.batch_size for k in used} >= set(expect_batches), used
    assert {k.max_seqlen_k for k in used} >= set(expect_seqlens), used


@pytest.mark.parametrize("arch", sorted(set(CONFIGS) - {"qwen3_5"}))  # recurrent layers: no graphs (below)
def test_engine_parity_torch_backend(monkeypatch, arch):
    """7 requests through 4 slots (they finish and join mid-run), batches of 1 to 4 in every
    max_seqlen_k bucket, and one request that outgrows the largest bucket (its steps run eagerly);
    every architecture, sliding-window KV groups (one static table per group), sinks and MoE included."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    engine, log = _parity(arch, [3, 9, 3, 9, 14, 14, 30], [45, 8, 4, 20, 20, 45, 45],
                          graphs=((1, 2, 4), (16, 32, 64)))
    _check_replays(engine, {1, 2, 4}, {16, 32, 64})
    assert any(kind == "decode" and not fits for kind, fits, _ in log)  # past 64 tokens: eager


@needs_interpreter
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_engine_parity_triton_kernels(monkeypatch, arch):
    """The same through the Triton kernels (interpreter): store_kv skips the padding rows' slot -1,
    paged_decode reads block 0 for them, and the real rows match the eager engine (gemma2: three KV
    groups, sliding windows and softcapping)."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    engine, _ = _parity(arch, [3, 7, 5, 7, 2], [5, 3, 3, 18, 3], graphs=((1, 2, 4), (8, 16, 32)))
    _check_replays(engine, {1, 2, 4}, {8, 16, 32})


@needs_interpreter
def test_replays_pass_the_bucket_bound_to_the_kernels(monkeypatch):
    """Every replay launches attention with max_seqlen_k = its key's bound (which covers the step's
    longest sequence), never the step's own maximum and never a shorter bucket's bound."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    seen = []
    original = dispatch.paged_attention
    # (sequences, max_seqlen_q, max_seqlen_k, the longest sequence) of every attention call
    monkeypatch.setattr(dispatch, "paged_attention", lambda *a, **k: seen.append(
        (a[5].shape[0] - 1, a[6], a[7], int(a[4].max()))) or original(*a, **k))
    engine = _engine(tiny_model("llama", "hf_paged"), graphs=((2, 4), (8, 16, 32)))
    engine.generate(_prompts([3, 5, 2]), [SamplingParams(max_new_tokens=n) for n in (20, 4, 3)])
    graphs = engine.runner.graphs
    decodes = [(b, s, longest) for b, q, s, longest in seen if q == 1 and longest > 1]  # not warm-ups
    assert len(decodes) == graphs.num_replays * 3  # every decode step replayed (3 layers each)
    assert {s for _, s, _ in decodes} == {8, 16, 32} and {b for b, _, _ in decodes} == {2, 4}
    for batch_size, max_seqlen_k, longest in decodes:
        assert max_seqlen_k == smallest_bucket(graphs.max_seqlens, longest) >= longest


def test_graph_metadata_freezes_host_values():
    """What the launchers turn into grids and constexprs is fixed per graph: one query per row, the
    bucket's bound as max_seqlen_k, skipped slots always possible (padding), and tensors that are the
    static buffers' views (block tables wide enough for the bound)."""
    engine = _engine(tiny_model("llama", "hf_paged"), graphs=((2, 4), (16, 64)))
    engine.generate(_prompts([3, 4, 5]), SamplingParams(max_new_tokens=16, ignore_eos=True))
    graphs = engine.runner.graphs
    assert set(graphs.graphs) == {GraphKey(b, s) for b in (2, 4) for s in (16, 64)}
    for key, graph in graphs.graphs.items():
        meta = graph.metadata
        assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.has_skipped_slots) == (1, key.max_seqlen_k, True)
        assert meta.block_tables.shape == (key.batch_size, key.max_seqlen_k // 4)
        assert meta.slot_mapping.shape == meta.seq_lens.shape == (key.batch_size,)
        for view in (meta.block_tables, meta.slot_mapping, meta.seq_lens, meta.cu_seqlens_q):
            buffer = graphs.inputs.long if view.dtype == torch.int64 else graphs.inputs.ints
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


@needs_interpreter
def test_captured_forward_takes_nothing_from_the_host(monkeypatch):
    """Nothing inside the captured forward turns host data into a tensor or reads one back: a real
    graph replays only its kernels, so such a value would be frozen at capture (or the capture would
    fail). The kernels' launchers are left out (here Triton's interpreter runs them on the host)."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    engine = _engine(tiny_model("llama", "hf_paged"), graphs=((4,), (16,)))
    graphs = engine.runner.graphs
    inside, calls = [False], []
    run_model = graphs.run_model

    def forward(*args):
        inside[0] = True
        try:
            return run_model(*args)
        finally:
            inside[0] = False

    graphs.run_model = forward
    for module, name in ((torch, "tensor"), (torch, "as_tensor"), (torch, "from_numpy"), (torch.Tensor, "tolist"),
                         (torch.Tensor, "item"), (torch.Tensor, "cpu"), (torch.Tensor, "numpy"),
                         (torch.Tensor, "__bool__"), (torch.Tensor, "new_tensor")):
        original = getattr(module, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            if inside[0]:
                calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    for name in ("store_kv", "paged_attention"):
        original = getattr(dispatch, name)

        def launcher(*args, _original=original, **kwargs):
            was, inside[0] = inside[0], False
            try:
                return _original(*args, **kwargs)
            finally:
                inside[0] = was

        monkeypatch.setattr(dispatch, name, launcher)
    engine.generate(_prompts([3, 5]), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert graphs.num_replays == 3
    assert calls == []


def test_never_replays_a_shorter_bucket():
    """A step whose longest sequence crosses a bucket's bound moves to the next bucket's graph, and a
    graph refuses a step longer than its bound."""
    engine = _engine(tiny_model("llama", "hf_paged"), graphs=((1, 2, 4), (16, 32, 64)))
    chosen = []
    original = engine.runner.graphs.replay

    def replay(key, batch):
        chosen.append((key, batch.max_seqlen_k, batch.num_seqs))
        return original(key, batch)

    engine.runner.graphs.replay = replay
    engine.generate(_prompts([13, 2]), [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (40, 20)])
    for key, longest, num_seqs in chosen:
        assert key.max_seqlen_k == smallest_bucket((16, 32, 64), longest)
        assert key.batch_size == smallest_bucket((1, 2, 4), num_seqs)
    assert [k.max_seqlen_k for k, _, _ in chosen] == sorted(k.max_seqlen_k for k, _, _ in chosen)
    assert {k.max_seqlen_k for k, _, _ in chosen} == {16, 32, 64}
    short = GraphKey(2, 16)
    batch = DecodeBatch([3, 4], [16, 3], [17, 4], [[70, 15]], [[[1, 2, 3, 4, 17]], [[0]]])
    with pytest.raises(ValueError, match="cannot replay"):
        original(short, batch)


def test_padded_rows_write_no_kv():
    """The first decode step of 3 sequences captures the 4-row graph (warm-up and capture on
    all-padding inputs) and replays it: across that step only the 3 real slots of each layer change."""
    engine = _engine(tiny_model("llama", "hf_paged"), graphs=((4,), (32,)), enable_prefix_caching=False)
    for p in _prompts([5, 9, 3]):
        engine.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()  # the prompts' prefill (eager)
    batches = []
    replay = engine.runner.graphs.replay
    engine.runner.graphs.replay = lambda key, batch: batches.append(batch) or replay(key, batch)
    layers = [layer for layer in engine.cache.layers if layer.is_initialized]
    used = torch.zeros(layers[0].keys.shape[0] * 4, dtype=torch.bool)
    for request in engine.scheduler.running:
        for b in request.seq.block_tables[0]:
            used[b * 4:(b + 1) * 4] = True
    with torch.inference_mode():  # the engine's forwards made the KV tensors inference tensors
        for layer in layers:  # garbage in every free slot: any write by a padding row would show
            layer.keys.view(-1, *layer.keys.shape[2:])[~used] = 7.0
    before = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
    engine.step()  # the first decode step
    graphs = engine.runner.graphs
    assert graphs.replayed_keys == [GraphKey(4, 32)] and graphs.capture.num_captures == 1
    written = set(batches[0].group_slots[0])
    for request in engine.scheduler.running:  # each sequence's newest position
        pos = request.seq.num_tokens - 1
        assert request.seq.block_tables[0][pos // 4] * 4 + pos % 4 in written
    assert len(written) == 3
    for layer, (keys, values) in zip(layers, before):
        for old, new in ((keys, layer.keys), (values, layer.values)):
            changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
            assert set(changed) == written


def test_padded_rows_do_not_leak_into_real_rows():
    """Block 0 (what every padding row reads) held by no sequence and filled with NaN: the real rows'
    tokens and logits stay those of the eager engine."""
    prompts = _prompts([6, 11, 4])
    params = SamplingParams(max_new_tokens=6, output_logits=True)
    outs = []
    for graphs in (None, ((4,), (32,))):
        engine = _engine(tiny_model("llama", "hf_paged"), graphs=graphs, enable_prefix_caching=False)
        assert engine.cache.pool.allocate(1) == [0]  # no sequence will hold block 0
        ids = [engine.add_request(p, params) for p in prompts]
        engine.step()  # the prefill allocates the layers' tensors
        with torch.inference_mode():  # the engine's forwards made the KV tensors inference tensors
            for layer in engine.cache.layers:
                if layer.is_initialized:
                    layer.keys[0], layer.values[0] = float("nan"), float("nan")
        done = {}
        while engine.has_unfinished_requests():
            done.update({out.request_id: out for out in engine.step() if out.finish_reason is not None})
        outs.append([done[i] for i in ids])
    _assert_same(*outs)
    assert engine.runner.graphs.num_replays == 5


# ---------------------------------------------------------------------- which steps replay
def _record_routing(engine):
    """Wrap the runner's forward: per step, whether it qualified as a decode step that fits a graph,
    and whether it replayed one."""
    runner, graphs = engine.runner, engine.runner.graphs
    log = []
    original = runner.forward

    def forward(chunks, copies, new_full_blocks=()):
        before = graphs.num_replays
        decode = not copies and all(len(c.token_ids) == 1 and c.num_logits == 1 for c in chunks)
        fits = graphs.key_for(len(chunks), max(c.seq.num_tokens for c in chunks)) is not None
        kind = ("copies" if copies else "verify" if any(len(c.token_ids) > 1 and c.num_logits > 1 for c in chunks)
                else "prefill" if any(len(c.token_ids) > 1 for c in chunks) else "decode")
        out = original(chunks, copies, new_full_blocks)
        log.append((kind, decode and fits, graphs.num_replays - before))
        return out

    runner.forward = forward
    return log


def test_only_fitting_decode_steps_replay():
    """Prefill chunks, copy-on-write steps (n samples forking), speculative verify steps, batches
    over the largest bucket and sequences over the largest bound all run eagerly; every other decode
    step replays a graph."""
    engine = _engine(tiny_model("llama", "hf_paged"), graphs=((1, 2, 4), (16, 32)), speculative_method="ngram",
                     num_speculative_tokens=2, max_num_batched_tokens=16, max_num_seqs=6)
    log = _record_routing(engine)
    repetitive = [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]  # the n-gram proposer finds drafts in it
    prompts = [repetitive, *_prompts([20, 3, 5])]
    plain = dict(num_speculative_tokens=0)  # only the first request drafts
    params = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=30, **plain),
              SamplingParams(max_new_tokens=10, n=2, temperature=1.0, seed=0, **plain),
              SamplingParams(max_new_tokens=6, **plain)]
    engine.generate(prompts, params)
    assert all(replays == int(fits) for _, fits, replays in log), log
    kinds = {kind for kind, _, _ in log}
    assert kinds >= {"prefill", "copies", "verify", "decode"}, kinds
    assert any(kind == "decode" and not fits for kind, fits, _ in log)  # over a bucket: eager
    assert engine.runner.graphs.num_replays > 0


# ---------------------------------------------------------------------- capture, memory, failures
def test_captures_every_batch_bucket_largest_first():
    """The first step that needs a max_seqlen_k bucket captures all its batch buckets, largest first
    (the smaller graphs then reuse the pool memory the largest one left), each once."""
    engine = _engine(tiny_model("llama", "hf_paged"), graphs=((1, 2, 4), (16, 64)))
    graphs = engine.runner.graphs
    order = []
    capture = graphs.capture

    class Recording(EagerGraphCapture):
        def __call__(self, forward):
            order.append(len(graphs.graphs))
            return capture(forward)

    graphs.capture = Recording()
    engine.generate(_prompts([3]), SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert list(graphs.graphs) == [GraphKey(4, 16), GraphKey(2, 16), GraphKey(1, 16), GraphKey(4, 64),
                                   GraphKey(2, 64), GraphKey(1, 64)]
    assert order == [0, 1, 2, 3, 4, 5] and capture.num_captures == 6
    assert {k.batch_size for k in graphs.replayed_keys} == {1}


def test_graphs_follow_moved_memory():
    """Weights whose memory is replaced, or a grown pool, drop the graphs (a real graph would read the
    old addresses); an in-place weight update keeps them."""
    model = tiny_model("llama", "hf_paged")
    engine = _engine(model, graphs=((1, 2), (16, 64)))
    capture = engine.runner.graphs.capture
    params = SamplingParams(max_new_tokens=6, output_logits=True, ignore_eos=True)
    first = engine.generate(_prompts([3, 5]), params)
    assert capture.num_captures == 2
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)  # in place: same memory, new weights epoch
    engine.generate(_prompts([3, 5]), params)
    assert capture.num_captures == 2
    model.lm_head.weight.data = model.lm_head.weight.data.clone()  # new memory
    again = engine.generate(_prompts([3, 5]), params)
    assert capture.num_captures == 4
    _assert_same(first, again)
    engine.cache.kv.grow_to(engine.cache.pool.num_blocks + 8)  # new KV tensors
    engine.generate(_prompts([3, 5]), params)
    assert capture.num_captures == 6
    hf_paged.invalidate(model)  # a change the user declares (a hook, a replaced forward): recapture
    engine.generate(_prompts([3, 5]), params)
    assert capture.num_captures == 8


def test_failed_capture_falls_back_to_eager(caplog):
    class Failing(EagerGraphCapture):
        def __call__(self, forward):
            raise RuntimeError("operation not permitted when stream is capturing")

    prompts, params = _prompts([4, 7]), SamplingParams(max_new_tokens=5, output_logits=True)
    eager = _engine(tiny_model("llama", "hf_paged")).generate(prompts, params)
    engine = _engine(tiny_model("llama", "hf_paged"), graphs=((1, 2), (32,)), capture=Failing())
    with caplog.at_level(logging.WARNING):
        graphed = engine.generate(prompts, params)
    _assert_same(eager, graphed)
    assert engine.runner.graphs is None and "decode steps run eagerly" in caplog.text
    assert engine.metrics()["vllm:num_preemptions"] == 0  # no step failed


def test_engine_argument():
    model = tiny_model("llama", "hf_paged")
    assert Engine(model).runner.graphs is None  # default: off on CPU
    assert Engine(model, cuda_graphs=False).runner.graphs is None
    with pytest.raises(ValueError, match="cuda_graphs=True: CUDA graphs need a CUDA device"):
        Engine(model, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        Engine(model, max_num_seqs=8, cuda_graph_batch_sizes=[16])


# ---------------------------------------------------------------------- on a GPU
def _cuda_model(dtype, layers=2):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).to("cuda", dtype).eval()


GPU_LENGTHS = [5, 300, 17, 3, 90, 23, 2, 260, 40]
GPU_NEW = [40, 12, 30, 60, 8, 25, 15, 20, 35]


def _gpu_run(model, cuda_graphs, capture=None, **kwargs):
    engine = Engine(model, max_num_seqs=8, block_size=16, cuda_graphs=cuda_graphs, **kwargs)
    if capture is not None:
        engine.runner.enable_cuda_graphs((1, 2, 4, 8), (256, 512), capture=capture)
    prompts = _prompts(GPU_LENGTHS, seed=3)
    params = [SamplingParams(max_new_tokens=n, output_logits=True) for n in GPU_NEW]
    return engine, engine.generate(prompts, params)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU with compiled Triton")
def test_cuda_graphs_match_eager_fp32():
    """Real CUDAGraph capture and replay (default on for CUDA) against eager steps, fp32 (no TF32):
    the same greedy tokens, logits within fp32 noise of differently shaped GEMMs."""
    model = _cuda_model(torch.float32)
    eager_engine, eager = _gpu_run(model, cuda_graphs=False)
    engine, graphed = _gpu_run(model, cuda_graphs=None)
    graphs = engine.runner.graphs
    assert graphs is not None and eager_engine.runner.graphs is None
    assert graphs.num_replays > 0 and len({k.batch_size for k in graphs.replayed_keys}) >= 3
    assert {k.max_seqlen_k for k in graphs.replayed_keys} >= {256, 512}
    _assert_same(eager, graphed, atol=1e-3, margin=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU with compiled Triton")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_graph_replays_match_the_eager_stand_in(dtype):
    """A replayed graph computes exactly what the same padded step computes eagerly: real capture
    against `EagerGraphCapture` on the same model, 16-bit."""
    from hf_paged.worker.cuda_graphs import CudaGraphCapture

    model = _cuda_model(dtype)
    _, stand_in = _gpu_run(model, cuda_graphs=False, capture=EagerGraphCapture())
    engine, graphed = _gpu_run(model, cuda_graphs=False, capture=CudaGraphCapture(torch.device("cuda")))
    assert engine.runner.graphs.num_replays > 0
    assert len(engine.runner.graphs.graphs) == 8
    _assert_same(stand_in, graphed, atol=1e-2, margin=1e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU with compiled Triton")
def test_cuda_graphs_on_smollm2_bf16():
    """SmolLM2 in bf16 with real graphs: tokens and logits as the eager stand-in's (same padded
    steps), and against plain eager steps the same tokens wherever the eager margin is not within
    bf16 noise."""
    from hf_paged.defaults.models import DefaultModelNotInstalledError, load_default
    from hf_paged.worker.cuda_graphs import CudaGraphCapture

    try:
        model, _ = load_default(dtype=torch.bfloat16, attn_implementation="hf_paged", device="cuda")
    except DefaultModelNotInstalledError as exc:
        pytest.skip(str(exc))
    _, stand_in = _gpu_run(model, cuda_graphs=False, capture=EagerGraphCapture())
    engine, graphed = _gpu_run(model, cuda_graphs=False, capture=CudaGraphCapture(torch.device("cuda")))
    assert engine.runner.graphs.num_replays > 0
    _assert_same(stand_in, graphed, atol=5e-2, margin=5e-2)
    _, eager = _gpu_run(model, cuda_graphs=False)
    # bf16 through 30 layers of differently shaped GEMMs (a padded batch): loose, but a graph reading
    # the wrong keys or a wrong row would be far outside it.
    _assert_same(eager, graphed, atol=1.5, margin=1.0)


def test_graphs_stay_off_for_heads_wider_than_the_triton_kernels_take(monkeypatch):
    """Gemma 4's full layers keep 512-wide heads, past Triton's 256: those layers would run on the torch
    path, which a graph capture refuses, so graphs are off (and cuda_graphs=True says why) rather than a
    failed capture per engine. Asked as on a CUDA device (nothing runs)."""
    import types

    from transformers.models.gemma4 import Gemma4TextConfig

    from hf_paged.worker.cuda_graphs import check_cuda_graphs

    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    cuda = torch.device("cuda")
    config = Gemma4TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                              head_dim=256, global_head_dim=512, num_attention_heads=2, num_key_value_heads=1)
    assert check_cuda_graphs(None, types.SimpleNamespace(config=config), cuda) is False
    with pytest.raises(ValueError, match="512-wide K/V heads"):
        check_cuda_graphs(True, types.SimpleNamespace(config=config), cuda)
    narrow = Gemma4TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                              head_dim=64, global_head_dim=128, num_attention_heads=2, num_key_value_heads=1)
    assert check_cuda_graphs(None, types.SimpleNamespace(config=narrow), cuda) is True


def test_graphs_stay_off_for_recurrent_layers(monkeypatch):
    """A model with recurrent layers (Qwen 3.5's gated delta rule) runs its mixers once per sequence over
    state rows the host picks per step: no graph captures that, so graphs are off (and cuda_graphs=True says
    why), and decode steps run eagerly. Asked as on a CUDA device (nothing runs)."""
    import types

    from hf_paged.worker.cuda_graphs import check_cuda_graphs

    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    cuda = torch.device("cuda")
    assert check_cuda_graphs(None, types.SimpleNamespace(config=CONFIGS["qwen3_5"]()), cuda) is False
    with pytest.raises(ValueError, match="cannot capture recurrent layers"):
        check_cuda_graphs(True, types.SimpleNamespace(config=CONFIGS["qwen3_5"]()), cuda)
    assert check_cuda_graphs(None, types.SimpleNamespace(config=CONFIGS["qwen3"]()), cuda) is True
