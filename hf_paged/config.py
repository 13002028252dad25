"""User-facing knobs and the limits several layers must agree on, each defined once here.

This module is a leaf: it imports nothing from hf_paged but the stdlib-only `kv_spec` / `kv_layout`
(and no torch), so every sub-package, the torch-free `core` included, can import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from .kv_layout import (KVGroup, KVLayout, blocks_held, first_readable_position, kv_groups,  # noqa: F401
                        kv_layout, max_blocks_held, num_freeable_blocks)
from .kv_spec import LAYER_KINDS

# Tokens per KV block unless configured otherwise (the cache, the engine, the draft pool, the CLIs).
DEFAULT_BLOCK_SIZE = 16
# Up to this many queries per sequence (decode, or a speculative verify step of k + 1 tokens) the
# attention takes its decode path: the Triton split-KV decode kernel, or the torch path's bucketed
# padded calls. Longer query runs (prefill chunks) take the prefill path.
MAX_DECODE_QUERY_LEN = 16
# k drafts are verified at k + 1 positions, which must stay on the decode path.
MAX_SPECULATIVE_TOKENS = MAX_DECODE_QUERY_LEN - 1

# Limits on what a caller's JSON and grammars may cost (the server's bodies, `StructuredOutputs`,
# tool parameters and tool-call arguments all use these; past one, a 400 or a ValueError names it).
# Nesting deeper than MAX_JSON_DEPTH (arrays and objects, the outermost counting 1) is refused wherever
# JSON comes from a caller: a request body, a JSON schema, an assistant's tool-call arguments. A schema
# 32 objects deep (64 JSON levels) compiles in ~10 ms; 500 deep took 25 s.
MAX_JSON_DEPTH = 64
# A JSON schema, regex, grammar or structural tag longer than this (its JSON text, or the string) is
# refused before it is compiled: a 10,000-value enum (139 KB) compiles to 28 MiB in 0.4 s.
MAX_GRAMMAR_BYTES = 256 << 10
# Compiled grammars an engine keeps for reuse, by their size (least recently used evicted first).
DEFAULT_GRAMMAR_CACHE_BYTES = 512 << 20
# A grammar that takes longer than this to compile is refused (ValueError / 400 naming the limit).
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_SECONDS = 10.0
# A step's grammar masks for one request may take this long; a request whose masks take longer is
# ended with finish_reason "error" naming the limit, so it cannot slow the requests batched with it.
DEFAULT_GRAMMAR_MASK_BUDGET_SECONDS = 0.02



@dataclass(frozen=True)
class KVCacheDtype:
    """One name of the KV dtype vocabulary.

    Attributes:
        name: the canonical name (what `PagedCacheConfig.kv_cache_dtype` holds after validation).
        storage: the torch dtype's attribute name (`getattr(torch, storage)`); None for "auto" (the
            model's dtype).
        itemsize: bytes per stored element; None for "auto".
        qmax: quantised dtypes only: the largest magnitude a payload element holds (int8 127, fp8
            e4m3 448, fp8 e5m2 57344); a dynamic scale maps each row's absolute maximum onto it.
    """

    name: str
    storage: str | None
    itemsize: int | None
    qmax: float | None = None

    @property
    def is_quantized(self) -> bool:
        return self.qmax is not None


# The one vocabulary of KV cache dtypes, used by `PagedCacheConfig`, `Engine(kv_cache_dtype=...)`, the
# sizing CLI (`hf-paged kv-size --kv-dtype`) and the docs. "auto" stores K/V in the model's dtype.
KV_CACHE_DTYPES: dict[str, KVCacheDtype] = {d.name: d for d in (
    KVCacheDtype("auto", None, None),
    KVCacheDtype("float32", "float32", 4),
    KVCacheDtype("float16", "float16", 2),
    KVCacheDtype("bfloat16", "bfloat16", 2),
    KVCacheDtype("fp8_e4m3", "float8_e4m3fn", 1, qmax=448.0),
    KVCacheDtype("fp8_e5m2", "float8_e5m2", 1, qmax=57344.0),
    KVCacheDtype("int8", "int8", 1, qmax=127.0),
)}
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}
KV_CACHE_DTYPE_NAMES = tuple(KV_CACHE_DTYPES) + tuple(KV_CACHE_DTYPE_ALIASES)
# A quantised cache keeps one float32 scale per token and KV head, for K and for V (see `KV_QUANT_SCHEMES`).
KV_SCALE_BYTES = 4

# How a quantised cache picks its scales (`PagedCacheConfig.kv_quant_scheme`; ignored unquantised):
#   "dynamic"       one symmetric scale per token and KV head, from that row's absolute maximum when
#                   it is written (the default: no calibration, and a scale cannot collapse);
#   "dynamic_token" one symmetric scale per token shared by all its KV heads;
#   "asymmetric"    int8 only: a scale and an offset per token and KV head (min/max), torch path only;
#   "unit"          fp8 only: every scale is 1.0 and values saturate at the dtype's range (vLLM's fallback
#                   when a checkpoint has no scales; for comparison).
# A checkpoint's own per-layer `k_scale` / `v_scale` (compressed-tensors FP8) replace the dynamic scales.
KV_QUANT_SCHEMES = ("dynamic", "dynamic_token", "asymmetric", "unit")


def kv_cache_dtype(name: str) -> KVCacheDtype:
    """The vocabulary entry for `name` (an alias such as "fp8" resolves to its canonical name).

    Raises:
        ValueError: `name` is not in the vocabulary.
    """
    if not isinstance(name, str) or KV_CACHE_DTYPE_ALIASES.get(name, name) not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; expected one of {', '.join(KV_CACHE_DTYPE_NAMES)}")
    return KV_CACHE_DTYPES[KV_CACHE_DTYPE_ALIASES.get(name, name)]


def kv_scale_channels(scheme: str) -> int:
    """Floats stored per (token, scale group) by a quantisation scheme: 2 (scale, offset) for
    "asymmetric", else 1."""
    return 2 if scheme == "asymmetric" else 1


@dataclass(frozen=True)
class PagedCacheConfig:
    """How a `PagedCache` lays out and sizes its block pool.

    Args:
        block_size: tokens per KV block. Waste is at most `block_size - 1` tokens per sequence.
        num_blocks: a fixed pool of this many blocks that never grows. Mutually exclusive with
            `max_kv_bytes`. When neither is set, the pool grows on demand without a ceiling.
        max_kv_bytes: a memory budget (bytes, all layers, K and V); the pool grows on demand up
            to it.
        kv_cache_dtype: storage dtype of K/V, from `KV_CACHE_DTYPES`: "auto" (the model's), "float32",
            "float16", "bfloat16", or quantised one-byte storage "fp8" (= "fp8_e4m3"), "fp8_e5m2",
            "int8". Stored canonical ("fp8" becomes "fp8_e4m3").
        kv_quant_scheme: how a quantised cache scales its rows, from `KV_QUANT_SCHEMES` (default
            "dynamic": per token and KV head).
        kv_quant_rotation: a quantised cache rotates each K/V head row by a fixed Hadamard matrix
            before quantising (attention is unchanged in exact arithmetic, the rounding error of q.k
            shrinks; see `attention.kv_quant`). Default True.
        enable_prefix_caching: share full blocks whose token prefix (hash chain) is identical.
        enable_hybrid_kv: models with sliding-window or chunked-attention layers keep one block table
            per KV group, and those groups release the blocks no query reads any more (out of the
            window, of past chunks; `config.kv_layout`). False keeps every token of every layer
            (more memory; the layout of a model with full attention only; each layer still masks as
            its kind). Default True.
        cache_salt: mixed into every block hash so that caches which must not share K/V (other
            adapters, tenants) never do.
        tensor_parallel_size: the ranks a tensor-parallel model's KV heads are split over: this pool
            holds one rank's share (num_key_value_heads / tensor_parallel_size heads per layer), and
            every byte figure is per rank. Default 1.
        attention_backend: the attention backend every step runs first ("auto", "torch", "cpu",
            "triton", "flex"; `attention.dispatch.choices()`), over `HF_PAGED_BACKEND`; layers it does
            not declare fall back as auto's do. None (default): the environment variable, else auto.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    max_kv_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    kv_quant_scheme: str = "dynamic"
    kv_quant_rotation: bool = True
    enable_prefix_caching: bool = True
    enable_hybrid_kv: bool = True
    cache_salt: str | None = None
    tensor_parallel_size: int = 1
    attention_backend: str | None = None

    def __post_init__(self):
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise ValueError(f"attention_backend must be a backend's name or None, got {self.attention_backend!r}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.num_blocks is not None and (
            isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 1
        ):
            raise ValueError(f"num_blocks must be a positive integer or None, got {self.num_blocks!r}")
        if self.max_kv_bytes is not None and (not isinstance(self.max_kv_bytes, int) or self.max_kv_bytes < 1):
            raise ValueError(f"max_kv_bytes must be a positive integer or None, got {self.max_kv_bytes!r}")
        if self.num_blocks is not None and self.max_kv_bytes is not None:
            raise ValueError("set either num_blocks (a fixed pool) or max_kv_bytes (a growth budget), not both")
        spec = kv_cache_dtype(self.kv_cache_dtype)
        object.__setattr__(self, "kv_cache_dtype", spec.name)
        if not isinstance(self.enable_hybrid_kv, bool):
            raise ValueError(f"enable_hybrid_kv must be True or False, got {self.enable_hybrid_kv!r}")
        if not isinstance(self.kv_quant_rotation, bool):
            raise ValueError(f"kv_quant_rotation must be True or False, got {self.kv_quant_rotation!r}")
        if self.kv_quant_scheme not in KV_QUANT_SCHEMES:
            raise ValueError(f"unknown kv_quant_scheme {self.kv_quant_scheme!r}; expected one of {KV_QUANT_SCHEMES}")
        if spec.is_quantized and self.kv_quant_scheme == "asymmetric" and spec.name != "int8":
            raise ValueError(f"kv_quant_scheme='asymmetric' is for kv_cache_dtype='int8', not {spec.name!r}")
        if spec.is_quantized and self.kv_quant_scheme == "unit" and spec.name == "int8":
            raise ValueError("kv_quant_scheme='unit' (scale 1.0) is for fp8 caches; int8 needs a scale")

    @property
    def kv_dtype(self) -> KVCacheDtype:
        """The `KV_CACHE_DTYPES` entry of `kv_cache_dtype`."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype]


def default_max_state_checkpoints(max_num_seqs: int) -> int:
    """The state checkpoints an engine keeps for prefix caching of a recurrent model when
    `max_state_checkpoints` is not set: as many as it runs sequences (the checkpoints' memory equals the
    working state's)."""
    return max_num_seqs


def _knob(default, help: str, parse=None, choices: Sequence[str] | None = None):
    """An `EngineConfig` field: its default, the help of its flag, and how the flag parses (default:
    the type of `default`; a tuple default or `parse=(int,)` takes one or more values)."""
    return field(default=default, metadata={"help": help, "parse": parse or type(default), "choices": choices})


# With HF_PAGED_CPU_GRAPHS=auto a compiled CPU decode graph (`worker.cpu_graphs`) compiles once its buckets have
# run this many decode steps eagerly: about the steps whose saving pays for compiling (SmolLM2-135M at batch 1 on 2 cores:
# 7 s to compile with Inductor's on-disk cache warm, 60 s cold; 15-30 ms saved per step), so an engine that
# decodes less never waits for the compiler, and one that decodes more pays at most about twice what the
# better choice in hindsight costs (ski rental).
CPU_GRAPHS_COMPILE_AFTER_STEPS = 2048


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of `Engine` with its default, defined once (vLLM's `EngineArgs`): `Engine`'s keyword
    defaults, the scheduler's and the command lines' flags (`hf-paged serve`, `hf-paged generate
    --input`, the disaggregated job) all come from here. The cache knobs take `PagedCacheConfig`'s
    defaults. `Engine(model, tokenizer, **config.engine_kwargs())` builds an engine from one.

    The fields are documented by their help text (`EngineConfig.help(name)`, or any command's
    `--help`); `Engine`'s docstring says the rest.
    """

    max_num_seqs: int = _knob(64, "most requests running at once")
    max_num_batched_tokens: int = _knob(2048, "token budget of one forward step (decodes plus prefill chunks)")
    block_size: int = _knob(DEFAULT_BLOCK_SIZE, "tokens per KV block")
    num_blocks: int | None = _knob(None, "a fixed KV pool of this many blocks (default: sized from max_kv_bytes, "
                                         "or from the free memory)", parse=int)
    max_kv_bytes: int | None = _knob(None, "KV budget in bytes (default: 2 GiB on CPU, half the free memory on "
                                           "CUDA, capped at what max-num-seqs full-length sequences need)", parse=int)
    kv_cache_dtype: str = _knob(PagedCacheConfig.kv_cache_dtype, "K/V storage dtype (auto: the model's)",
                                choices=KV_CACHE_DTYPE_NAMES)
    kv_quant_scheme: str = _knob(PagedCacheConfig.kv_quant_scheme, "how a quantised cache scales its rows",
                                 choices=KV_QUANT_SCHEMES)
    kv_quant_rotation: bool = _knob(PagedCacheConfig.kv_quant_rotation,
                                    "a quantised cache rotates K/V rows (Hadamard) before quantising")
    enable_prefix_caching: bool = _knob(PagedCacheConfig.enable_prefix_caching,
                                        "share the K/V of full blocks whose token prefix is identical")
    enable_hybrid_kv: bool = _knob(PagedCacheConfig.enable_hybrid_kv,
                                   "sliding-window and chunked layers release the blocks no query reads")
    attention_backend: str | None = _knob(PagedCacheConfig.attention_backend, "attention backend run first (auto, "
                                          "torch, cpu, triton, flex; default: $HF_PAGED_BACKEND, else auto)",
                                          parse=str)
    cache_salt: str | None = _knob(PagedCacheConfig.cache_salt, "mixed into every block hash: caches with "
                                                                "other salts never share K/V", parse=str)
    state_checkpoint_interval: int | None = _knob(None, "recurrent models (Mamba, linear attention): tokens between "
                                                        "the state checkpoints prefix caching keeps (a multiple of "
                                                        "block-size; default: block-size)", parse=int)
    max_state_checkpoints: int | None = _knob(None, "recurrent models: the most state checkpoints kept for prefix "
                                                    "caching (default: max-num-seqs; 0 keeps none)", parse=int)
    max_model_len: int | None = _knob(None, "longest sequence, prompt + output (default: the model's max "
                                            "positions)", parse=int)
    speculative_method: str | None = _knob(None, "speculative decoding: ngram (prompt lookup), or draft_model "
                                                 "(Engine(draft_model=...) only)", parse=str,
                                           choices=("ngram", "draft_model"))
    num_speculative_tokens: int | None = _knob(None, "tokens drafted per step and request (default 5 when "
                                                     "speculating)", parse=int)
    prompt_lookup_min: int = _knob(1, "smallest n-gram the ngram proposer tries")
    prompt_lookup_max: int = _knob(3, "largest n-gram the ngram proposer tries")
    cuda_graphs: bool | None = _knob(None, "replay decode steps from CUDA graphs (default: on for a CUDA model "
                                           "with the Triton backend)", parse=bool)
    # None: HF_PAGED_CPU_GRAPHS (1: as True; auto: on where compiled steps can run, each graph compiled once its
    # steps have run CPU_GRAPHS_COMPILE_AFTER_STEPS times eagerly; 0 or unset: off); True: compiled when a step
    # first needs it (that step waits, 7-60 s for SmolLM2-135M).
    cpu_graphs: bool | None = _knob(None, "run decode steps compiled by torch.compile (Inductor, C++) on CPU "
                                          "(default: HF_PAGED_CPU_GRAPHS, 0, 1 or auto: after "
                                          f"{CPU_GRAPHS_COMPILE_AFTER_STEPS} eager decode steps; off if unset)",
                                    parse=bool)
    cuda_graph_batch_sizes: tuple[int, ...] | None = _knob(None, "CUDA graph (and compiled CPU step) batch buckets "
                                                                 "(default 1, 2, 4, ... and max-num-seqs)",
                                                           parse=(int,))
    cuda_graph_max_seqlens: tuple[int, ...] | None = _knob(None, "CUDA graph (and compiled CPU step) sequence-length "
                                                                 "buckets (default 256, 512, ... and the longest "
                                                                 "sequence)", parse=(int,))

    def engine_kwargs(self) -> dict:
        """The fields as `Engine` keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def help(cls, name: str) -> str:
        """The help text of field `name`."""
        return cls.__dataclass_fields__[name].metadata["help"]

    @classmethod
    def add_cli_args(cls, parser, names: Sequence[str] | None = None):
        """Add a flag per field in `names` (default: all) to an argparse parser or group: `max_num_seqs`
        becomes `--max-num-seqs` (dest `max_num_seqs`) with the field's default and help; booleans
        take `--x` / `--no-x`. Returns the parser."""
        import argparse

        known = {f.name: f for f in fields(cls)}
        unknown = [n for n in names or () if n not in known]
        if unknown:
            raise ValueError(f"not EngineConfig fields: {unknown}")
        for name in names if names is not None else known:
            f = known[name]
            parse, default = f.metadata["parse"], f.default
            shown = "" if default is None else f" (default {default})"
            kwargs = dict(dest=name, default=default, help=f.metadata["help"] + shown)
            if parse is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif isinstance(parse, tuple):
                kwargs.update(type=parse[0], nargs="+")
            else:
                kwargs.update(type=parse, choices=f.metadata["choices"])
            parser.add_argument("--" + name.replace("_", "-"), **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args, **overrides) -> "EngineConfig":
        """An `EngineConfig` from the flags `add_cli_args` added to `args` (an argparse namespace); the
        other fields keep their defaults, `overrides` win."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values.update(overrides)
        for name in ("cuda_graph_batch_sizes", "cuda_graph_max_seqlens"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        return cls(**values)


def kv_bytes_per_token_layer(num_kv_heads: int, head_dim: int, head_dim_v: int, kv_dtype: KVCacheDtype,
                             scheme: str = "dynamic", model_itemsize: int = 4) -> int:
    """Bytes one token's K and V take in one layer: the payload plus, when quantised, its scales
    (`KV_SCALE_BYTES` per scale group of K and of V, two floats each for "asymmetric"). The cache's
    tensors and every byte figure (pool sizing, the sizing CLI) come from this one formula."""
    payload = num_kv_heads * (head_dim + head_dim_v) * (kv_dtype.itemsize or model_itemsize)
    return payload + kv_scale_bytes_per_token_layer(num_kv_heads, kv_dtype, scheme)


def kv_scale_bytes_per_token_layer(num_kv_heads: int, kv_dtype: KVCacheDtype, scheme: str = "dynamic") -> int:
    """Of `kv_bytes_per_token_layer`, the bytes of a quantised cache's scales (0 unquantised)."""
    if not kv_dtype.is_quantized:
        return 0
    return 2 * kv_scale_groups(num_kv_heads, scheme) * KV_SCALE_BYTES * kv_scale_channels(scheme)


def kv_scale_groups(num_kv_heads: int, scheme: str) -> int:
    """Scale groups per token of one K or V: every KV head, or one for "dynamic_token"."""
    return 1 if scheme == "dynamic_token" else num_kv_heads


def check_pool_fits(num_blocks: int | None, block_size: int, max_length: int | None) -> None:
    """Raise ValueError if a fixed pool of `num_blocks` can never hold one sequence of `max_length`."""
    if num_blocks is not None and max_length is not None and num_blocks * block_size < max_length:
        raise ValueError(
            f"num_blocks={num_blocks} with block_size={block_size} holds {num_blocks * block_size} "
            f"tokens, too few for one sequence of max_length={max_length}"
        )


# The decoder layer types (transformers' `layer_types` names) a paged cache serves: one definition,
# `kv_spec.LAYER_KINDS` (one spec per kind). A model with any other kind (linear attention, Mamba, ...)
# is refused at load (`hf.support`), and the planner (`hf-paged kv-size | plan`) says so from its config.
SUPPORTED_LAYER_TYPES = LAYER_KINDS


# ---------------------------------------------------------------------------------------------- KV groups
# Which layers share a block table, where each layer's K/V lives in a block, and which blocks a group
# may free: `kv_layout` (the layout, with its diagram) and the one equation the block manager and the
# planner count with (`first_readable_position`, `num_freeable_blocks`, `blocks_held`), re-exported here.


def kv_bytes_per_block(layout: KVLayout, block_size: int, kv_dtype: KVCacheDtype, scheme: str = "dynamic",
                       model_itemsize: int = 4) -> int:
    """Bytes one block of the pool takes as the cache allocates it: its K and V pages
    (`KVLayout.bytes_per_block`: block_size * (page_k + page_v) * itemsize; with one K/V shape,
    num_slots * one slot's bytes) plus, for a quantised cache, the scales of the layers of the group
    with the most (`kv_scale_bytes_per_token_layer` per layer and token). Pool tensors hold
    `num_blocks` times this, the figure `hf-paged plan` counts blocks by.

    Args:
        layout: from `kv_layout(kv_spec.layer_specs(...))` (its layers' shapes must be known).
        kv_dtype: the cache's dtype (`kv_cache_dtype(name)`); "auto" stores `model_itemsize` bytes.
        scheme: the quantisation scheme (`kv_cache_scheme`), for a quantised dtype's scale count.
    """
    payload = layout.bytes_per_block(block_size, kv_dtype.itemsize or model_itemsize)
    scales = max((len(g.layers) * kv_scale_bytes_per_token_layer(g.spec.shape.num_kv_heads, kv_dtype, scheme)
                  for g in layout.groups), default=0)
    return payload + block_size * scales
