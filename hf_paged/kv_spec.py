"""Layer kinds as specs: one object per decoder layer says what its K/V costs and which of it a query
that can still come may read. Torch-free, like `config`: the block manager, the scheduler, the
planner (`kv-size`, `plan`) and the cache all count with these answers, so adding a layer kind is one
spec here and one mask rule per attention backend (`attention.backend`).

vLLM keeps the same idea in `kv_cache_interface.py` (FullAttentionSpec, SlidingWindowSpec,
ChunkedLocalAttentionSpec, MambaSpec, one manager per spec type); ours also serves the drop-in
`Cache` path, and derives every spec from the model's config alone (`layer_specs`).

The one equation each kind differs by is the first key a future query may read. With `n` tokens stored
and the next query at position >= n - lookback (lookback: tokens a step may roll back, e.g. rejected
speculative drafts):

    full attention           0
    sliding window w         max(0, n - lookback - w + 1)        a query at p reads p - w + 1 .. p
    chunked local, chunk C   ((n - lookback) // C) * C           a query at p reads (p // C) * C .. p

Every leading block whose tokens all lie before that position is freed; a prefix-cache hit of k tokens
needs the cached blocks from `first_readable(k) // block_size` on (all of them for full attention).
While a step writes `c` tokens, a sliding or chunked layer holds at most `w - 1 + c + lookback` (C - 1
+ ...) tokens, plus one block for alignment.

A layer that reads another layer's K/V (Gemma 3n's and Gemma 4's "reuse" layers) is a `SharedKV`: it
owns no blocks and no storage and costs nothing; its mask is its own kind's, its K/V its source's.

Multi-head latent attention (DeepSeek V2/V3, Kimi K2, MiniCPM3: a config with `kv_lora_rank`) is a
`LatentAttention`: it stores one row per token, the compressed latent (`kv_lora_rank`) then the rotary
key (`qk_rope_head_dim`), as a single K/V "head" that every query head reads (the up-projections are
absorbed into the query and the output, `hf.latent`), and, for DeepSeek V3.2's indexed sparse
attention, the indexer's key (`index_head_dim`) after them. Its mask is causal: the indexer picks
each query's `index_topk` keys at run time, so every earlier token stays readable.

A layer that carries a per-sequence state instead of (or beside) K/V (Mamba, gated delta-rule linear
attention: a short convolution window and a recurrent state) has a `StateShape`: `LinearState` for a
layer with the state only, any attention spec with `state=` for a layer with both (Falcon-H1's
"hybrid"). Its cost is per sequence, not per token (`state_spec` has the formulas); a layer with
neither (Nemotron-H's MLP and MoE layers) is `NoCache`.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from .state_spec import StateShape, state_shape

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
LINEAR = "linear_attention"  # a per-sequence state only (Mamba, gated delta rule)
CONV = "conv"  # a per-sequence convolution window only (LFM2)
HYBRID = "hybrid"  # full attention and a per-sequence state in one layer (Falcon-H1)
INDEXED = "indexed_attention"  # latent attention over the top-k keys an indexer picks (DeepSeek V3.2, GLM-5)
LATENT = "latent_attention"  # hf_paged's kind for an MLA layer (transformers calls it full or indexed)
NO_CACHE = ("mlp", "moe")  # layers that cache nothing (Nemotron-H)
# The decoder layer types (transformers' `layer_types` names) a paged cache serves.
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED, INDEXED)
STATE_KINDS = (LINEAR, CONV, HYBRID)
LAYER_KINDS = ATTENTION_KINDS + STATE_KINDS + NO_CACHE


@dataclass(frozen=True)
class KVShape:
    """The K/V a layer stores per token, on one tensor-parallel rank."""

    num_kv_heads: int
    head_dim: int
    head_dim_v: int

    def __post_init__(self):
        for name in ("num_kv_heads", "head_dim", "head_dim_v"):
            _check_positive(name, getattr(self, name))

    @property
    def elements_per_token(self) -> int:
        """K and V elements one token costs in this layer."""
        return self.num_kv_heads * (self.head_dim + self.head_dim_v)


@dataclass(frozen=True)
class MaskRule:
    """What attention applies on top of causality (the one definition the specs and the attention
    backends share): key j is visible to query p iff j <= p and j >= `lower_bound(p)`. Positions are
    per-sequence positions of real tokens (left padding is not a position).

    Attributes:
        window: a sliding window w >= 1 (key j visible iff j > p - w), or None.
        chunk: a local-attention chunk C >= 1 (Llama 4: key j visible iff j >= (p // C) * C), or None.
    """

    window: int | None = None
    chunk: int | None = None

    def __post_init__(self):
        for name, label in (("window", "sliding_window"), ("chunk", "chunk_size")):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                number = operator.index(value)  # ints, numpy and 0-d integer tensors; not floats or bools
            except TypeError:
                number = None
            if number is None or isinstance(value, bool) or number < 1:
                raise ValueError(f"{label} must be an int >= 1 or None, got {value!r}")
            object.__setattr__(self, name, number)

    @functools.cached_property
    def kinds(self) -> frozenset[str]:
        """The bounds in force ("window", "chunk"); empty for plain causal attention."""
        return frozenset(name for name in ("window", "chunk") if getattr(self, name) is not None)

    def lower_bound(self, position: int) -> int:
        """The first key position a query at `position` reads."""
        low = 0
        if self.window is not None:
            low = max(low, position - self.window + 1)
        if self.chunk is not None:
            low = max(low, (position // self.chunk) * self.chunk)
        return low


@dataclass(frozen=True)
class LayerSpec:
    """A layer that keeps the K/V of every token it reads (full attention); the base of every kind.

    Attributes:
        shape: the K/V it stores per token, or None when only the states tell (the cache then
            allocates from what the layer passes to `cache.update`).
        state: the per-sequence state it also carries (Falcon-H1's hybrid layers), or None.
    """

    shape: KVShape | None = None
    state: StateShape | None = None
    kind = FULL

    @property
    def owns_kv(self) -> bool:
        """Whether the layer stores K/V of its own (False: it reads another layer's)."""
        return True

    @property
    def mask(self) -> MaskRule:
        return MaskRule()

    @property
    def kv_elements_per_token(self) -> int | None:
        """K and V elements one token costs in this layer's own storage (0: it stores none; None: the
        shape is unknown)."""
        if not self.owns_kv:
            return 0
        return None if self.shape is None else self.shape.elements_per_token

    @property
    def reach(self) -> int | None:
        """The most tokens before a query's own that it reads (None: every token); what bounds the
        tokens a layer of this kind holds."""
        return None

    def first_readable(self, num_tokens: int, lookback: int = 0) -> int:
        """The earliest key position a query that can still come may read (see the module docstring)."""
        check_counts(num_tokens=num_tokens, lookback=lookback)
        return 0

    def max_tokens_held(self, new_tokens: int, lookback: int = 0) -> int | None:
        """The most tokens one sequence's table of this kind holds while a step writes `new_tokens`
        (block rounding aside); None: every token (full attention)."""
        return None if self.reach is None else self.reach + new_tokens + lookback

    @property
    def group_key(self) -> tuple:
        """Layers with equal keys share one block table (`config.kv_layout`)."""
        return (self.kind, self.mask, self.shape)


@dataclass(frozen=True)
class FullAttention(LayerSpec):
    """Causal attention over every earlier token."""


@dataclass(frozen=True)
class SlidingWindow(LayerSpec):
    """Causal attention over the last `window` tokens (the query's own included), transformers'
    `sliding_window`."""

    window: int = 0
    kind = SLIDING

    def __post_init__(self):
        _check_positive("sliding window", self.window)

    @property
    def mask(self) -> MaskRule:
        return MaskRule(window=self.window)

    @property
    def reach(self) -> int:
        return self.window - 1

    def first_readable(self, num_tokens: int, lookback: int = 0) -> int:
        check_counts(num_tokens=num_tokens, lookback=lookback)
        return max(0, num_tokens - lookback - self.window + 1)


@dataclass(frozen=True)
class ChunkedLocal(LayerSpec):
    """Causal attention inside fixed chunks of `chunk` tokens (Llama 4's `attention_chunk_size`): a
    query at p reads keys (p // chunk) * chunk .. p."""

    chunk: int = 0
    kind = CHUNKED

    def __post_init__(self):
        _check_positive("attention chunk size", self.chunk)

    @property
    def mask(self) -> MaskRule:
        return MaskRule(chunk=self.chunk)

    @property
    def reach(self) -> int:
        return self.chunk - 1

    def first_readable(self, num_tokens: int, lookback: int = 0) -> int:
        check_counts(num_tokens=num_tokens, lookback=lookback)
        return ((num_tokens - lookback) // self.chunk) * self.chunk if num_tokens >= lookback else 0


@dataclass(frozen=True)
class LatentAttention(LayerSpec):
    """Multi-head latent attention: per token one row of `shape.head_dim` latent (`kv_lora_rank`)
    and `shape.head_dim_v` rotary key (`qk_rope_head_dim`), one shared head (`shape.num_kv_heads` 1),
    then `index_dim` indexer-key elements for indexed sparse attention (0: none).

    Attributes:
        index_dim: the indexer key's width per token (`index_head_dim`), 0 for plain MLA.
        index_topk: how many keys each query attends to (`index_topk`), 0 for plain MLA (all).
    """

    index_dim: int = 0
    index_topk: int = 0
    kind = LATENT

    def __post_init__(self):
        if self.shape is None or self.shape.num_kv_heads != 1:
            raise ValueError("a latent-attention layer stores one shared latent head: KVShape(1, kv_lora_rank, "
                             f"qk_rope_head_dim), got {self.shape!r}")
        for name in ("index_dim", "index_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if bool(self.index_dim) != bool(self.index_topk):
            raise ValueError(f"an indexed latent layer needs both index_dim and index_topk, got {self.index_dim} and "
                             f"{self.index_topk}")

    @property
    def row_width(self) -> int:
        """Elements of one token's row: latent, rotary key, indexer key."""
        return self.shape.head_dim + self.shape.head_dim_v + self.index_dim

    @property
    def kv_elements_per_token(self) -> int:
        return self.row_width

    @property
    def group_key(self) -> tuple:
        return (self.kind, self.mask, self.shape, self.index_dim)


@dataclass(frozen=True)
class SharedKV(LayerSpec):
    """A layer that attends over layer `source`'s K/V and stores none (Gemma 3n/4 "reuse" layers).

    Attributes:
        source: the layer whose K/V it reads (a layer that owns K/V of the same kind).
        reads: the layer's own spec as if it stored K/V: its mask.
    """

    source: int = 0
    reads: LayerSpec = field(default_factory=FullAttention)
    kind = "shared_kv"

    @property
    def owns_kv(self) -> bool:
        return False

    @property
    def mask(self) -> MaskRule:
        return self.reads.mask

    @property
    def reach(self) -> int | None:
        return self.reads.reach

    def __post_init__(self):
        if isinstance(self.source, bool) or not isinstance(self.source, int) or self.source < 0:
            raise ValueError(f"a shared-K/V layer's source must be a layer index >= 0, got {self.source!r}")
        if not self.reads.owns_kv:
            raise ValueError("a shared-K/V layer reads as a kind that stores K/V, not as another SharedKV")

    def first_readable(self, num_tokens: int, lookback: int = 0) -> int:
        return self.reads.first_readable(num_tokens, lookback)

    def max_tokens_held(self, new_tokens: int, lookback: int = 0) -> int:
        """Nothing: its source's group holds the tokens it reads."""
        return 0


@dataclass(frozen=True)
class LinearState(LayerSpec):
    """A layer that carries a per-sequence state and no K/V (Mamba mixers, gated delta-rule linear
    attention): it joins no block table; its `state` (required) is what a sequence holds in it."""

    kind = LINEAR

    def __post_init__(self):
        if self.state is None:
            raise ValueError("a linear-attention layer spec needs its state shape")

    @property
    def owns_kv(self) -> bool:
        return False

    def max_tokens_held(self, new_tokens: int, lookback: int = 0) -> int:
        return 0


@dataclass(frozen=True)
class NoCache(LayerSpec):
    """A layer that caches nothing (an MLP or MoE layer in Nemotron-H's layer list)."""

    kind = "no_cache"

    @property
    def owns_kv(self) -> bool:
        return False

    def max_tokens_held(self, new_tokens: int, lookback: int = 0) -> int:
        return 0


def keeps_kv_elsewhere(spec: LayerSpec) -> bool:
    """Whether a layer that stores no K/V still reads some (a `SharedKV`): False for a state or
    cache-free layer, which joins no block table and reads none."""
    return isinstance(spec, SharedKV)


def state_specs(specs: Sequence[LayerSpec]) -> dict[int, StateShape]:
    """Per layer that carries a per-sequence state, its shape."""
    return {i: s.state for i, s in enumerate(specs) if s.state is not None}


def map_shapes(specs: Sequence[LayerSpec], fn) -> tuple[LayerSpec, ...]:
    """`specs` with every K/V shape replaced by `fn(shape)` (a `SharedKV`'s own and its reads' alike):
    a tensor-parallel rank's share of the heads, or a what-if head count."""
    def one(spec: LayerSpec) -> LayerSpec:
        if spec.shape is None and not isinstance(spec, SharedKV):
            return spec
        shape = None if spec.shape is None else fn(spec.shape)
        if isinstance(spec, SharedKV):
            return replace(spec, shape=shape, reads=one(spec.reads))
        return replace(spec, shape=shape)

    return tuple(one(spec) for spec in specs)


# ----------------------------------------------------------------------------------- from a config
def layer_specs(config: Mapping[str, Any], tensor_parallel_size: int = 1) -> tuple[LayerSpec, ...]:
    """One spec per decoder layer of a text config given as a dict (a config's `to_dict()`, or the
    planner's config.json), the way transformers' own caches and masks read it.

    Reads `layer_types` (or Llama 4's `no_rope_layers` / `attention_chunk_size`, or a legacy
    `sliding_window` that slides every layer), `sliding_window`, `attention_chunk_size`, Gemma 3n/4's
    `num_kv_shared_layers` (the last layers reuse the K/V of the last earlier layer of their type),
    and per-layer K/V shapes (`per_layer_config`, or Gemma 4's `global_head_dim` /
    `num_global_key_value_heads` on full-attention layers).

    Raises:
        ValueError: a layer type outside `LAYER_KINDS`, a reuse layer with no source of its type, a
            window or chunk that is not a positive integer, or a tensor-parallel size that does not
            divide a layer's KV heads.
    """
    types = layer_types(config)
    shapes = layer_shapes(config, len(types), tensor_parallel_size) if any(t in ATTENTION_KINDS + (HYBRID,)
                                                                              for t in types) else [None] * len(types)
    state = None
    if any(t in STATE_KINDS for t in types):
        state = state_shape(config)
    specs: list[LayerSpec] = []
    latent = latent_shape(config, tensor_parallel_size)
    for i, (kind, shape) in enumerate(zip(types, shapes)):
        if latent is not None and kind in (FULL, INDEXED, HYBRID):
            if kind == HYBRID:
                raise ValueError(f"layer {i}: a hybrid layer with latent attention is not a kind hf_paged knows")
            indexed = kind == INDEXED
            specs.append(LatentAttention(latent, index_dim=_int(config.get("index_head_dim"), "index_head_dim")
                                         if indexed else 0,
                                         index_topk=_int(config.get("index_topk"), "index_topk") if indexed else 0))
        elif kind == FULL:
            specs.append(FullAttention(shape))
        elif kind == HYBRID:
            specs.append(FullAttention(shape, state=state))
        elif kind in (LINEAR, CONV):
            specs.append(LinearState(state=state))
        elif kind in NO_CACHE:
            specs.append(NoCache())
        elif kind == SLIDING:
            specs.append(SlidingWindow(shape, window=_int(config.get("sliding_window"), "sliding_window")))
        elif kind == CHUNKED:
            specs.append(ChunkedLocal(shape, chunk=_int(config.get("attention_chunk_size"), "attention_chunk_size")))
        elif kind == INDEXED:
            raise ValueError(f"layer {i}: indexed attention needs latent attention (a kv_lora_rank in the config): "
                             "an indexer's keys are kept beside the latent")
        else:
            raise ValueError(f"layer {i}: layer type {kind!r} is not one a paged cache serves {LAYER_KINDS}")
    for i, source in enumerate(kv_sources(config, types)):
        if source is not None:
            specs[i] = SharedKV(specs[source].shape, source=source, reads=specs[i])
    return tuple(specs)


def latent_shape(config: Mapping[str, Any], tensor_parallel_size: int = 1) -> KVShape | None:
    """The row shape of a multi-head latent attention layer (`kv_lora_rank`, `qk_rope_head_dim`; one
    shared head, the same on every tensor-parallel rank: transformers splits the query heads and the
    up-projection, and every rank keeps the whole latent), or None for a model without MLA."""
    rank = config.get("kv_lora_rank")
    if rank is None:
        return None
    heads = int(config.get("num_attention_heads") or 1)
    if heads % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide the model's {heads} attention heads")
    return KVShape(1, _int(rank, "kv_lora_rank"), _int(config.get("qk_rope_head_dim"), "qk_rope_head_dim"))


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Per decoder layer, its transformers layer type (see `layer_specs`)."""
    n = int(config.get("num_hidden_layers") or 0)
    types = config.get("layer_types")
    if types:
        if n and len(types) != n:
            raise ValueError(f"layer_types names {len(types)} layers, num_hidden_layers {n}")
        return list(types)
    interval = config.get("no_rope_layer_interval")
    if config.get("attention_chunk_size") and (config.get("no_rope_layers") or interval):
        # Llama 4 before layer_types: its RoPE layers are chunked, every `interval`-th (NoPE) layer full
        rope = config.get("no_rope_layers") or [int((i + 1) % int(interval) != 0) for i in range(n)]
        return [CHUNKED if r else FULL for r in rope]
    if config.get("sliding_window") and config.get("use_sliding_window", True) is not False:
        return [SLIDING] * n  # Mistral, Phi-3: every layer slides, as transformers' DynamicCache reads it
    return [FULL] * n


def kv_sources(config: Mapping[str, Any], types: Sequence[str]) -> list[int | None]:
    """Per layer, the layer whose K/V it reuses (None: its own), by transformers' Gemma 3n/4 rule:
    with `first = L - num_kv_shared_layers`, every layer i >= first reads the last layer j < first of
    its own type."""
    n = len(types)
    shared = int(config.get("num_kv_shared_layers") or 0)
    if shared <= 0:
        return [None] * n
    if shared >= n:
        # Every layer reuses: a drafter reading its target's K/V (Gemma 4 assistants), no source in this model.
        raise ValueError(f"num_kv_shared_layers={shared} of {n} layers: no layer of this model stores K/V "
                         "(an assistant reads its target's); it is served as a drafter, not alone")
    first = n - shared
    last_of: dict[str, int] = {}
    for j in range(first):
        last_of[types[j]] = j
    sources: list[int | None] = [None] * n
    for i in range(first, n):
        if types[i] not in last_of:
            raise ValueError(f"layer {i} ({types[i]}) reuses K/V, but no layer before {first} has that type")
        sources[i] = last_of[types[i]]
    return sources


def layer_shapes(config: Mapping[str, Any], num_layers: int, tensor_parallel_size: int = 1) -> list[KVShape]:
    """Per layer, the K/V shape on one of `tensor_parallel_size` ranks (transformers splits K/V
    projections by head)."""
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size") or heads) // heads))
    overrides = _per_layer_overrides(config, num_layers)
    out = []
    for i in range(num_layers):
        o = overrides.get(i, {})
        h = int(o.get("num_key_value_heads") or kv_heads)
        d = int(o.get("head_dim") or head_dim)
        if h % tensor_parallel_size or heads % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide the model's {heads} attention "
                             f"heads and layer {i}'s {h} KV heads")
        out.append(KVShape(h // tensor_parallel_size, d, d))
    return out


def _per_layer_overrides(config: Mapping[str, Any], num_layers: int) -> dict[int, dict]:
    per_layer = config.get("per_layer_config")
    if isinstance(per_layer, Mapping):
        return {int(k): dict(v) for k, v in per_layer.items() if isinstance(v, Mapping) and str(k).isdigit()}
    if config.get("global_head_dim") and config.get("layer_types"):  # Gemma 4 without its per_layer_config
        o: dict[str, int] = {"head_dim": int(config["global_head_dim"])}
        if config.get("num_global_key_value_heads") and config.get("attention_k_eq_v", True):
            o["num_key_value_heads"] = int(config["num_global_key_value_heads"])
        return {i: o for i, t in enumerate(config["layer_types"][:num_layers]) if t == FULL}
    return {}


def _int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer for this model's layer types, got {value!r}")
    return value


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


_POSITIVE_COUNTS = ("block_size", "itemsize")  # counts that must be >= 1; every other count >= 0


def check_counts(**counts: int) -> None:
    """Raise ValueError naming a count that is not an integer >= 0 (>= 1 for a block size or itemsize)."""
    for name, value in counts.items():
        minimum = 1 if name in _POSITIVE_COUNTS else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
