"""The attention backend protocol (`attention/backend.py`, `dispatch`): one `LayerCall` per layer, one
declaration per backend, the choice made per step from the declarations.

Checked here: auto's choice and an explicit one (environment or caller) with their fallbacks; a layer
no backend declares refused with a ValueError naming what it lacks, before any kernel runs; a backend
and a mask kind added by a test with one declaration and one mask rule; and byte-page caches
(strided views whose block stride is a whole page, `contract` section 3): read and written by every
backend that declares them, never handed to one that does not. The oracle is `reference`'s (fp64) on
the torch backend's hand-built pools (`test_torch_paged.make_paged_batch`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from types import SimpleNamespace

import pytest
import torch

from hf_paged.attention import backend, cpu_kernel, dispatch, flex_paged, reference, torch_paged
from hf_paged.attention.backend import Backend, Capabilities, LayerCall, MaskRule
from hf_paged.attention.kv_quant import KVScales
from tests.attention.test_torch_paged import assert_matches, make_paged_batch, naive_batch

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="runs the Triton kernels under the interpreter (no CUDA)")
has_cpu_kernel = cpu_kernel.load() is not None

ROWS = [(54, 0), (17, 4), (1, 1), (40, 20), (97, 1), (26, 3)]  # empty, verify, decode, a prefill chunk


class Spy:
    """Counts calls of module-level functions (the kernels' entry points), keeping them working."""

    def __init__(self, monkeypatch, **targets):
        self.calls = {name: 0 for name in targets}
        for name, (module, attr) in targets.items():
            real = getattr(module, attr)

            def counted(*args, _real=real, _name=name, **kwargs):
                self.calls[_name] += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, attr, counted)


def kernel_spy(monkeypatch):
    from hf_paged.attention.triton import decode, prefill

    return Spy(monkeypatch, torch=(torch_paged, "paged_attention"), cpu=(cpu_kernel, "attend"),
               flex=(flex_paged, "paged_attention"), decode=(decode, "paged_decode"),
               prefill=(prefill, "flash_prefill"))


def step_of(batch):
    return SimpleNamespace(seq_lens=batch.seq_lens)


def call_of(batch, mask=MaskRule(), key_cache=None, value_cache=None):
    return LayerCall(batch.query, batch.key_cache if key_cache is None else key_cache,
                     batch.value_cache if value_cache is None else value_cache, batch.block_tables, batch.seq_lens,
                     batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, 0.2, mask)


def byte_pages(cache: torch.Tensor, neighbour: tuple[int, int], fill: float) -> torch.Tensor:
    """`cache` copied into a byte page shared with a neighbouring layer of shape (heads, dim) placed
    first, as the HF pool lays out layers of different shapes: [num_blocks, bs * page] of the cache's
    dtype, this layer's K at element offset bs * heads * dim. Returns the (strided) view; everything
    else in the page holds `fill`."""
    num_blocks, block_size, heads, dim = cache.shape
    before = neighbour[0] * neighbour[1]
    page = before + heads * dim
    buffer = torch.full((num_blocks, block_size * page), fill, dtype=cache.dtype)
    view = buffer[:, block_size * before:block_size * page].view(num_blocks, block_size, heads, dim)
    view.copy_(cache)
    assert not view.is_contiguous() and view.stride(0) == block_size * page
    return view


# ---------------------------------------------------------------------------------------------- #
# The choice: auto, explicit (environment, caller), fallbacks


