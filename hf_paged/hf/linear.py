"""Faster `nn.Linear` inside hf_paged's own forwards on CPU.

torch runs a float32 `nn.Linear` on CPU through MKL's sgemm. At the small row counts of decoding
(1 row per sequence, k + 1 when verifying drafts) that call streams the weights on one thread at
about 12 GB/s, while oneDNN's inner product, which torch ships and Inductor already calls
(`torch.ops.mkldnn._linear_pointwise`), reads the same row-major weight on every thread.
`benchmarks/latency.py --kernels` measures both on all of this model's linears; on the 2-core AMD EPYC
this project was built on they take 0.69x the time at one row, 0.72-0.76x at 6-256 rows on torch's
two threads, and on one thread 0.85-0.89x at 6-256 rows but 1.04x at one row, where MKL is kept. On a
2-core Ice Lake Xeon MKL's reads at one row on 2 threads in 0.6x oneDNN's time: at one row the kernel
is chosen by measurement on the machine (`onednn_wins_at_one_row`, once per thread count).

`enable(model)` gives each plain `nn.Linear` of the model an instance `forward` (the pattern
accelerate's hooks use; the module keeps its type, parameters and state dict) that takes the
faster kernel only inside `fast_linear()`, a thread-local context that `ModelRunner` enters around
its inference forwards, and is exactly `F.linear` everywhere else: stock forwards, training, other
threads. `disable(model)` removes it. Results differ from MKL's in the last bits only (a different
summation order, within fp32 tolerance), as every kernel choice does.

Only plain weights take it (float32 here, bf16/fp16 as below). A weight-only quantised linear (transformers' `TorchAoConfig`
quantizer keeps the `nn.Linear` and swaps its weight for a torchao tensor subclass, e.g. `Int8Tensor`,
that reports the float32 it computes in) has no oneDNN kernel: `enable` leaves such modules alone, and
`_forward` checks again on every call (a model quantised after `enable`), so the subclass's own
`F.linear` runs, exactly as under stock transformers.

**bf16 and fp16 weights** on a CPU without 16-bit dot-product instructions (no AVX512-BF16, AMX or
AVX512-FP16) run through torch's 16-bit GEMM at about a third of fp32's rate: on the 2-core Ice Lake
Xeon, 48-68 GFLOP/s against fp32's 150-205 at 64-2048 rows (`benchmarks/linear_half.py`). There, at
`HALF_ROWS` rows and more, such a linear runs as an fp32 GEMM over the weight converted a slice of
`HALF_SLICE` elements at a time into a per-thread fp32 scratch (no fp32 copy of the model is kept), and
its output is rounded once to the weight's dtype. A 16-bit product is exact in fp32 and the 16-bit
kernel accumulates in fp32 too, so the result differs from it by summation order only: about one
output in 10^4 by one unit in the last place, as the 16-bit kernel's own output differs between a row
computed alone and in a batch. Whether the route is faster is measured once per dtype and thread
count on the machine (`half_as_fp32_wins`); below `HALF_ROWS` the 16-bit kernel runs (the conversion
would cost more than the GEMM saves).

`HF_PAGED_FAST_LINEAR=0` turns both off (the benchmark's ablation).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
import types

import torch
import torch.nn.functional as F

_local = threading.local()
_kernel = None  # torch.ops.mkldnn._linear_pointwise once probed; False when unusable
_ATTR = "_hf_paged_fast_linear"
# `type(t) in _PLAIN`: a plain tensor or parameter. `nn.Parameter(subclass)` keeps the subclass's type
# (torchao's quantised weights, DTensor), so this one look-up is exact and cheaper than `type(t.data)`.
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_one_row: dict[int, bool] = {}  # thread count -> whether oneDNN beats MKL at one row here (measured once)
ONE_ROW_WEIGHT = (3072, 2048)  # 24 MiB of fp32: past the caches, streamed as a decode step streams its weights
_HALF = (torch.bfloat16, torch.float16)
HALF_ROWS = 64  # from this many input rows a 16-bit linear may run as an fp32 GEMM (see the module docstring)
HALF_SLICE = 1 << 22  # weight elements converted at a time: a 16 MiB fp32 scratch per thread
HALF_PROBE = (HALF_ROWS, 1024, 2048)  # rows, in features, out features of the measurement
_half_wins: dict[tuple[torch.dtype, int], bool] = {}  # (dtype, threads) -> whether the fp32 route wins here


def _probe():
    """oneDNN's linear if this torch build has it and it agrees with F.linear, else False."""
    global _kernel
    if _kernel is None:
        _kernel = False
        if torch.backends.mkldnn.is_available():
            try:
                fn = torch.ops.mkldnn._linear_pointwise
                gen = torch.Generator().manual_seed(0)
                x, w = torch.randn(3, 40, generator=gen), torch.randn(24, 40, generator=gen)
                b = torch.randn(24, generator=gen)
                if torch.allclose(fn(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-4, rtol=1e-4):
                    _kernel = fn
            except Exception:  # not built with oneDNN, or an op signature this code does not know
                pass
    return _kernel


def is_available() -> bool:
    """Whether the faster kernel exists here and is not switched off (`HF_PAGED_FAST_LINEAR=0`)."""
    return os.environ.get("HF_PAGED_FAST_LINEAR", "1") != "0" and bool(_probe())


def linear_kernel():
    """The faster kernel as `fn(input, weight, bias=None)` (what `F.linear` takes), or None where it is
    unavailable or switched off; for benchmarks and tests."""
    if not is_available():
        return None
    return lambda input, weight, bias=None: _kernel(input, weight, bias, "none", [], "")


def _is_plain(weight, bias) -> bool:
    """Whether oneDNN can read these parameters: plain tensors, not subclasses (see the module docstring)."""
    return type(weight) in _PLAIN and (bias is None or type(bias) in _PLAIN)


def onednn_wins_at_one_row() -> bool:
    """Whether oneDNN's kernel reads a weight faster than MKL's at one input row on this machine and
    thread count: measured once per thread count (about 0.1 s: a weight past the caches, 5 alternated
    rounds of 2 calls each, medians). One thread: False without measuring (both stream at one core's
    bandwidth; MKL was 4% faster on the AMD EPYC). Which wins depends on the CPU: oneDNN took 0.69x MKL's
    time at one row on 2 threads of that EPYC, MKL 0.6x oneDNN's on 2 threads of an Ice Lake Xeon
    (`benchmarks/latency.py --kernels`)."""
    threads = torch.get_num_threads()
    wins = _one_row.get(threads)  # the common case: one look-up per call
    if wins is not None:
        return wins
    if threads == 1 or not is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    weight, row = torch.randn(ONE_ROW_WEIGHT, generator=gen), torch.randn(1, ONE_ROW_WEIGHT[1], generator=gen)
    t = _alternated_medians({"mkl": F.linear, "onednn": lambda x, w: _kernel(x, w, None, "none", [], "")},
                            row, weight)
    _one_row[threads] = t["onednn"] < t["mkl"]
    return _one_row[threads]


def _alternated_medians(kernels: dict, *args, rounds: int = 5) -> dict[str, float]:
    """Median seconds of two calls of each kernel on `args`, the kernels alternated over `rounds` rounds
    (first calls untimed: oneDNN builds its primitive then)."""
    times: dict[str, list[float]] = {name: [] for name in kernels}
    with torch.inference_mode():
        for fn in kernels.values():
            fn(*args)
        for _ in range(rounds):
            for name, fn in kernels.items():
                began = time.perf_counter()
                fn(*args)
                fn(*args)
                times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) for name, t in times.items()}


