"""Recurrent mixers in packed engine steps: each runs once per sequence (per run: its chunk cut where
the step copies the state out), bound to that sequence's state rows (`state.StateLayer`).

An engine step packs every sequence into one row of tokens; a mixer scans its whole input as one
sequence, so `install_mixers` wraps each mixer module's forward. Runs of one length that all start from
a state (or all from zeros) go as one batch: over consecutive rows as views, otherwise over gathered
copies written back after the call. Attention keeps its one packed call.
"""

from __future__ import annotations

import inspect
import re
import weakref
from dataclasses import dataclass

import torch

from ..attention.interface import UnsupportedModelError
from ..kv_spec import STATE_KINDS
from .state import StateStep
from .support import _INSTEAD, layer_types_of

_CACHE_CALLS = re.compile(r"\b(get_conv_state|update_conv_state|get_recurrent_state|update_recurrent_state)\(")
_STATE_WRITES = re.compile(r"\b(update_conv_state|update_recurrent_state)\(")  # how a mixer keeps its state in a cache


def state_refusal(model_class, config) -> str | None:
    """Why the recurrent layers of `model_class` cannot keep their state in a paged cache, or None: a model
    whose layer types name a state (`kv_spec.STATE_KINDS`) but whose modelling module (its language
    model's, for a wrapper) never calls transformers' linear-attention cache API keeps that state
    elsewhere: in a cache class of its own (MiniMax's `MiniMaxCache.set_linear_cache`, and its model
    refuses any other cache class) or on its modules (RecurrentGemma's `recurrent_states`), where a
    paged cache can neither give each sequence its own nor checkpoint it."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    try:
        if not any(t in STATE_KINDS for t in layer_types_of(config)):
            return None
    except Exception:  # noqa: BLE001 - a config this question cannot read: `check_decoder_supported` says why
        return None
    text = config.get_text_config(decoder=True)
    classes = [model_class, getattr(transformers, MODEL_MAPPING_NAMES.get(text.model_type, ""), None)]
    for cls in classes:
        try:
            source = inspect.getsource(inspect.getmodule(cls)) if cls is not None else ""
        except (OSError, TypeError):
            return None  # unreadable: no refusal from here
        if _STATE_WRITES.search(source):
            return None
    return (f"attn_implementation='hf_paged' cannot serve {model_class.__name__} (model_type={text.model_type!r}): "
            "its recurrent layers keep their state outside transformers' linear-attention cache API (their "
            "modelling code never calls update_conv_state / update_recurrent_state: a cache class or module "
            "attributes of its own), which is what the paged cache gives each sequence and checkpoints; "
            f"{_INSTEAD}")


def mixer_modules(model: torch.nn.Module, layers: set[int]) -> dict[int, torch.nn.Module]:
    """Per recurrent layer index, the module whose forward runs its mixer: the module with that
    `layer_idx` whose class reads or writes the cache's conv / recurrent state, directly or through a
    function of its modelling module (transformers' `causal_conv1d_forward`, `mamba2_scan_forward`)."""
    out: dict[int, torch.nn.Module] = {}
    helpers_of: dict[object, set[str]] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if idx not in layers or idx in out:
            continue
        source_module = inspect.getmodule(type(module))
        if source_module not in helpers_of:
            helpers_of[source_module] = _state_helpers(source_module)
        try:
            source = inspect.getsource(type(module))
        except (OSError, TypeError):
            continue
        if _CACHE_CALLS.search(source) or any(re.search(rf"\b{name}\(", source) for name in helpers_of[source_module]):
            out[idx] = module
    return out


def _state_helpers(module) -> set[str]:
    """Names of the top-level functions of a modelling module that touch a cache's state (read from its
    source: transformers wraps some in kernel-dispatching objects that are not plain functions)."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return set()
    starts = [m for m in re.finditer(r"^(?:def (\w+)\(|class |@)", source, re.M)]  # top-level definitions
    names = set()
    for m, after in zip(starts, [*starts[1:], None]):
        if m.group(1) and _CACHE_CALLS.search(source[m.start():after.start() if after else None]):
            names.add(m.group(1))
    return names


def install_mixers(model: torch.nn.Module, kv) -> list[int]:
    """Make each recurrent layer's mixer run per sequence in `kv`'s packed steps (a step whose metadata
    has a `StateStep`); any other call runs as before. Returns the layers wrapped.

    Raises:
        UnsupportedModelError: a recurrent layer whose mixer module cannot be found: it could not be
            given its sequences separately, so it is refused rather than run over the packed batch.
    """
    layers = set(kv.states.shapes) if kv.states is not None else set()
    found = mixer_modules(model, layers)
    missing = sorted(layers - set(found))
    if missing:
        reason = state_refusal(type(model), model.config)  # the exact reason, where the modelling code shows it
        if reason is not None:
            raise UnsupportedModelError(reason)
        raise UnsupportedModelError(
            f"hf_paged: cannot find the mixer module of recurrent layers {missing} of model_type="
            f"{model.config.model_type!r} (a module with that layer_idx that reads the cache's conv or recurrent "
            "state), so a packed step cannot run it per sequence; load it with attn_implementation='sdpa'")
    for idx, module in found.items():
        if module not in _WRAPPED:
            tiles = "torch_chunk_gated_delta_rule(" in inspect.getsource(type(module))
            module.forward = _per_sequence(module.forward, idx, tiles)
            _WRAPPED.add(module)
    return sorted(found)


def _chunk_size(num_tokens: int) -> int | None:
    """The chunk the gated delta rule's torch path should tile a run of `num_tokens` with: it pads every
    run to a multiple of its default 64, so a 16-token run (a checkpoint interval) would cost four
    times its work; the chunked rule is exact for any chunk size. None: its default."""
    for size in (64, 32, 16):
        if num_tokens % size == 0:
            return None if size == 64 else size
    return None


_WRAPPED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # mixers already running per sequence


@dataclass(frozen=True)
class _Run:
    """One mixer run of one sequence: packed tokens `first .. stop - 1`, from its state or from zeros, its
    state then copied to row `save` (None: not copied)."""

    seq: int
    first: int
    stop: int
    has_previous: bool
    save: int | None


def _waves(state: StateStep, resumes: bool) -> list[list[_Run]]:
    """Each sequence's runs in order (its chunk cut where the step saves its state, and, for a mixer that
    cannot resume over several tokens, one token at a time after its first run), as waves: wave w holds
    every sequence's w-th run, so the runs of one wave can go as batches."""
    waves: list[list[_Run]] = []
    pos = 0
    for i, (n, has_previous, saves) in enumerate(zip(state.q_lens, state.has_previous, state.saves)):
        runs, done = [], 0
        for end, target in [*saves, (n, None)]:
            while end > done:
                resuming = has_previous or done > 0
                stop = end if resumes or not resuming else done + 1
                runs.append(_Run(i, pos + done, pos + stop, resuming, target if stop == end else None))
                done = stop
        for w, run in enumerate(runs):
            if w == len(waves):
                waves.append([])
            waves[w].append(run)
        pos += n
    return waves


