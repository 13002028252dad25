"""Rotary frequencies per sequence, for the rope types whose frequencies follow the length.

transformers' rotary modules pick "dynamic" (NTK) and "longrope" frequencies from the largest position
in the whole forward (`modeling_rope_utils.dynamic_rope_update`), and dynamic NTK also remembers the
longest length it has seen. In a packed engine step, or a batch, one sequence would then be rotated
for another's length. hf_paged computes each token as stock computes it for its sequence run alone
(`core.rope.LengthRope` says for which length `S`): a forward hook on each such rotary module replaces
its (cos, sin) while an hf_paged forward is active, grouping the tokens by `S` and calling the module's
own undecorated forward once per group with the frequencies for that `S`. The module itself is never
changed; outside hf_paged's forwards the hook does nothing.

Every rope type transformers ships is classified (`ROPE_TYPES`); one hf_paged does not know is
refused at load (`check_rope_supported`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..core.rope import LengthRope

# How each rope type's frequencies depend on the sequence: the table in docs/models.md is made from this.
ROPE_TYPES: dict[str, str] = {
    "default": "position-independent",
    "linear": "position-independent",
    "yarn": "position-independent",
    "llama3": "position-independent",
    "proportional": "position-independent",
    "dynamic": "per sequence: each token's frequencies are those for its sequence's length when stock computed it",
    "longrope": ("per sequence: short or long factors by its sequence's length; where stock recomputes the cache "
                 "on crossing the threshold (Phi-3, PhiMoE, Phi-4-multimodal), the sequence is recomputed"),
}
_LENGTH_KINDS = {"dynamic": "dynamic", "longrope": "longrope"}


def rope_types_of(config) -> dict[str | None, str]:
    """The rope type of each layer type of `config`'s text model (key None: one for every layer)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return {}
    if "rope_type" in params or "rope_theta" in params:
        return {None: str(params.get("rope_type", "default"))}
    return {lt: str(p.get("rope_type", "default")) for lt, p in params.items() if isinstance(p, dict)}


def rope_kind(rope_type: str) -> str | None:
    """"dynamic" / "longrope" for a rope type whose frequencies follow the length, None for one that
    depends on positions alone. Raises ValueError for a type hf_paged has not classified."""
    if rope_type in _LENGTH_KINDS:
        return _LENGTH_KINDS[rope_type]
    if rope_type in ROPE_TYPES:
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type in ROPE_INIT_FUNCTIONS or "dynamic" in rope_type:
        raise ValueError(
            f"hf_paged has not classified rope type {rope_type!r} (position-independent, or following each "
            "sequence's length); it cannot promise stock's tokens for it. Use attn_implementation='sdpa'")
    return None  # a model's own positional scheme (M-RoPE, ...): its module decides, from positions alone