def half_as_fp32_wins(dtype: torch.dtype) -> bool:
    """Whether a `dtype` (bf16/fp16) linear of `HALF_ROWS` rows runs faster here as an fp32 GEMM over
    its weight converted slice by slice (`_half_as_fp32`) than through torch's own 16-bit kernel:
    measured once per dtype and thread count (about 0.1 s; it must win by 10%). False where the faster
    kernel is unavailable or switched off."""
    key = (dtype, torch.get_num_threads())
    wins = _half_wins.get(key)  # the common case: one look-up per call
    if wins is not None:
        return wins
    if dtype not in _HALF or not is_available():
        return False
    rows, k, n = HALF_PROBE
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    t = _alternated_medians({"half": F.linear, "fp32": lambda x, w: _half_as_fp32(x, w, None)}, x, weight)
    _half_wins[key] = t["fp32"] < 0.9 * t["half"]
    return _half_wins[key]


def _half_as_fp32(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` of a 16-bit input and weight computed in fp32 (weight converted `HALF_SLICE` elements
    at a time into this thread's scratch), rounded once to the input's dtype."""
    out_features, in_features = weight.shape
    x = input.reshape(-1, in_features).float()  # [rows, in]
    out = torch.empty(x.shape[0], out_features, dtype=input.dtype, device=input.device)  # [rows, out]
    step = max(1, min(out_features, HALF_SLICE // in_features))
    scratch = getattr(_local, "half_scratch", None)
    if scratch is None or scratch.numel() < step * in_features:
        with torch.inference_mode(False):  # a normal tensor: written inside inference mode and out of it
            scratch = _local.half_scratch = torch.empty(max(HALF_SLICE, step * in_features), dtype=torch.float32)
    for start in range(0, out_features, step):
        end = min(out_features, start + step)
        w = scratch[:(end - start) * in_features].view(end - start, in_features).copy_(weight[start:end])
        b = None if bias is None else bias[start:end].float()
        out[:, start:end] = _kernel(x, w, b, "none", [], "")
    return out.view(*input.shape[:-1], out_features)


def _forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias  # each a module `__getattr__`: read once
    if (getattr(_local, "active", False) and _is_plain(weight, bias) and type(input) is torch.Tensor
            # (`_is_plain` again: a model quantised after `enable`)
            and input.device.type == "cpu" and not torch.is_grad_enabled()):
        if input.dtype == torch.float32 and weight.dtype == torch.float32:
            # One row: whichever kernel streams a weight faster on this CPU and thread count.
            if input.numel() != input.shape[-1] or onednn_wins_at_one_row():
                return _kernel(input, weight, bias, "none", [], "")
        elif (input.dtype is weight.dtype and (bias is None or bias.dtype is weight.dtype)
              and input.numel() >= HALF_ROWS * input.shape[-1] and half_as_fp32_wins(weight.dtype)):
            return _half_as_fp32(input, weight, bias)
    return F.linear(input, weight, bias)


def enable(model: torch.nn.Module) -> int:
    """Give the model's plain `nn.Linear` modules the faster forward (idempotent). Modules that
    already carry an instance `forward` (another library's hook), subclasses (quantised or LoRA layers)
    and linears whose weight is a tensor subclass (torchao's weight-only quantisation) are left alone.
    Returns how many modules have it."""
    if not is_available():
        return 0
    count = 0
    for module in model.modules():
        if (type(module) is torch.nn.Linear and "forward" not in module.__dict__
                and _is_plain(module.weight, module.bias)):
            module.forward = types.MethodType(_forward, module)
            setattr(module, _ATTR, True)
        count += bool(getattr(module, _ATTR, False))
    return count


def disable(model: torch.nn.Module) -> None:
    """Remove what `enable` installed."""
    for module in model.modules():
        if module.__dict__.pop(_ATTR, False):
            module.__dict__.pop("forward", None)


@contextlib.contextmanager
def fast_linear():
    """Within this block (this thread only) enabled linears use the faster kernel."""
    previous = getattr(_local, "active", False)
    _local.active = True
    try:
        yield
    finally:
        _local.active = previous