def _batches(state: StateStep, resumes: bool, device: torch.device) -> list[tuple]:
    """The step's mixer calls, the same in every recurrent layer, so made once per step (kept on `state`):
    per wave (`_waves`), the runs of one length that all start from a state (or all from zeros), as
    (length, has_previous, runs, their rows, whether those are consecutive, the packed token index [runs,
    length] on `device`)."""
    key = (resumes, str(device))
    if key not in state.batches:
        batches = []
        for wave in _waves(state, resumes):
            groups: dict[tuple[int, bool], list[_Run]] = {}
            for r in wave:
                groups.setdefault((r.stop - r.first, r.has_previous), []).append(r)
            for (length, has_previous), runs in groups.items():
                index = torch.tensor([list(range(r.first, r.stop)) for r in runs], device=device)
                rows = [state.rows[r.seq] for r in runs]
                consecutive = rows == list(range(rows[0], rows[0] + len(rows)))  # readable as views, no copies
                batches.append((length, has_previous, runs, rows, consecutive, index))
        state.batches[key] = batches
    return state.batches[key]


def _per_sequence(forward, layer_idx: int, tiles: bool = False):
    """`forward` run per sequence in packed steps; `tiles`: the mixer calls the gated delta rule's torch
    path, which takes a `chunk_size` (passed on CPU only: the GPU kernels tile themselves)."""
    def run(hidden_states, *args, **kwargs):
        # The pool is the one the call's cache adapts (several engines may serve one model in turn).
        cache = next((a for a in (*args, *kwargs.values()) if hasattr(a, "kv") and hasattr(a.kv, "states")), None)
        kv = cache.kv if cache is not None else None
        step = kv.step if kv is not None else None
        state = getattr(step, "state", None) if step is not None else None
        if state is None:
            return forward(hidden_states, *args, **kwargs)
        kwargs.pop("attention_mask", None)  # packed steps hold no padding
        layer = kv.layers[layer_idx]
        total = hidden_states.shape[1]
        pieces: list[tuple[int, torch.Tensor]] = []  # (first packed token, [1, tokens, hidden])
        batches = _batches(state, kv.states.resumes, hidden_states.device)
        for length, has_previous, runs, rows, consecutive, index in batches:
            chunk = _chunk_size(length) if tiles and hidden_states.device.type == "cpu" else None
            if consecutive:
                layer.bind(rows[0], len(rows), has_previous)
            else:
                layer.bind_rows(rows, has_previous)
            try:
                out = forward(_gather(hidden_states, total, index), *[_gather(a, total, index) for a in args],
                              **{k: _gather(v, total, index) for k, v in kwargs.items()},
                              **({"chunk_size": chunk} if chunk else {}))
            finally:
                layer.write_back()
            pieces.extend((r.first, _row(out, j)) for j, r in enumerate(runs))
            saves = [(state.rows[r.seq], r.save) for r in runs if r.save is not None]
            if saves:
                kv.states.copy_rows([a for a, _ in saves], [b for _, b in saves], layer=layer_idx)
        pieces.sort(key=lambda piece: piece[0])
        return _join([p for _, p in pieces])

    return run