def default_max_model_len(text_config) -> int | None:
    """The longest sequence the model's positions allow: `max_position_embeddings`, times the factor for
    dynamic NTK (which exists to run past it; as vLLM derives it). None when the config has none."""
    limit = getattr(text_config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    types = rope_types_of(text_config)
    if "dynamic" in types.values():
        params = text_config.rope_parameters
        factors = [float((params if lt is None else params[lt]).get("factor", 1.0))
                   for lt, t in types.items() if t == "dynamic"]
        limit = int(limit * max(factors))
    return limit


def has_length_rope(config) -> bool:
    """Whether some layer of `config`'s text model rotates with frequencies that follow the length."""
    return any(rope_kind(t) is not None for t in rope_types_of(config).values())


def check_rope_supported(config) -> None:
    """Raise ValueError at load for a rope type hf_paged has not classified."""
    for rope_type in rope_types_of(config).values():
        rope_kind(rope_type)


# ---------------------------------------------------------------------------------------- the hook
@dataclass
class _Layer:
    """One layer type of a rotary module whose frequencies follow the length."""

    kind: str
    rope_type: str
    threshold: int
    long_inv_freq: dict = field(default_factory=dict)  # device -> the long factors' inv_freq (longrope)


@dataclass
class _Rotary:
    raw_forward: object  # the module class's forward without `dynamic_rope_update`
    layers: dict  # layer type (None: the only one) -> _Layer


_ROTARIES: "weakref.WeakKeyDictionary[torch.nn.Module, _Rotary]" = weakref.WeakKeyDictionary()
# What the current forward's tokens were computed for: `_TokenLengths` (an engine step) or `_PER_ROW`.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("hf_paged_rope", default=None)
_PER_ROW = object()


@dataclass
class _TokenLengths:
    """A packed step: groups of token indices (of the row `[1, num_tokens]`) that share one `S`."""

    groups: list  # [(S, index tensor [n] or None for every token)]


@functools.lru_cache(maxsize=1)
def _update_wrapper_code():
    """The code object of `dynamic_rope_update`'s wrapper: a rotary forward decorated by it runs this code."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def _is_length_rotary(module: torch.nn.Module) -> bool:
    """A rotary module whose forward goes through `dynamic_rope_update` (under other decorators too: 5.22
    wraps it in `torch.no_grad()`)."""
    if not (hasattr(module, "rope_type") and hasattr(module, "config")):
        return False
    forward = getattr(type(module), "forward", None)
    while forward is not None:
        if getattr(forward, "__code__", None) is _update_wrapper_code():
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def _layers_of(module: torch.nn.Module) -> dict:
    types = module.rope_type if isinstance(module.rope_type, dict) else {None: module.rope_type}
    layers = {}
    for layer_type, rope_type in types.items():
        kind = rope_kind(str(rope_type))
        if kind is None:
            continue
        if kind == "longrope":
            params = module.config.rope_parameters if layer_type is None else module.config.rope_parameters[layer_type]
            threshold = int(params["original_max_position_embeddings"])
        else:
            threshold = int(module.original_max_seq_len)
        layers[layer_type] = _Layer(kind, str(rope_type), threshold)
    return layers


@functools.lru_cache(maxsize=None)
def _at_threshold(model_class: type) -> str | None:
    """What the model's own `prepare_inputs_for_generation` does when a sequence passes
    `original_max_position_embeddings`: "recompute" (Phi-3, PhiMoE: it drops the cache and feeds the whole
    sequence again, so every token is recomputed with the long factors), "last token" (it drops the cache
    but still feeds only the newest token: Phi-4-multimodal in transformers 5.25), or None (nothing)."""
    from transformers.generation.utils import GenerationMixin

    fn = getattr(model_class, "prepare_inputs_for_generation", None)
    if fn is None or fn is GenerationMixin.prepare_inputs_for_generation:
        return None
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    if "original_max_position_embeddings" not in source:
        return None
    return "recompute" if "next_sequence_length" in source else "last token"


def install(model: torch.nn.Module) -> LengthRope | None:
    """Hook every rotary module of `model` whose frequencies follow the length (once per module), and
    return what its sequences record (`LengthRope` without spans), or None when positions alone decide.

    Raises ValueError for an unclassified rope type."""
    layers = []
    for module in model.modules():
        if not _is_length_rotary(module):
            continue
        found = _layers_of(module)
        if not found:
            continue
        if module not in _ROTARIES:
            _ROTARIES[module] = _Rotary(inspect.unwrap(type(module).forward), found)
            module.register_forward_hook(_hook, with_kwargs=True)
        layers.extend(found.values())
    if not layers:
        return None
    kind = "dynamic" if any(layer.kind == "dynamic" for layer in layers) else "longrope"
    threshold = min(layer.threshold for layer in layers)
    text = model.config.get_text_config(decoder=True)
    behaviour = _at_threshold(type(model)) if kind == "longrope" else None
    if behaviour == "last token":
        raise ValueError(
            f"hf_paged cannot serve {type(model).__name__} with longrope: past original_max_position_embeddings "
            f"({text.original_max_position_embeddings}) stock transformers drops the cache and feeds only the "
            "newest token, so its tokens there are not a recomputation hf_paged can reproduce; load it with "
            "attn_implementation='sdpa'")
    recompute = behaviour == "recompute" and getattr(text, "original_max_position_embeddings", None) is not None
    if recompute:
        threshold = int(text.original_max_position_embeddings)  # what stock's prepare_inputs compares with
    return LengthRope(kind=kind, threshold=threshold, recompute=recompute)


@contextlib.contextmanager
def token_lengths(rope_lens: Sequence[int] | None, device: torch.device) -> Iterator[None]:
    """While active, the rotary modules hooked by `install` rotate token `i` of the packed row for
    length `rope_lens[i]`. Does nothing when `rope_lens` is None."""
    if rope_lens is None:
        yield
        return
    by_len: dict[int, list[int]] = {}
    for i, s in enumerate(rope_lens):
        by_len.setdefault(s, []).append(i)
    if len(by_len) == 1:
        groups = [(next(iter(by_len)), None)]
    else:
        groups = [(s, torch.tensor(idx, dtype=torch.long).to(device, non_blocking=True)) for s, idx in by_len.items()]
    token = _ACTIVE.set(_TokenLengths(groups))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def per_row() -> Iterator[None]:
    """While active, each row of a batch is rotated for its own length (its largest position + 1), as
    stock rotates that row run alone (stock `generate` over a `PagedCache`)."""
    token = _ACTIVE.set(_PER_ROW)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class _Frequencies:
    """The rotary module as its forward reads it, with some attributes replaced (never written back)."""

    def __init__(self, module: torch.nn.Module, replaced: dict):
        self.__dict__["_module"] = module
        self.__dict__["_replaced"] = replaced

    def __getattr__(self, name):
        replaced = self.__dict__["_replaced"]
        return replaced[name] if name in replaced else getattr(self.__dict__["_module"], name)


def _replaced(module: torch.nn.Module, layer: _Layer, layer_type: str | None, length: int,
              device: torch.device) -> dict:
    """The attributes the undecorated forward reads, as stock sets them for a sequence of `length`."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    prefix = "" if layer_type is None else f"{layer_type}_"
    if length <= layer.threshold:
        return {f"{prefix}inv_freq": getattr(module, f"{prefix}original_inv_freq").to(device)}
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if layer.kind == "longrope":
        inv_freq = layer.long_inv_freq.get(device)
        if inv_freq is None:
            inv_freq, _ = ROPE_INIT_FUNCTIONS[layer.rope_type](module.config, device, seq_len=layer.threshold + 1,
                                                               **kwargs)
            layer.long_inv_freq[device] = inv_freq = inv_freq.to(device)
        return {f"{prefix}inv_freq": inv_freq}
    # dynamic NTK: the length as stock passes it (a tensor), so the frequencies round as stock's do
    seq_len = torch.tensor(length, dtype=torch.long, device=device)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[layer.rope_type](module.config, device, seq_len=seq_len, **kwargs)
    scaling_name = "attention_scaling" if layer_type is None else f"{layer_type}_attention_scaling"
    return {f"{prefix}inv_freq": inv_freq, scaling_name: scaling}


def _hook(module, args, kwargs, output):
    active = _ACTIVE.get()
    if active is None:
        return None
    rotary = _ROTARIES.get(module)
    if rotary is None:
        return None
    x = args[0] if args else kwargs["x"]
    position_ids = args[1] if len(args) > 1 else kwargs["position_ids"]
    layer_type = args[2] if len(args) > 2 else kwargs.get("layer_type")
    layer = rotary.layers.get(layer_type)
    if layer is None:
        return None  # a layer type at position-independent frequencies
    if position_ids.dim() != 2:
        raise ValueError(f"hf_paged: {layer.rope_type!r} rope over {position_ids.dim()}-D positions is not supported")
    extra = {} if layer_type is None else {"layer_type": layer_type}

    def rotate(positions: torch.Tensor, length: int):
        # One more position, `length - 1`, so that a forward reading the length from its positions (PhiMoE's
        # mscale) reads `length`; its column is dropped.
        proxy = _Frequencies(module, _replaced(module, layer, layer_type, length, positions.device))
        last = positions.new_full((positions.shape[0], 1), length - 1)
        cos, sin = rotary.raw_forward(proxy, x, torch.cat([positions, last], dim=1), **extra)
        return cos[:, :-1], sin[:, :-1]

    if active is _PER_ROW:
        lengths = (position_ids.amax(dim=1) + 1).tolist()
        rows: dict[int, list[int]] = {}
        for r, s in enumerate(lengths):
            rows.setdefault(int(s), []).append(r)
        if len(rows) == 1:
            return rotate(position_ids, next(iter(rows)))
        cos, sin = torch.empty_like(output[0]), torch.empty_like(output[1])
        for s, idx in rows.items():
            index = torch.tensor(idx, device=position_ids.device)
            c, n = rotate(position_ids.index_select(0, index), s)
            cos[index], sin[index] = c, n
        return cos, sin
    if position_ids.shape[0] != 1:
        raise ValueError("hf_paged: a packed step has one row of positions")
    (first_len, first_idx), *rest = active.groups
    if not rest:
        return rotate(position_ids, first_len)
    cos, sin = torch.empty_like(output[0]), torch.empty_like(output[1])
    for s, index in active.groups:
        c, n = rotate(position_ids.index_select(1, index), s)
        cos[:, index], sin[:, index] = c, n
    return cos, sin