def test_auto_and_explicit_choices(monkeypatch):
    """auto: the CPU kernel (then torch) on the CPU; an explicit choice names its backend first and its
    fallback after; a caller's choice wins over HF_PAGED_BACKEND (which it then never reads)."""
    batch = make_paged_batch(ROWS, 16, 6, 2, 32, torch.float32, seed=1)
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    auto = dispatch.plan(step_of(batch))
    assert auto.backends == (("cpu", "torch") if has_cpu_kernel else ("torch",))
    monkeypatch.setenv("HF_PAGED_BACKEND", "bogus")  # a caller's choice does not read it
    assert dispatch.plan(step_of(batch), backend="torch").backends == ("torch",)
    assert dispatch.plan(step_of(batch), backend="flex").backends == ("flex", "torch")
    assert dispatch.backend(torch.device("cpu"), "TORCH") == "torch"
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND must be one of"):
        dispatch.plan(step_of(batch))
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('auto', 'triton', 'cpu', 'torch', "
                                         r"'flex'\), got 'cuda-magic'"):
        dispatch.plan(step_of(batch), backend="cuda-magic")
    with pytest.raises(ValueError, match="attention_backend=cpu runs on CPU tensors, not meta"):
        dispatch.backend(torch.device("meta"), "cpu")
    monkeypatch.setenv("HF_PAGED_BACKEND", "flex")
    assert dispatch.plan(step_of(batch)).backends == ("flex", "torch")
    keyed = dispatch.plan(SimpleNamespace(seq_lens=batch.seq_lens, key_limits=torch.zeros(1)), backend="flex")
    assert keyed.backends == ("torch",)  # only the torch backend declares key limits


@pytest.mark.skipif(not has_cpu_kernel, reason=f"no CPU kernel: {cpu_kernel.load_error()}")
def test_an_explicit_choice_runs_its_kernel(monkeypatch):
    """HF_PAGED_BACKEND=torch with a caller's "cpu": the native kernel runs; the other way round it does not."""
    spy = Spy(monkeypatch, cpu=(cpu_kernel, "attend"))
    batch = make_paged_batch(ROWS, 16, 6, 2, 32, torch.float32, seed=2)
    expected = naive_batch(batch, 0.2)
    for env, chosen, launches in (("torch", "cpu", 1), ("cpu", "torch", 0)):
        monkeypatch.setenv("HF_PAGED_BACKEND", env)
        plan = dispatch.plan(step_of(batch), backend=chosen)
        assert plan.backend == chosen
        spy.calls["cpu"] = 0
        assert_matches(dispatch.run(call_of(batch), plan), expected, torch.float32)  # 1e-5
        assert spy.calls["cpu"] == launches


# ---------------------------------------------------------------------------------------------- #
# Refusal, and a backend and a mask kind added by a test


@dataclasses.dataclass(frozen=True)
class MinKeyMask(MaskRule):
    """A mask kind no built-in backend declares: keys before `min_key` are invisible to every query."""

    min_key: int | None = None

    @functools.cached_property
    def kinds(self) -> frozenset[str]:
        return super().kinds | ({"min_key"} if self.min_key is not None else set())

    def lower_bound(self, pos: int) -> int:
        return max(super().lower_bound(pos), self.min_key or 0)


class DenseBackend(Backend):
    """A test backend: per sequence, every key gathered through the table, then fp64 softmax with the
    mask written out by `MaskRule.lower_bound`: one rule for every kind it declares."""

    def run(self, call: LayerCall, plan) -> torch.Tensor:
        self.num_runs += 1
        return dense_attention(call)


def dense_attention(call: LayerCall) -> torch.Tensor:
    out = torch.zeros(call.query.shape[0], call.query.shape[1], call.value_cache.shape[3], dtype=call.query.dtype)
    cu = call.cu_seqlens_q.tolist()
    for b, seq_len in enumerate(call.seq_lens.tolist()):
        q = call.query[cu[b]:cu[b + 1]].double()
        if q.shape[0] == 0:
            continue
        group = q.shape[1] // call.key_cache.shape[2]
        k = reference.gather_kv(call.key_cache, call.block_tables[b:b + 1], seq_len)[0].double()
        v = reference.gather_kv(call.value_cache, call.block_tables[b:b + 1], seq_len)[0].double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * call.scale
        for i in range(q.shape[0]):
            pos = seq_len - q.shape[0] + i
            scores[:, i, :call.mask.lower_bound(pos)] = float("-inf")
            scores[:, i, pos + 1:] = float("-inf")
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(out.dtype)
    return out


@pytest.fixture
def dense_backend():
    """The test backend, registered before torch (auto never picks it: no `auto_devices`), removed after."""
    entry = DenseBackend("dense", Capabilities(devices=frozenset({"cpu"}), query_dtypes=frozenset({torch.float32}),
                                               mask_kinds=frozenset({"window", "chunk", "min_key"}),
                                               strided_caches=False))
    entry.num_runs = 0
    backend.register(entry, before="torch")
    try:
        yield entry
    finally:
        backend.unregister("dense")
    assert "dense" not in dispatch.choices()