def _row(out, j: int):
    """Run `j` of a batched call's output (each per-token tensor of a tuple too), kept [1, tokens, ...]."""
    if isinstance(out, tuple):
        return tuple(_row(o, j) for o in out)
    return out[j:j + 1] if isinstance(out, torch.Tensor) else out


def _join(outs: list):
    """The runs' outputs, in token order, as one call over the packed tokens returns them: a tensor
    ([1, tokens, ...]), or a tuple whose per-token tensors are joined each (ZAYA's q/k/v projection returns
    three: its caller unpacks them) and whose other items (a returned state) are the last run's."""
    first = outs[0]
    if not isinstance(first, tuple):
        return torch.cat(outs, dim=1)
    joined = []
    for k, item in enumerate(first):
        if isinstance(item, torch.Tensor) and item.dim() >= 2 and all(
                isinstance(o[k], torch.Tensor) and o[k].dim() == item.dim() and o[k].shape[0] == 1
                and o[k].shape[2:] == item.shape[2:] for o in outs):
            joined.append(torch.cat([o[k] for o in outs], dim=1))
        else:
            joined.append(outs[-1][k])
    return tuple(joined)


def _gather(value, total: int, index: torch.Tensor):
    """A per-token argument ([1, total, ...]) at the packed tokens `index` ([runs, tokens]): [runs, tokens,
    ...]; anything else as is."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == total:
        return value[0][index.to(value.device)]
    return value
