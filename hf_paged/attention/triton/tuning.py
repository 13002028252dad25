"""Launch configurations of the Triton attention kernels: recorded winners, the autotuning search,
and the JSON file that keeps what a GPU measured.

Each launcher owns its knobs: the heuristic configuration it has always launched, the
`triton.Config` candidates of the knobs that never change its result, and the pruning that drops
candidates a shape cannot fit (`decode.decode_configs`, `prefill.prefill_configs`; `tile_misfit`
below is their shared fit rule). This module owns the choice among them, per `TuningKey` (kernel,
GPU name and the shape facts that move the best tile):

    1. a key already settled in this process       -> a dict lookup, nothing else
    2. a winner recorded for the key in the file   -> used as is, no search
    3. HF_PAGED_AUTOTUNE=1 and a compiled CUDA call -> time every pruned candidate on the call's own
       arguments (a launch only writes its output, so running it again is harmless), keep the fastest
    4. otherwise                                    -> None: the launcher's heuristic, as before

The choice is made when a step is planned (`plan_config`, from `decode.plan_decode` /
`prefill.plan_prefill`, once per step and layer kind), not per launch: a launch with a plan looks
nothing up, times nothing, syncs nothing and allocates nothing but its output, so it may be
captured in a CUDA graph. Only a search needs real arguments: the plan then leaves the config open
and its first launch searches (`choose_config`) and records the winner in the plan. A search
never starts inside a graph capture or under Triton's interpreter (TRITON_INTERPRET=1): such a call
takes the heuristic, and a capture leaves the key unsettled for the next eager call.

`triton.autotune` is not used: it benchmarks on a key's first call wherever that call happens (in a
graph capture, under the interpreter), it cannot be seeded from a file, and the prefill grid
depends on one of the tuned knobs (ROWS).

HF_PAGED_AUTOTUNE: unset or "0" never searches; "1" searches keys without a recorded winner;
"force" searches every key afresh (what the `tune` command does). HF_PAGED_TUNED_CONFIGS names a
winners file to read instead of the packaged `tuned_configs.json`. Recording winners:

    python -m hf_paged.attention.triton.tune --out hf_paged/attention/triton/tuned_configs.json
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import triton

AUTOTUNE_ENV = "HF_PAGED_AUTOTUNE"
CONFIGS_ENV = "HF_PAGED_TUNED_CONFIGS"
DEFAULT_CONFIGS_PATH = Path(__file__).with_name("tuned_configs.json")
FILE_VERSION = 1

# A candidate replaces the heuristic only if it is faster by more than this fraction: do_bench's
# medians wobble by ~1-2% between runs, and a recorded winner should not flip on noise.
MIN_GAIN = 0.03
# do_bench budgets per candidate, in ms of GPU time. Each call runs with a cold L2 (do_bench
# clears it), as a layer's K/V read is in a real step.
BENCH_WARMUP_MS = 5
BENCH_REP_MS = 20
# Shared memory per block when the device cannot be asked (CPU tensors under the interpreter):
# Hopper's opt-in limit (H100 / H200), so the interpreter prunes as the target GPU does.
DEFAULT_SHARED_MEMORY = 227 * 1024
# Budget for the 32-bit words of the loop-resident tiles per thread (the fp32 accumulator and
# scores, the query, the K/V tile). A thread has 255 registers; in these gather kernels the
# addresses, masks and block indices take about as many again as the tiles (sm_90 ptxas, Triton
# 3.9: the decode heuristic at head_dim 128 estimates 96 words, uses 255 registers and spills a
# little; estimates of 144 and more spilled hundreds of bytes in the prefill kernel).
MAX_TILE_WORDS_PER_THREAD = 128
# fp32 tiles (IEEE dots, no tensor cores) need more: the FMA dot's operand layouts hold more copies
# per thread. Measured the same way: estimates of 84 and more spilled, in both kernels.
MAX_TILE_WORDS_PER_THREAD_FP32 = 80
# An MMA tile is 16 x 8: a warp with less than one tile of the score block S idles in the dots.
MMA_TILE_ELEMENTS = 16 * 8


class TuningKey(NamedTuple):
    """What a recorded winner is keyed on: the kernel, the GPU, and the shape facts that move the best
    tile. A NamedTuple, cheap to hash on every launch."""

    kernel: str  # "paged_decode" or "flash_prefill"
    device: str  # torch.cuda.get_device_name(), e.g. "NVIDIA H200"; "cpu" under the interpreter
    head_dim: int
    head_dim_v: int
    group: int  # query heads per KV head
    block_size: int  # tokens per cache block
    dtype: str  # the query's, e.g. "bfloat16"
    kv_dtype: str  # the cache's: the query's, a 16-bit cache under fp32, or int8 / fp8 payloads
    block_m: int = 0  # decode: query rows per program (launcher-computed); 0 for prefill (it tunes ROWS)

    def as_dict(self) -> dict:
        return self._asdict()

    @classmethod
    def from_dict(cls, entry: dict) -> TuningKey:
        """The key of a winners-file entry (its other fields, the config and timings, are ignored)."""
        return cls(**{name: entry[name] for name in cls._fields if name in entry})


@dataclass
class SearchResult:
    """One key's search: every candidate's time (ms, inf when it failed), the winner and the heuristic's time."""

    key: TuningKey
    winner: triton.Config
    winner_ms: float
    heuristic_ms: float
    timings: list[tuple[triton.Config, float]] = field(default_factory=list)


