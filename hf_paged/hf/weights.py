"""Which weights a cached prefix was computed with.

A block's K/V are a function of its tokens *and* the model's weights. The prefix cache hashes
tokens only, so every sequence is salted with a weights epoch, and the epoch moves on whenever
`weights_fingerprint(model)` changes (the prefix cache is then dropped). Torch appears only to read
parameters; nothing here touches K/V.

What the fingerprint watches, and so which weight changes need nothing from the user:

* **Which parameters there are** (their identity, walking the module tree): a module or parameter
  replaced or added (`module.weight = nn.Parameter(...)`, `load_state_dict(assign=True)`, an adapter
  injected or deleted, a layer swapped).
* **Where each parameter's memory is, its dtype and shape**: `p.data = t`, `model.to(dtype)`,
  `model.half()`, a move between devices, `vector_to_parameters`.
* **Each parameter's version counter**, which every in-place write through the parameter or an alias
  made by `detach()` bumps, whichever elements it writes: optimizer steps (foreach and fused too),
  `load_state_dict`, `with torch.no_grad(): p.mul_(...)`, `p.detach().copy_(...)`.
* **A sampled checksum of the values**: `NUM_SAMPLES` elements per parameter, evenly spaced over the
  flattened tensor (so a row-major matrix is sampled in different rows and columns), compared bit for
  bit. It exists for writes that bypass the version counter: anything through `p.data`
  (`p.data.copy_(...)`, EMA updates, a collective or CUDA IPC writing into `p.data`). Such a write is
  seen when it changes at least one sampled element of at least one parameter, as a whole-tensor
  rewrite (a weight sync, an EMA update, a round trip through fp16) does.
* **PEFT adapter state**, by duck typing (peft is never imported): for every tuner layer (a module
  whose class has `active_adapter` and `disable_adapters` properties, as peft's `BaseTunerLayer`
  and `ModulesToSaveWrapper` do), its active adapter(s), its disabled flag, its merged adapters and
  LoRA's `scaling`. So `set_adapter`, `enable_adapters`/`disable_adapters` (or `disable_adapter_layers`),
  the `disable_adapter()` context manager, `merge_adapter`/`unmerge_adapter` and `set_scale` are seen,
  whether called on a `PeftModel` or through transformers' adapter methods (they flip the same layers).
* **`invalidate(model)`**: a counter on every module, which the fingerprint sums.

What it cannot see, and needs `invalidate(model)` after the change:

* A write that bypasses the version counter (through `p.data`, raw pointers) and leaves every
  sampled element bitwise unchanged: one element, a few rows of an embedding, a slice.
* Re-viewing the same memory with only new strides (`p.data = p.data.t()` on a square matrix).
* Buffers (RoPE `inv_freq` and the like), the model's config, forward hooks or replaced `forward`
  methods, and adapter machinery other than peft-style tuner layers.
* Tensor subclasses without plain storage (DTensor, some quantized tensors): only their identity and
  version counter are watched.

Cost: one walk of the module tree, a few attribute reads per parameter, one `as_strided` view per
parameter, one `torch.cat` per dtype and one host copy per device (see `weights_fingerprint`). Which
elements to read is planned again only when a parameter's identity, memory, version, dtype or shape
changed. Between calls nothing holds a parameter's memory (the plan keeps offsets, not views), so
`p.data = t` frees the old tensor as it would without hf_paged.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref

import torch

NUM_SAMPLES = 16  # values compared per parameter; the cost is per parameter, not per sample
VERSION_ATTR = "hf_paged_weights_version"  # the counter `invalidate` bumps on every module


def invalidate(model: torch.nn.Module) -> None:
    """Declare that `model`'s weights changed in a way `weights_fingerprint` cannot see (see this
    module's docstring): every cache serving it drops its prefix cache before its next new sequence.

    Args:
        model: the model, any module inside it, or a wrapper around it (a `PeftModel`): the counter is
            bumped on every module of `model.modules()`, and the fingerprint sums it over its tree.
    """
    for module in model.modules():
        module.__dict__[VERSION_ATTR] = module.__dict__.get(VERSION_ATTR, 0) + 1


def weights_fingerprint(model: torch.nn.Module) -> tuple:
    """A value that changes whenever the weights `model` computes with change (see this module's
    docstring for exactly which changes that covers). Compare fingerprints with `==`.

    Host time grows with the number of parameters and modules, not their size: about 0.8 ms for
    SmolLM2-135M (273 parameters, 397 modules) on a 2-core CPU, most of it the 273 strided views and
    their `torch.cat`. Engines should call it when they admit new sequences, not every step.
    """
    params, adapter_state, num_invalidations = _walk(model)
    try:
        key = tuple([(id(p), p.data_ptr(), p._version, p.dtype, p.shape) for p in params])
    except RuntimeError:  # a tensor without storage or version counter (inference tensor, DTensor)
        key = tuple([_slow_key(p) for p in params])
    plan = _PLANS.get(model)
    if plan is None or plan.key != key:
        plan = _PLANS[model] = _SamplePlan(key, params)
    try:
        samples = plan.sample(params)
    except RuntimeError:  # the plan no longer fits memory that changed under equal keys: rebuild
        plan = _PLANS[model] = _SamplePlan(key, params)
        samples = plan.sample(params)
    return plan.serial, samples, adapter_state, num_invalidations


def _walk(model: torch.nn.Module) -> tuple[list, tuple, int]:
    """Every parameter of the module tree, each tuner layer's adapter state and the sum of the
    `invalidate` counters. Reads `_parameters`/`_modules` directly, breadth first, without the name
    prefixes and memo of `model.parameters()` (several times slower): a module or parameter that two
    parents share is listed twice, which changes nothing. (PyTorch itself cannot `.to()` or `.eval()`
    a module tree with a cycle, so there is none to guard against.)"""
    params, num_invalidations = [], 0
    modules = [model]
    for module in modules:  # grows while it is read
        if module is None:  # `_modules` may hold None (a submodule set to None)
            continue
        attrs = module.__dict__
        params += attrs["_parameters"].values()
        num_invalidations += attrs.get(VERSION_ATTR, 0)
        modules += attrs["_modules"].values()
    adapter_state = tuple([_adapter_state(m) for m in modules if m is not None and _is_tuner_layer(type(m))])
    return [p for p in params if p is not None], adapter_state, num_invalidations


@functools.cache
def _is_tuner_layer(cls: type) -> bool:
    """peft's `BaseTunerLayer` and `AuxiliaryTrainingWrapper`, by duck typing (properties, not the
    methods of the same names that transformers' `PeftAdapterMixin` puts on a whole model)."""
    names = ("active_adapter", "disable_adapters")
    return all(isinstance(getattr(cls, name, None), property) for name in names)


