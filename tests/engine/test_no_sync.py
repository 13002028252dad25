"""A decode step waits for the device exactly once: to read the sampled tokens.

Everything else a step does on the host (metadata, the forward's Python, the launchers, the cache,
the sampler, committing) must run ahead of the GPU, or the GPU idles while the host catches up.

On CPU every tensor is a host tensor, so the test counts every operation that *would* be a device
sync on CUDA, wherever it happens during a decode step: a Python-level read of tensor values
(`tolist`, `item`, `cpu`, `numpy`, `bool` / `int` / `float`), and the ops whose output size depends
on the data (`nonzero`, boolean-mask indexing, `masked_select`, `repeat_interleave` by a tensor,
`unique`), seen through a `TorchDispatchMode`. The attention kernels' own host side is left out:
here it is Triton's interpreter (which reads tensors by design); on CUDA it is launches, covered by
the GPU test, which runs real steps under `torch.cuda.set_sync_debug_mode("error")` (any blocking
copy or synchronisation raises) with only the token read allowed.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_paged import Engine, SamplingParams
from hf_paged.attention import dispatch
from hf_paged.worker.cuda_graphs import EagerGraphCapture
from tiny_models import VOCAB, tiny_model

aten = torch.ops.aten
HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"

# Ops whose result size (or value, for _local_scalar_dense: item / bool / int / float) the host must
# wait for on CUDA.
DATA_DEPENDENT = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                  aten.repeat_interleave.Tensor, aten._unique2.default, aten.unique_dim.default,
                  aten.unique_consecutive.default, aten.nonzero_static.default}
READS = ("tolist", "item", "cpu", "numpy")


class SyncCounter(TorchDispatchMode):
    """Records every would-be device sync while `counting` is set, with where it came from."""

    def __init__(self):
        super().__init__()
        self.counting = False
        self.events: list[tuple[str, str]] = []

    def note(self, what: str) -> None:
        if self.counting:
            frames = [f for f in traceback.extract_stack()[:-2]
                      if "hf_paged" in f.filename or "transformers" in f.filename]
            where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno}" if frames else "?"
            self.events.append((what, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in DATA_DEPENDENT:
            self.note(str(func))
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            indices = args[1]
            if any(i is not None and i.dtype == torch.bool for i in indices):
                self.note(f"{func} with a boolean mask")
        return func(*args, **kwargs)


@pytest.fixture
def counter(monkeypatch):
    counter = SyncCounter()
    for name in READS + ("__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, _original=original, _name=name, **kwargs):
            counter.note(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    for name in ("store_kv", "paged_attention"):  # the kernels' host side: see the module docstring
        original = getattr(dispatch, name)

        def paused(*args, _original=original, **kwargs):
            counting, counter.counting = counter.counting, False
            try:
                return _original(*args, **kwargs)
            finally:
                counter.counting = counting

        monkeypatch.setattr(dispatch, name, paused)
    with counter:
        yield counter


def _prompts(lengths):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


# Sampling settings, and the reads a step of them makes besides the tokens': top-k and top-p keep
# transformers' exact rules, which need a value on the host to decide (whether the k-th value is
# tied; whether the most likely tokens already settle the nucleus), a documented second read.
CASES = {
    "greedy": (SamplingParams(max_new_tokens=8, ignore_eos=True), []),
    "temperature": (SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, seed=1), []),
    "min_p-penalties": (SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, min_p=0.05,
                                       repetition_penalty=1.2, presence_penalty=0.5, logit_bias={5: 1.0},
                                       no_repeat_ngram_size=2, seed=1), []),
    "top_k": (SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, top_k=5, seed=1),
              [("aten.nonzero.default", "sampler.py"), ("tolist", "sampler.py")]),
    "top_p": (SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1),
              [("tolist", "sampler.py")]),
}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton path's host code, on CPU")
# Every sampling case eagerly; with graphs the cases whose reads differ (none, and top-k's two): the
# graph changes the forward, not the sampler, and each case costs seconds under the interpreter.
@pytest.mark.parametrize("case, graphs", [(case, False) for case in CASES] + [("greedy", True), ("top_k", True)],
                         ids=[f"{case}-eager" for case in CASES] + ["greedy-graphs", "top_k-graphs"])
def test_decode_step_reads_the_device_once(counter, monkeypatch, graphs, case):
    sampling, extra = CASES[case]
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    engine = Engine(tiny_model("llama", "hf_paged"), max_num_seqs=4, block_size=4, num_blocks=64)
    if graphs:
        engine.runner.enable_cuda_graphs((4,), (32,), capture=EagerGraphCapture())
    for prompt in _prompts([5, 9, 3]):
        engine.add_request(prompt, sampling)
    engine.step()  # prefill
    engine.step()  # the first decode step (captures the graph)
    for _ in range(3):
        counter.events.clear()
        counter.counting = True
        outputs = engine.step()
        counter.counting = False
        assert len(outputs) == 3  # a decode step that produced every request's token
        events = [(what, where.split(":")[0]) for what, where in counter.events]
        assert events == extra + [("tolist", "sampler.py")], counter.events  # the last: the tokens
    if graphs:
        assert engine.runner.graphs.num_replays == 4


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU with compiled Triton")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_steps_never_sync_on_cuda(monkeypatch, graphs, dtype):
    """Real decode steps under `set_sync_debug_mode("error")`: any blocking copy or synchronisation
    raises, except the sampled tokens' read, which is allowed once per step."""
    model = tiny_model("llama", "hf_paged", dtype=dtype).to("cuda")
    engine = Engine(model, max_num_seqs=4, block_size=16, cuda_graphs=graphs)
    assert (engine.runner.graphs is not None) == graphs
    for prompt in _prompts([5, 40, 3]):
        engine.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for _ in range(3):  # prefill, then decode steps that compile the kernels and capture the graphs
        engine.step()
    reads = []
    tolist = torch.Tensor.tolist

    def allowed_read(self):
        if not self.is_cuda:
            return tolist(self)
        reads.append(tuple(self.shape))
        torch.cuda.set_sync_debug_mode(0)
        try:
            return tolist(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(torch.Tensor, "tolist", allowed_read)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            before = len(reads)
            outputs = engine.step()
            assert len(reads) == before + 1, reads  # the sampled tokens (and NaN flags): [2, 3]
            assert len(outputs) == 3 and all(len(o.outputs[0].token_ids) > 0 for o in outputs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert reads[-1] == (2, 3)
    # A sync raising inside the sampler would have been caught (sampling retried per request): none was.
    assert engine._metrics.num_failed_steps == 0
    if graphs:
        assert engine.runner.graphs.num_replays >= 4