# Settled keys: a config, or None for "the launcher's heuristic". Filled once per key and process.
_SETTLED: dict[TuningKey, triton.Config | None] = {}
_SEARCHED: dict[TuningKey, SearchResult] = {}
_UNSETTLED = object()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_size(name: str) -> int:
    """Bytes per element of the torch dtype called `name` ("bfloat16" -> 2)."""
    return getattr(torch, name).itemsize


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The name winners are recorded under: the GPU's marketing name, "cpu" for the interpreter's tensors."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@functools.lru_cache(maxsize=None)
def shared_memory_limit(device: torch.device) -> int:
    """Shared memory one program may use on `device`, in bytes (the opt-in maximum on CUDA)."""
    if device.type != "cuda":
        return DEFAULT_SHARED_MEMORY
    limit = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    if not limit:  # older torch: ask Triton's driver, as its tutorials do
        index = device.index if device.index is not None else torch.cuda.current_device()
        limit = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return int(limit)


def autotune_mode() -> str:
    """ "off", "on" or "force", from HF_PAGED_AUTOTUNE (see the module docstring)."""
    value = os.environ.get(AUTOTUNE_ENV, "0").strip().lower()
    if value in ("", "0", "false", "off"):
        return "off"
    if value == "force":
        return "force"
    if value in ("1", "true", "on"):
        return "on"
    raise ValueError(f"{AUTOTUNE_ENV} must be 0, 1 or force, got {value!r}")