def _adapter_state(layer: torch.nn.Module) -> tuple:
    active = layer.active_adapter
    merged = layer.__dict__.get("merged_adapters", ())
    scaling = layer.__dict__.get("scaling")
    if isinstance(scaling, dict):  # LoRA's per-adapter floats (a tensor would make `==` ambiguous)
        scaling = tuple(item for item in scaling.items() if isinstance(item[1], (int, float)))
    return (
        tuple(active) if isinstance(active, list) else active,
        bool(layer.disable_adapters),
        tuple(merged),
        scaling if isinstance(scaling, tuple) else None,
    )


def _slow_key(p: torch.Tensor) -> tuple:
    try:
        ptr = p.data_ptr()
    except RuntimeError:
        ptr = None
    version = None if p.is_inference() else p._version
    return id(p), ptr, version, p.dtype, p.shape


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its _SamplePlan
_SERIALS = itertools.count()


class _SamplePlan:
    """Which elements of each parameter the checksum reads, for one key (identity, memory, version,
    dtype, shape of every parameter). Holds integers and small index tensors, never a parameter's
    memory. `serial` is unique to this plan, so a fingerprint names the key without carrying it.

    A contiguous parameter is read through one strided view of its storage (no copy, no kernel); a
    non-contiguous one through `torch.take` of logical positions (rare: transformers stores weights
    contiguous). Meta, empty and storage-less parameters are not sampled."""

    def __init__(self, key: tuple, params: list[torch.Tensor]):
        self.key = key
        self.serial = next(_SERIALS)
        # device -> dtype -> ([(param index, as_strided args)], [(param index, take indices)])
        self.groups: dict[torch.device, dict[torch.dtype, tuple[list, list]]] = {}
        with torch.inference_mode():
            for i, p in enumerate(params):
                with contextlib.suppress(RuntimeError, TypeError, NotImplementedError):
                    self._add(i, p)
            for by_dtype in self.groups.values():
                for dtype, group in list(by_dtype.items()):
                    try:  # what `sample` does, on one parameter of the group: fail here, not there
                        self._gather(params, group[0][:1], group[1][:1])
                    except (RuntimeError, TypeError, NotImplementedError):
                        del by_dtype[dtype]  # e.g. a dtype `cat` lacks: identity and version only

    def _add(self, i: int, p: torch.Tensor) -> None:
        if type(p.data) is not torch.Tensor:  # a subclass (DTensor, torchao): storage is not values
            return
        if p.is_meta or p.layout != torch.strided or p.is_quantized or p.numel() == 0:
            return
        n = p.numel()
        k = min(NUM_SAMPLES, n)
        step = n // k
        if p.dim() > 1 and step > 1 and step % p.shape[-1] == 0:
            step -= 1  # else every sample would fall in the same column
        start = (n - 1 - (k - 1) * step) // 2  # centred: neither end of the tensor is favoured
        strided, taken = self.groups.setdefault(p.device, {}).setdefault(p.dtype, ([], []))
        if p.is_contiguous():  # the last sample is at start + (k - 1) * step < n: inside the tensor
            strided.append((i, ((k,), (step,), p.storage_offset() + start)))
        else:
            taken.append((i, torch.arange(start, start + k * step, step, device=p.device)))

    @staticmethod
    def _gather(params: list[torch.Tensor], strided: list, taken: list) -> torch.Tensor:  # [bytes] uint8
        values = [params[i].as_strided(*args) for i, args in strided]
        values += [torch.take(params[i], index) for i, index in taken]
        return torch.cat(values).view(torch.uint8)

    def sample(self, params: list[torch.Tensor]) -> tuple[bytes, ...]:
        """The sampled elements' bytes, one string per device (one device-to-host copy each)."""
        out = []
        with torch.inference_mode():
            for by_dtype in self.groups.values():
                parts = [self._gather(params, strided, taken) for strided, taken in by_dtype.values()]
                if parts:
                    out.append((torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy().tobytes())
        return tuple(out)


class WeightsEpoch:
    """The current weights epoch of one cache, advanced by `note` when the fingerprint changes.

    Args:
        on_change: called when the weights changed since the last `note` (drops the prefix cache).
    """

    def __init__(self, on_change):
        self.epoch = 0
        self._fingerprint = None
        self._on_change = on_change

    def note(self, fingerprint) -> None:
        """Called before new sequences are hashed, with the model's fingerprint. If it changed since
        the last call, cached prefixes were computed with other weights: forget them, and start a new
        epoch so that nothing computed before can ever be hit again."""
        if self._fingerprint is not None and fingerprint != self._fingerprint:
            self._on_change()
            self.epoch += 1
        self._fingerprint = fingerprint