def test_a_new_backend_and_mask_kind_are_one_declaration_and_one_rule(dense_backend, monkeypatch):
    """A backend declared by a test serves the kinds it declares (a chunk with a window, and a new
    kind no built-in backend has), and its fallback, torch, what it does not (a strided cache)."""
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    batch = make_paged_batch(ROWS, 16, 6, 2, 32, torch.float32, seed=3, query_scale=3.0)
    assert "dense" in dispatch.choices() and dispatch.plan(step_of(batch)).backend != "dense"
    plan = dispatch.plan(step_of(batch), backend="dense")
    assert plan.backends == ("dense", "torch")
    chunked = MaskRule(window=9, chunk=13)
    assert_matches(dispatch.run(call_of(batch, chunked), plan),
                   naive_batch(batch, 0.2, sliding_window=9, chunk_size=13), torch.float32)  # 1e-5
    assert dense_backend.num_runs == 1
    late = make_paged_batch([(54, 4), (40, 20), (97, 1)], 16, 6, 2, 32, torch.float32, seed=3, query_scale=3.0)
    new_kind = MinKeyMask(min_key=10)  # every query of `late` sits at 20 or later: none is left without keys
    out = dispatch.run(call_of(late, new_kind), dispatch.plan(step_of(late), backend="dense"))
    assert dense_backend.num_runs == 2
    torch.testing.assert_close(out, dense_attention(call_of(late, new_kind)), atol=0, rtol=0)
    assert (out.double() - naive_batch(late, 0.2)).abs().max() > 1e-2  # the new bound counted
    strided = call_of(batch, chunked, byte_pages(batch.key_cache, (1, 8), float("nan")),
                      byte_pages(batch.value_cache, (1, 8), float("nan")))
    assert dense_backend.refusal(strided) == "a strided (byte-page) K/V cache"
    assert_matches(dispatch.run(strided, plan), naive_batch(batch, 0.2, sliding_window=9, chunk_size=13),
                   torch.float32)
    assert dense_backend.num_runs == 2  # the strided call went to torch


@needs_interpreter
def test_a_layer_no_backend_declares_is_refused_before_any_kernel(dense_backend, monkeypatch):
    """A mask kind only the test backend declares, on steps that chose others; and a layer the test
    backend refuses once its fallback is gone: ValueErrors naming each backend's reason, raised
    before a kernel ran or a launch plan was made."""
    spy = kernel_spy(monkeypatch)
    batch = make_paged_batch(ROWS, 16, 6, 2, 32, torch.float32, seed=4)
    new_kind = MinKeyMask(min_key=3)
    for name in ("triton", "cpu", "torch", "flex"):
        if name == "cpu" and not has_cpu_kernel:
            continue
        plan = dispatch.plan(step_of(batch), backend=name)
        with pytest.raises(ValueError, match=f"no attention backend takes this layer: {name} does not take the "
                                             "'min_key' mask") as refused:
            dispatch.run(call_of(batch, new_kind), plan)
        assert str(refused.value).endswith("torch does not take the 'min_key' mask")
        assert plan.num_layer_plans == 0
    monkeypatch.setattr(dense_backend, "fallback", None)
    plan = dispatch.plan(step_of(batch), backend="dense")
    assert plan.backends == ("dense",)
    with pytest.raises(ValueError, match="dense does not take a strided"):
        dispatch.run(call_of(batch, key_cache=byte_pages(batch.key_cache, (2, 16), 0.0),
                             value_cache=byte_pages(batch.value_cache, (2, 16), 0.0)), plan)
    with pytest.raises(ValueError, match=r"dense does not take torch.float16 queries"):
        dispatch.paged_attention(batch.query.half(), batch.key_cache.half(), batch.value_cache.half(),
                                 batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q,
                                 batch.max_seqlen_k, 0.2, chunk_size=8, plan=plan)
    assert dense_backend.num_runs == 0 and set(spy.calls.values()) == {0}