def can_benchmark(device: torch.device) -> bool:
    """Whether a search may time launches on `device` now: compiled CUDA only, and never while a CUDA
    graph is being captured (timing needs host syncs and would record the candidates into the graph)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return not torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------------------------- #
# Configs: identity, JSON form, and the fit rule both kernels prune with


def config_to_dict(config: triton.Config) -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def config_from_dict(entry: dict) -> triton.Config:
    kwargs = {k: int(v) for k, v in entry.items() if k not in ("num_warps", "num_stages")}
    return triton.Config(kwargs, num_warps=int(entry["num_warps"]), num_stages=int(entry["num_stages"]))


def config_id(config: triton.Config) -> tuple:
    """A hashable identity of a config's knobs (triton.Config's own equality depends on dict order)."""
    return tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages


def config_str(config: triton.Config) -> str:
    return " ".join(f"{k}={v}" for k, v in config_to_dict(config).items())


def check_config(kernel: str, config: triton.Config, knobs: tuple[str, ...]) -> None:
    """ValueError unless `config` sets exactly the meta-parameters `knobs` (each a power of two >= 16),
    a power-of-two num_warps up to 16, and num_stages >= 1: a caller-given config, checked before launch."""
    if not isinstance(config, triton.Config) or sorted(config.kwargs) != sorted(knobs):
        raise ValueError(f"{kernel}: config must be a triton.Config of {knobs}, got {config}")
    for name in knobs:
        value = config.kwargs[name]
        if not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"{kernel}: config {name} must be a power of two >= 16, got {value!r}")
    if config.num_warps not in (1, 2, 4, 8, 16) or not config.num_stages or config.num_stages < 1:
        raise ValueError(f"{kernel}: config needs num_warps in 1..16 (a power of two) and num_stages >= 1, "
                         f"got {config.num_warps} and {config.num_stages}")


def tile_misfit(
    *,
    block_m: int,  # query rows per program
    block_n: int,  # keys per inner step
    block_d: int,  # padded head_dim of Q and K
    block_dv: int,  # padded head_dim of V
    num_warps: int,
    num_stages: int,
    elem_bytes: int,  # the wider of the query's and the cache's element
    shared_memory: int,  # bytes one program may use
) -> str | None:
    """Why a flash-attention tile configuration cannot run well, or None when it fits.

    Both kernels run the same loop: an fp32 accumulator [block_m, block_dv] and scores
    [block_m, block_n], the query tile [block_m, block_d] held throughout, and K / V tiles of
    block_n rows gathered through the block table. Three rules:

    * shared memory: `num_stages` buffered K and V tiles must fit (Triton 3.9 does not pipeline
      these gathers, so today one buffer is used; a compiler that does must still fit).
    * registers: the tiles' 32-bit words per thread must stay within MAX_TILE_WORDS_PER_THREAD
      (MAX_TILE_WORDS_PER_THREAD_FP32 for fp32 tiles), or the kernel spills to local memory.
    * idle warps: each warp must own at least one 16 x 8 MMA tile of the score block.

    The kernels look up each key's block separately, so BLOCK_N need not divide or be divided by
    the cache's block_size: no rule ties them.
    """
    stage_bytes = block_n * (block_d + block_dv) * elem_bytes
    if num_stages * stage_bytes > shared_memory:
        return f"shared memory: {num_stages} x {stage_bytes} B > {shared_memory} B"
    words = (block_m * block_dv + block_m * block_n
             + (block_m * block_d + block_n * (block_d + block_dv)) * elem_bytes / 4)
    per_thread = words / (32 * num_warps)
    budget = MAX_TILE_WORDS_PER_THREAD_FP32 if elem_bytes >= 4 else MAX_TILE_WORDS_PER_THREAD
    if per_thread > budget:
        return f"registers: {per_thread:.0f} tile words per thread > {budget}"
    if block_m * block_n < MMA_TILE_ELEMENTS * num_warps:
        return (f"idle warps: a {block_m} x {block_n} score block has less than one MMA tile for each of "
                f"{num_warps} warps")
    return None


def keep_fitting(
    heuristic: triton.Config,
    configs: Iterable[triton.Config],
    misfit: Callable[[triton.Config], str | None],
) -> list[triton.Config]:
    """`heuristic` first (always kept: it is what launches today), then every other config that
    `misfit` has no objection to, without duplicates."""
    kept, seen = [heuristic], {config_id(heuristic)}
    for config in configs:
        if config_id(config) not in seen and misfit(config) is None:
            kept.append(config)
            seen.add(config_id(config))
    return kept


# ---------------------------------------------------------------------------------------------- #
# Recorded winners


def configs_path() -> Path:
    return Path(os.environ.get(CONFIGS_ENV) or DEFAULT_CONFIGS_PATH)


def load_entries(path: Path | str | None = None) -> list[dict]:
    """The raw entries of a winners file (an absent file has none)."""
    path = Path(path) if path is not None else configs_path()
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if data.get("version") != FILE_VERSION:
        raise ValueError(f"{path}: winners file version {data.get('version')!r}, expected {FILE_VERSION}")
    return list(data.get("entries", []))


@functools.lru_cache(maxsize=8)
def _recorded(path: str, mtime_ns: int) -> dict[TuningKey, triton.Config]:
    return {TuningKey.from_dict(e): config_from_dict(e["config"]) for e in load_entries(path)}


def recorded_winners(path: Path | str | None = None) -> dict[TuningKey, triton.Config]:
    """Winners of a file by key (parsed once per file version)."""
    path = Path(path) if path is not None else configs_path()
    if not path.exists():
        return {}
    return _recorded(str(path), path.stat().st_mtime_ns)


def write_winners(path: Path | str, results: Iterable[SearchResult]) -> list[dict]:
    """Merge `results` into the winners file at `path` (creating it): an entry of the same key is
    replaced, every other entry is kept. Returns the entries written, sorted for stable diffs."""
    path = Path(path)
    fresh = {r.key: r for r in results}
    entries = [e for e in load_entries(path) if TuningKey.from_dict(e) not in fresh]
    for key, r in fresh.items():
        entries.append({
            **key.as_dict(),
            "config": config_to_dict(r.winner),
            "ms": round(r.winner_ms, 6),
            "heuristic_ms": round(r.heuristic_ms, 6),
            "triton": triton.__version__,
        })
    entries.sort(key=lambda e: tuple(TuningKey.from_dict(e)))
    data = {
        "version": FILE_VERSION,
        "comment": "Launch configurations measured by `python -m hf_paged.attention.triton.tune`; "
                   "see hf_paged/attention/triton/tuning.py. ms: median per call, cold L2.",
        "entries": entries,
    }
    path.write_text(json.dumps(data, indent=1) + "\n")
    return entries


# ---------------------------------------------------------------------------------------------- #
# Choosing a launch's config


def choose_config(
    key: TuningKey,
    candidates: Callable[[], Sequence[triton.Config]],
    launch: Callable[[triton.Config], None],
    device: torch.device,
) -> triton.Config | None:
    """The config to launch `key` with, or None for the launcher's own heuristic.

    Args:
        key: the launch's `TuningKey`.
        candidates: returns the pruned candidates, the heuristic first; called only to search or
            to check a recorded winner, once per key and process.
        launch: runs the kernel with a config on the call's arguments (used only by a search; the
            caller launches the returned config itself).
        device: the tensors' device.
    """
    config = plan_config(key, candidates, device)
    if config is NEEDS_SEARCH:
        result = search(key, candidates(), launch)
        _SEARCHED[key] = result
        _SETTLED[key] = config = result.winner
    return config


# What `plan_config` answers for a key that only a search on real arguments can settle.
NEEDS_SEARCH = object()


def plan_config(
    key: TuningKey,
    candidates: Callable[[], Sequence[triton.Config]],
    device: torch.device,
) -> triton.Config | None | object:
    """`choose_config` without launching anything, for a step's plan (which has no arguments yet):
    the settled, recorded or heuristic (None) config, or NEEDS_SEARCH when HF_PAGED_AUTOTUNE asks
    for a search that this device can run now (the first launch then searches on its own arguments,
    through `choose_config`)."""
    config = _SETTLED.get(key, _UNSETTLED)
    if config is not _UNSETTLED:
        return config
    mode = autotune_mode()
    if mode != "force":
        recorded = recorded_winners().get(key)
        if recorded is not None:
            if config_id(recorded) in {config_id(c) for c in candidates()}:
                _SETTLED[key] = recorded
                return recorded
            warnings.warn(f"hf_paged: the recorded config {config_str(recorded)} for {key} is not among the "
                          f"kernel's candidates (stale {configs_path().name}?); ignoring it", stacklevel=3)
    if mode == "off" or not can_benchmark(device):
        if mode != "off" and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # a capture cannot time anything: try again on the next eager call
        _SETTLED[key] = None
        return None
    return NEEDS_SEARCH


def benchmark(fn: Callable[[], None]) -> float:
    """Median ms of `fn` per call on the current CUDA stream, cold L2 (triton.testing.do_bench). The
    first call compiles."""
    return float(triton.testing.do_bench(fn, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, return_mode="median"))


def search(
    key: TuningKey,
    candidates: Sequence[triton.Config],
    launch: Callable[[triton.Config], None],
) -> SearchResult:
    """Time every candidate (the first is the heuristic) and keep the fastest, unless the heuristic
    is within MIN_GAIN of it. A candidate that fails to compile or launch (out of shared memory or
    registers on an unforeseen GPU) is skipped; the heuristic failing is an error."""
    heuristic = candidates[0]
    timings = []
    for config in candidates:
        try:
            ms = benchmark(lambda config=config: launch(config))
        except Exception as error:  # noqa: BLE001 -- one bad candidate must not end the search
            if config is heuristic:
                raise
            warnings.warn(f"hf_paged: {key.kernel} {config_str(config)} failed while tuning: {error!r}",
                          stacklevel=2)
            ms = math.inf
        timings.append((config, ms))
    heuristic_ms = timings[0][1]
    winner, winner_ms = min(timings, key=lambda t: t[1])
    if heuristic_ms <= winner_ms * (1 + MIN_GAIN):
        winner, winner_ms = heuristic, heuristic_ms
    return SearchResult(key, winner, winner_ms, heuristic_ms, timings)


def search_results() -> list[SearchResult]:
    """The searches this process ran, in order (what `tune` writes back)."""
    return list(_SEARCHED.values())


def settled(key: TuningKey) -> bool:
    return key in _SETTLED


def clear_cache() -> None:
    """Forget every settled key and search (tests; `tune` before forcing a fresh search)."""
    _SETTLED.clear()
    _SEARCHED.clear()
    _recorded.cache_clear()
