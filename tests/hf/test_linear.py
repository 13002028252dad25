"""`hf_paged.hf.linear`: the faster linear kernel of hf_paged's own forwards, inert everywhere else."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F

from hf_paged.hf import linear

pytestmark = pytest.mark.skipif(not linear.is_available(), reason="torch built without oneDNN")


class LoraLike(torch.nn.Linear):
    """A Linear subclass (quantised / LoRA layers are such): left alone."""


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8, bias=False),
                               LoraLike(8, 8))


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls that reach the fast kernel."""
    calls = []
    kernel = linear._probe()

    def counting(*args):
        calls.append(args[0].shape)
        return kernel(*args)

    monkeypatch.setattr(linear, "_kernel", counting)
    return calls


def test_enable_patches_plain_linears_only_and_disable_restores():
    model = make_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert linear.enable(model) == 2
    assert linear.enable(model) == 2  # idempotent
    assert all(type(m) is torch.nn.Linear for m in (model[0], model[2]))  # types untouched
    assert "forward" in model[0].__dict__ and "forward" not in model[3].__dict__
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert set(model.state_dict()) == set(state)
    linear.disable(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_module_with_its_own_forward_hook_is_left_alone():
    model = make_model()
    marker = model[0].forward
    model[0].forward = marker  # what accelerate's hooks do
    assert linear.enable(model) == 1
    assert model[0].forward is marker


def test_outside_the_context_it_is_exactly_f_linear(counted):
    model = make_model()
    linear.enable(model)
    x = torch.randn(5, 24)
    with torch.inference_mode():
        out = model(x)
    linear.disable(model)
    with torch.inference_mode():
        expected = model(x)
    assert torch.equal(out, expected)
    assert counted == []


def test_inside_the_context_the_kernel_runs_and_agrees(counted):
    model = make_model()
    x = torch.randn(3, 7, 24)  # 3-D input, as transformers passes it
    with torch.inference_mode():
        expected = model(x)
    linear.enable(model)
    with torch.inference_mode(), linear.fast_linear():
        out = model(x)
    assert len(counted) == 2  # both plain linears, not the subclass
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_grad_mode_and_other_dtypes_keep_f_linear(counted):
    model = make_model()
    linear.enable(model)
    x = torch.randn(2, 24, requires_grad=True)
    with linear.fast_linear():
        model(x).sum().backward()  # training: autograd through F.linear
        with torch.no_grad():
            model.to(torch.float64)(x.detach().double())
    assert counted == []
    assert model[0].weight.grad is not None


def test_the_context_is_per_thread(counted):
    model = make_model()
    linear.enable(model)
    x = torch.randn(2, 24)
    inside, release = threading.Event(), threading.Event()

    def hold():
        with linear.fast_linear():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    inside.wait(10)
    with torch.inference_mode():
        model(x)  # this thread is not inside the context
    release.set()
    thread.join()
    assert counted == []


def test_deepcopy_keeps_a_working_patch_bound_to_the_copy(counted):
    model = make_model()
    linear.enable(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone[0].weight.zero_()
        clone[0].bias.fill_(1.0)
    with torch.inference_mode(), linear.fast_linear():
        out = clone[0](torch.randn(2, 24))
    assert torch.equal(out, torch.ones(2, 40))  # the copy's own weights
    assert counted


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("HF_PAGED_FAST_LINEAR", "0")
    assert not linear.is_available()
    assert linear.enable(make_model()) == 0


def test_kernel_agrees_with_f_linear_on_decode_and_prefill_shapes():
    kernel = linear.linear_kernel()
    gen = torch.Generator().manual_seed(3)
    for rows, k, n in [(1, 576, 1536), (6, 1536, 576), (64, 576, 192), (600, 576, 49152 // 16)]:
        x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
        torch.testing.assert_close(kernel(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_one_row_on_one_thread_keeps_mkl(counted):
    model = make_model()
    linear.enable(model)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.inference_mode(), linear.fast_linear():
            model(torch.randn(1, 24))
            assert counted == []
            model(torch.randn(2, 24))
            assert len(counted) == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("onednn_wins", [True, False])
def test_one_row_on_two_threads_takes_the_kernel_measured_faster(counted, monkeypatch, onednn_wins):
    """At one row the faster kernel depends on the CPU (MKL's on an Ice Lake Xeon, oneDNN's on the AMD
    EPYC): the choice is measured once per thread count and followed; more rows take oneDNN."""
    model = make_model()
    linear.enable(model)
    monkeypatch.setattr(linear, "_one_row", {2: onednn_wins})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch.inference_mode(), linear.fast_linear():
            model(torch.randn(1, 24))
            assert len(counted) == (2 if onednn_wins else 0)
            model(torch.randn(3, 24))
            assert len(counted) == (4 if onednn_wins else 2)
    finally:
        torch.set_num_threads(threads)


def test_the_one_row_measurement_runs_once_per_thread_count(monkeypatch):
    monkeypatch.setattr(linear, "_one_row", {})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        first = linear.onednn_wins_at_one_row()
        assert linear._one_row == {2: first}  # noqa: SLF001  (the cache this test is about)
        monkeypatch.setattr(linear, "ONE_ROW_WEIGHT", None)  # a second measurement would fail
        assert linear.onednn_wins_at_one_row() is first
        torch.set_num_threads(1)
        assert linear.onednn_wins_at_one_row() is False and 1 not in linear._one_row  # noqa: SLF001
    finally:
        torch.set_num_threads(threads)


def _half_linear(dtype, in_features=40, out_features=300, bias=True):
    torch.manual_seed(0)
    module = torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)
    linear.enable(module)
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_a_16_bit_linear_of_many_rows_runs_in_fp32_where_that_measures_faster(counted, monkeypatch, dtype, bias):
    """From HALF_ROWS rows, where the fp32 route measured faster: an fp32 GEMM over the weight converted
    slice by slice, rounded once. Slices of 7 output rows (a last one of 6) give bit for bit the
    one-slice result, and both are as close to the float64 product as the 16-bit kernel's own."""
    module = _half_linear(dtype, bias=bias)
    monkeypatch.setattr(linear, "_half_wins", {(dtype, torch.get_num_threads()): True})
    x = torch.randn(2, linear.HALF_ROWS // 2 + 3, 40).to(dtype)  # 2 x 35 = 70 rows >= HALF_ROWS
    w, b = module.weight, module.bias
    whole = linear._kernel(x.reshape(-1, 40).float(), w.float(), None if b is None else b.float(), "none", [], "")
    counted.clear()
    with torch.inference_mode(), linear.fast_linear():
        got = module(x)
        assert got.dtype == dtype and got.shape == (2, 35, 300) and len(counted) == 1
        assert torch.equal(got.reshape(-1, 300), whole.to(dtype))
        monkeypatch.setattr(linear, "HALF_SLICE", 7 * 40)
        monkeypatch.setattr(linear._local, "half_scratch", None)  # a fresh scratch of the new slice
        sliced = module(x)
        assert len(counted) == 1 + 43  # 300 = 42 slices of 7 and one of 6
        assert torch.equal(sliced, got)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    native = F.linear(x, w, b)
    assert (got.double() - exact).abs().mean() <= (native.double() - exact).abs().mean() * 1.01
    assert (got != native).float().mean() < 0.01  # the summation order flips a last bit in a few outputs


def test_a_16_bit_linear_keeps_its_own_kernel_below_half_rows_unmeasured_or_slower_and_outside(counted, monkeypatch):
    module = _half_linear(torch.bfloat16)
    monkeypatch.setattr(linear, "_half_wins", {(torch.bfloat16, torch.get_num_threads()): False})
    many, few = torch.randn(linear.HALF_ROWS, 40).bfloat16(), torch.randn(linear.HALF_ROWS - 1, 40).bfloat16()
    with torch.inference_mode():
        assert torch.equal(module(many), F.linear(many, module.weight, module.bias))  # outside the context
        with linear.fast_linear():
            assert torch.equal(module(many), F.linear(many, module.weight, module.bias))  # measured slower
            monkeypatch.setattr(linear, "_half_wins", {(torch.bfloat16, torch.get_num_threads()): True})
            assert torch.equal(module(few), F.linear(few, module.weight, module.bias))  # too few rows
            module.bias.data = module.bias.data.float()  # mixed dtypes: F.linear decides what they mean
            with pytest.raises(RuntimeError):
                F.linear(many, module.weight, module.bias)
            with pytest.raises(RuntimeError):
                module(many)
    assert counted == []


def test_the_16_bit_measurement_runs_once_per_dtype_and_thread_count(monkeypatch):
    monkeypatch.setattr(linear, "_half_wins", {})
    calls = []
    measure = linear._alternated_medians

    def counting(*args, **kwargs):
        calls.append(args[1].dtype)
        return measure(*args, **kwargs)

    monkeypatch.setattr(linear, "_alternated_medians", counting)
    threads = torch.get_num_threads()
    first = linear.half_as_fp32_wins(torch.bfloat16)
    assert linear.half_as_fp32_wins(torch.bfloat16) is first
    linear.half_as_fp32_wins(torch.float16)
    assert calls == [torch.bfloat16, torch.float16]
    assert set(linear._half_wins) == {(torch.bfloat16, threads), (torch.float16, threads)}  # noqa: SLF001
    assert linear.half_as_fp32_wins(torch.float32) is False and len(calls) == 2  # not a 16-bit dtype