@needs_interpreter
def test_triton_falls_back_for_what_it_does_not_declare(monkeypatch, caplog):
    """A head wider than the Triton kernels take (Gemma 4's 512-wide global layers) runs on the torch
    path of the same step, said once in the log; the layers Triton declares still launch Triton."""
    monkeypatch.setattr(backend, "_said", set())
    spy = kernel_spy(monkeypatch)
    wide = make_paged_batch([(30, 1), (9, 3)], 16, 4, 2, 320, torch.float32, seed=5)
    narrow = make_paged_batch([(30, 1), (9, 3)], 16, 4, 2, 32, torch.float32, seed=5)
    plan = dispatch.plan(step_of(wide), backend="triton")
    assert backend.backends()["triton"].refusal(call_of(wide)) == "head_dim 320 / head_dim_v 320 (at most 256)"
    with caplog.at_level("INFO", logger="hf_paged.attention.backend"):
        for _ in range(2):
            assert_matches(dispatch.run(call_of(wide, MaskRule(chunk=8)), plan),
                           naive_batch(wide, 0.2, chunk_size=8), torch.float32)
    assert spy.calls["torch"] == 2 and spy.calls["decode"] == 0
    assert sum("head_dim 320" in r.message for r in caplog.records) == 1
    assert_matches(dispatch.run(call_of(narrow), plan), naive_batch(narrow, 0.2), torch.float32)
    assert spy.calls["decode"] == 1


# ---------------------------------------------------------------------------------------------- #
# Byte pages: strided cache views


@pytest.mark.parametrize("name", ["torch", "cpu", pytest.param("triton", marks=needs_interpreter), "flex"])
def test_byte_page_views_read_like_contiguous_caches(name, monkeypatch):
    """Caches that are slices of a page shared with another layer (NaN in the rest of the page) give
    the oracle's output on every backend that declares strided caches (torch, Triton, and the CPU
    kernel, which reads each block in place at the page's stride); flex, which does not, never sees
    them: its layers run on torch."""
    if name == "cpu" and not has_cpu_kernel:
        pytest.skip(f"no CPU kernel: {cpu_kernel.load_error()}")
    spy = kernel_spy(monkeypatch)
    batch = make_paged_batch(ROWS, 16, 6, 2, 32, torch.float32, seed=6, query_scale=3.0)
    key_view = byte_pages(batch.key_cache, (1, 48), float("nan"))
    value_view = byte_pages(batch.value_cache, (3, 16), float("nan"))
    plan = dispatch.plan(step_of(batch), backend=name)
    expected = naive_batch(batch, 0.2, chunk_size=13)
    out = dispatch.paged_attention(batch.query, key_view, value_view, batch.block_tables, batch.seq_lens,
                                   batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, 0.2, plan=plan,
                                   chunk_size=13)
    assert_matches(out, expected, torch.float32)  # 1e-5
    declares = backend.backends()[name].capabilities.strided_caches
    assert declares == (name in ("torch", "triton", "cpu"))
    if name == "triton":
        assert spy.calls["prefill"] == 1 and spy.calls["torch"] == 0
    elif name == "cpu":  # its plan's short runs on the kernel, over the byte pages
        assert spy.calls["cpu"] == 1 and spy.calls["flex"] == 0
    else:
        assert spy.calls["torch"] == 1 and spy.calls["cpu"] == spy.calls["flex"] == 0


@pytest.mark.parametrize("block_size,first_block,seq_len,q_len", [(16, 2, 37, 1), (16, 0, 40, 9), (1, 3, 23, 23)])
def test_byte_page_views_on_consecutive_blocks(block_size, first_block, seq_len, q_len):
    """One sequence on consecutive blocks, which the torch path reads as a view of a flat pool: a
    byte page cannot be viewed so, and is gathered instead (same output, page neighbours untouched)."""
    gen = torch.Generator().manual_seed(seq_len)
    num_blocks = first_block + -(-seq_len // block_size) + 1
    keys, values = torch.randn(seq_len, 2, 32, generator=gen), torch.randn(seq_len, 2, 32, generator=gen)
    flat_k, flat_v = torch.zeros(num_blocks, block_size, 2, 32), torch.zeros(num_blocks, block_size, 2, 32)
    slots = torch.arange(seq_len) + first_block * block_size
    torch_paged.store_kv(keys, values, flat_k, flat_v, slots)
    paged_k, paged_v = byte_pages(flat_k, (1, 16), float("nan")), byte_pages(flat_v, (1, 16), float("nan"))
    table = torch.tensor([list(range(first_block, num_blocks)) + [0]], dtype=torch.int32)
    args = (table, torch.tensor([seq_len], dtype=torch.int32), torch.tensor([0, q_len], dtype=torch.int32), q_len,
            seq_len, 0.2)
    query = torch.randn(q_len, 6, 32, generator=gen)
    for features in ({}, dict(chunk_size=8)):
        expected = torch_paged.paged_attention(query, flat_k, flat_v, *args, **features)
        out = torch_paged.paged_attention(query, paged_k, paged_v, *args, **features)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)  # fp32
        oracle = reference.causal_attention(query, keys, values, 0.2, chunk_size=features.get("chunk_size"))
        torch.testing.assert_close(out.double(), oracle, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_store_kv_writes_byte_page_views(name):
    """dispatch.store_kv into strided views writes what it writes into contiguous caches, bit for bit,
    and leaves the page's other layer alone."""
    gen = torch.Generator().manual_seed(8)
    key_cache, value_cache = torch.zeros(5, 4, 2, 16), torch.zeros(5, 4, 2, 8)
    key_view, value_view = byte_pages(key_cache, (1, 32), -3.0), byte_pages(value_cache, (2, 8), -3.0)
    key, value = torch.randn(7, 2, 16, generator=gen), torch.randn(7, 2, 8, generator=gen)
    slot_mapping = torch.tensor([3, -1, 11, 0, 19, -1, 8])
    plan = dispatch.plan(SimpleNamespace(seq_lens=torch.zeros(1, dtype=torch.int32)), backend=name)
    dispatch.store_kv(key, value, key_cache, value_cache, slot_mapping, plan=plan)
    dispatch.store_kv(key, value, key_view, value_view, slot_mapping, plan=plan)
    assert torch.equal(key_view, key_cache) and torch.equal(value_view, value_cache) and key_cache.count_nonzero()
    for view, neighbour in ((key_view, 32), (value_view, 16)):
        page = view.as_strided((view.shape[0], view.stride(0)), (view.stride(0), 1), 0)  # the whole buffer
        assert page[:, :view.shape[1] * neighbour].eq(-3.0).all()


def test_quantised_store_and_dense_gather_on_byte_page_views():
    """The torch path's quantised write (payload and scales both strided) and its dense gather (the
    sdpa/eager path) read and write byte pages as they do contiguous caches."""
    from hf_paged.attention.metadata import DENSE, build_step_metadata
    from tests.attention.test_triton_kv_quant import quant_of

    gen = torch.Generator().manual_seed(9)
    quant = quant_of("int8", "dynamic")
    caches = [torch.zeros(4, 2, 2, 16, dtype=torch.int8) for _ in range(2)]
    scales = KVScales(torch.zeros(4, 2, 2, 1), torch.zeros(4, 2, 2, 1), quant)
    views = [byte_pages(c, (1, 16), 5) for c in caches]
    scale_views = KVScales(byte_pages(scales.key, (2, 1), 7.0), byte_pages(scales.value, (2, 1), 7.0), quant)
    key, value = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    slots = torch.tensor([4, 5, 0, 6])
    torch_paged.store_kv(key, value, *caches, slots, scales=scales)
    torch_paged.store_kv(key, value, *views, slots, scales=scale_views)
    assert all(torch.equal(v, c) for v, c in zip(views, caches))
    assert torch.equal(scale_views.key, scales.key) and torch.equal(scale_views.value, scales.value)
    # Row 0: 3 tokens in blocks [2, 0]; row 1: 1 token in block [3], left-padded by 2 columns.
    step = build_step_metadata(mode=DENSE, q_len=3, num_columns=3, real_cols=[range(0, 3), range(2, 3)],
                               slots=[[4, 5, 0], [6]], block_tables=[[2, 0], [3]], seq_lens=[3, 1], copies=[],
                               device=torch.device("cpu"))
    expected = torch_paged.gather_dense(*caches, step, torch.float32, scales=scales)
    step.dense_index.clear()
    got = torch_paged.gather_dense(*views, step, torch.float32, scales=scale_views)
    assert all(torch.equal(g, e) for g, e in zip(got, expected)) and expected[0].count_nonzero()
