"""The native CPU kernel of paged attention for short query runs: its build, its shape rules, its call.

`csrc/paged_attention.c` reads K/V in place through the block table (no gather into a workspace, no
copy): decode and speculative-verify sequences of a step, all in one call. Queries fp32, bf16 or
fp16 (the output in the query's dtype, as the torch path returns it); K/V the query's dtype, bf16 or
fp16 under fp32 queries, or an int8 / fp8 (e4m3fn, e5m2) payload with its per-token scales
(`kv_quant.KVScales`, any scheme), dequantised in registers; all arithmetic in fp32. It is
compiled on first use with the host's C compiler (`$CC`, else `cc`, else `gcc`; a `$CC` that is not
found is an error, never silently replaced), `-O3 -march=native -fopenmp`, into
`$HF_PAGED_KERNEL_CACHE` (default `~/.cache/hf_paged/kernels`), under a name that hashes the source,
the flags, the compiler's version and the CPU's flags, and is loaded with ctypes (which releases the
GIL for the call). Inductor builds its CPU kernels the same way (gcc, OpenMP), so a machine where
`torch.compile` works builds this too.

What the cache is trusted with. A cached library runs inside this process (its constructors run at
load), and its name is computable by anyone, so:

* the cache folder is created private (0o700), and is refused when it is owned by another user or
  writable by group or others (even with the sticky bit: others could still create the name);
* a library, and its hash record, are refused when owned by another user or writable by group or
  others (root, which could replace anything this process runs anyway, counts as this user);
* each build records its library's sha256 beside it (`<library>.sha256`, written atomically), and a
  library is loaded only when its bytes match that record. Hashing the bytes before loading is also
  what keeps a truncated copy from being mapped (touching a page past its end is a SIGBUS). The
  verified bytes are loaded from a private copy, not from the cache's name (see `_load`);
* a library with no matching record, that fails to load, or lacks the kernel's symbol is rebuilt
  once (into a fresh temp file, recorded, then moved into place).

Whenever there is no kernel (no compiler, a failed build, a refused cache, a rebuild that still
does not load), `load()` says why once (a warning; `load_error()` keeps it) and returns None: the
step then runs on the torch path (`torch_paged`), which is slower and the same up to float rounding.

One library per K/V dtype (`-DHF_PAGED_KV=<code>`): `load()` builds the fp32 one; the first call over
another dtype's cache builds that dtype's (`load_kv`, a few seconds, cached like the first), so a
machine compiles only what it reads. One that cannot be had is said once, and that dtype's calls take
the torch path.

Owns the build and the ctypes signatures; `torch_paged.AttentionPlan` decides which sequences go
here (`supports`) and checks the step's metadata, `torch_paged.paged_attention` checks each call's
shapes and calls `attend`, which trusts both checks. Latent attention (absorbed MLA, the "cpu"
backend's `LayerCall.latent_dim` calls) comes in through `latent_attention`, which checks its call
itself and hands whatever it does not vouch for back to the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..config import MAX_DECODE_QUERY_LEN

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
SYMBOL = "hf_paged_attention_f32"  # fp32 queries and contiguous fp32 K/V
TYPED_SYMBOL = "hf_paged_attention"  # any dtype the kernel reads (`DTYPE_CODES`), any block stride
LATENT_SYMBOL = "hf_paged_latent_attention_f32"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
MAX_HEAD_DIM = 256  # the kernel's limits (csrc: MAXC * W, MAXBS)
MAX_BLOCK_SIZE = 64
LANES = 16
# The kernel's element types (csrc: DT_*). Queries and outputs: the first three.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4,
               torch.float8_e5m2: 5}
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Unquantised K/V it reads under each query dtype: the query's own, or 16 bits under fp32 queries (what the
# torch path widens exactly; a narrower query would round the K/V there, and it rounds nothing here).
FLOAT_KV_DTYPES = {torch.float32: (torch.float32, torch.bfloat16, torch.float16), torch.bfloat16: (torch.bfloat16,),
                   torch.float16: (torch.float16,)}
QUANTIZED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
# Work items (sequence x key split) per thread to aim for; a split keeps at least this many blocks.
ITEMS_PER_THREAD = 4
MIN_BLOCKS_PER_SPLIT = 4
# Below this many bytes of K/V a call runs on one thread: waking OpenMP's team costs more than the
# work, and its threads would then spin-wait, taking the cores from other processes on the machine.
PARALLEL_MIN_BYTES = 1 << 20

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32, _I32, _F32, _I32, _I32, _F32,
             _P, _I32, _I32, _P, _P, _P, _I32]
_TYPED_ARGTYPES = [_P, _I64, _I64, _I32, _P, _P, _I64, _I64, _I32, _P, _P, _I64, _I32, _I32, _I32, _P, _I64, _P, _P,
                   _I32, _I32, _I32, _I32, _I32, _I32, _F32, _I32, _I32, _F32, _P, _I32, _I32, _P, _P, _P, _I32, _I32]
_LATENT_ARGTYPES = [_P, _I64, _I64, _I32, _P, _I64, _I64, _I32, _P, _I64, _I32, _P, _P, _I32, _I32, _I32, _I32, _I32,
                    _F32, _I32, _I32, _I32, _P, _P, _P, _I32]

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "fn", "latent", "typed", "kv <dtype>" -> the ctypes functions; "error" -> why none


class _Refused(RuntimeError):
    """A cache folder or file that someone other than this user could have written: nothing is run from it."""


class _Unusable(RuntimeError):
    """A cached library this user's build did not record, or that does not load as the kernel: rebuilt once."""


class _BuildFailed(RuntimeError):
    """The compiler rejected one set of flags."""


def cache_dir() -> Path:
    return Path(os.environ.get("HF_PAGED_KERNEL_CACHE") or Path.home() / ".cache" / "hf_paged" / "kernels")


def _compiler() -> list[str]:
    """The compiler command: `$CC` when set (split into words, so `ccache gcc` works), else `cc`, else `gcc`."""
    cc = os.environ.get("CC")
    if cc:
        words = shlex.split(cc)
        found = shutil.which(words[0]) if words else None
        if found is None:  # the user named this compiler: building with another would hide the mistake
            raise RuntimeError(f"$CC={cc} not found")
        return [found, *words[1:]]
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise RuntimeError("no C compiler found (cc, gcc); set $CC")
    return [found]


def _machine() -> str:
    """What `-march=native` compiles for: a cache shared between machines (a network home) keeps one
    library per kind of CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _check_trusted(path: Path | str, st: os.stat_result, what: str, advice: str) -> None:
    """Raise `_Refused` unless `st` (of `path`) is owned by this user or root and nobody else may write it."""
    user = os.geteuid()
    if st.st_uid not in (user, 0):
        raise _Refused(f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {user}); {advice}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _Refused(f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):#o}); "
                       f"{advice}")


def _trusted_folder() -> Path:
    """The cache folder, created private (0o700) if it is missing; `_Refused` if others could write in it.

    Only the folder itself is checked, not its parents: a library's name in it can be created or
    replaced only by whoever may write the folder."""
    folder = cache_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_trusted(folder, os.stat(folder), "the CPU kernel cache", "anyone who can write there can plant a "
                   "library this process would run; set HF_PAGED_KERNEL_CACHE to a folder only you can write "
                   "(chmod 700)")
    return folder


def _record_of(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _read_trusted(path: Path, what: str) -> bytes:
    with open(path, "rb") as f:
        # The open file is checked, not the name: what is read is what was checked.
        _check_trusted(path, os.fstat(f.fileno()), what, "delete it to have it rebuilt")
        return f.read()


def _read_verified(library: Path) -> bytes:
    """The library's bytes if they are exactly what this user's build recorded; `_Unusable` if not."""
    data = _read_trusted(library, "the CPU kernel library")
    try:
        recorded = _read_trusted(_record_of(library), "the CPU kernel's hash record").decode("ascii", "replace")
    except FileNotFoundError:
        raise _Unusable(f"{library} has no hash record") from None
    if hashlib.sha256(data).hexdigest() != recorded.strip():
        raise _Unusable(f"{library} does not match its recorded sha256 (truncated, or not this build's)")
    return data


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".record-", dir=path.parent)  # mode 0o600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _compile(cc: list[str], flags: tuple[str, ...], library: Path) -> bytes:
    """Build into a fresh temp file, record its sha256, then move it to `library`; its bytes."""
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=library.parent)
    os.close(fd)
    try:
        done = subprocess.run([*cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise _BuildFailed(f"{' '.join(cc)} {' '.join(flags)}: {done.stderr.strip()[-800:]}")
        os.chmod(tmp, 0o600)  # the linker may write a new file with the umask's mode (group-writable under 002)
        data = Path(tmp).read_bytes()
        _write_atomic(_record_of(library), f"{hashlib.sha256(data).hexdigest()}\n".encode())
        # atomic: a concurrent process sees the old name or a whole library (and, at worst, a record of
        # the other one's build, which only makes it rebuild)
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return data


def _load(data: bytes, library: Path) -> tuple:
    """The kernel's functions (fp32 attention, latent attention, typed attention) from `data`, the verified bytes of
    `library`; `_Unusable` if they do not load.

    dlopen maps whatever a name holds when it opens it, and keeps the mapping: loading `library` by
    name would load what the name holds then, not the bytes just hashed. So the bytes are written to
    a private temp file in the same (trusted) folder, loaded, and unlinked at once; nothing else ever
    names it. (Not /tmp: it is often mounted noexec. Not /proc/self/fd/N: dlopen matches a name it
    has loaded before, and fd numbers are reused.)"""
    fd, private = tempfile.mkstemp(prefix=".load-", suffix=".so", dir=library.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            lib = ctypes.CDLL(private)
        except OSError as err:
            raise _Unusable(f"{library} does not load: {err}") from None
    finally:
        os.unlink(private)
    functions = []
    for symbol, argtypes in ((SYMBOL, _ARGTYPES), (LATENT_SYMBOL, _LATENT_ARGTYPES), (TYPED_SYMBOL, _TYPED_ARGTYPES)):
        fn = getattr(lib, symbol, None)
        if fn is None:
            raise _Unusable(f"{library} has no symbol {symbol}")
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        functions.append(fn)
    return tuple(functions)


def _open_kernel(kv_code: int = 0) -> tuple:
    """The kernel's ctypes functions (`_load`) of the library for K/V dtype `kv_code` (`DTYPE_CODES`):
    the cached library if it is trusted and verified, else built (once more when the cached one is
    unusable). Raises when there is none."""
    cc = _compiler()
    folder = _trusted_folder()
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout + _machine()
    source = SOURCE.read_bytes()
    errors = []
    for openmp in (("-fopenmp",), ()):  # a compiler without OpenMP still gets a one-thread kernel
        flags = (*FLAGS, f"-DHF_PAGED_KV={int(kv_code)}", *openmp)
        digest = hashlib.sha256(source + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
        library = folder / f"paged_attention-{digest}.so"
        if library.exists():
            try:
                return _load(_read_verified(library), library)
            except _Unusable as err:  # (_Refused is not caught: a file others could write is not replaced)
                logger.info("hf_paged: rebuilding the CPU attention kernel: %s", err)
        try:
            data = _compile(cc, flags, library)
        except _BuildFailed as err:
            errors.append(str(err))
            continue
        try:
            return _load(data, library)
        except _Unusable as err:  # a fresh build that does not load is final: no second rebuild
            raise RuntimeError(f"{err} (just built)") from None
    raise RuntimeError("; ".join(errors))


def load():
    """The kernel's ctypes function, built on first call; None (with one warning) where there is none."""
    if "fn" in _loaded or "error" in _loaded:
        return _loaded.get("fn")
    with _lock:
        if "fn" not in _loaded and "error" not in _loaded:
            try:
                _loaded["fn"], _loaded["latent"], _loaded["typed"] = _open_kernel()
            except Exception as err:  # the kernel is an optimisation: no failure of it may stop a forward
                _loaded["error"] = str(err) or type(err).__name__
                logger.warning("hf_paged: the CPU attention kernel could not be built or loaded, so attention "
                               "runs on the slower torch path: %s", _loaded["error"])
    return _loaded.get("fn")


def load_kv(dtype: torch.dtype):
    """The typed entry (`TYPED_SYMBOL`) of the library for K/V of `dtype` (a `DTYPE_CODES` key), built
    on its first call; None where there is none (no fp32 kernel, or this one failed: said once)."""
    if load() is None:
        return None
    if dtype == torch.float32:
        return _loaded.get("typed")
    key = f"kv {dtype}"
    if key not in _loaded:
        with _lock:
            if key not in _loaded:
                try:
                    _loaded[key] = _open_kernel(DTYPE_CODES[dtype])[2]
                except Exception as err:  # an optimisation: that dtype's calls take the torch path
                    _loaded[key] = None
                    logger.warning("hf_paged: the CPU attention kernel for a %s K/V cache could not be built or "
                                   "loaded, so it runs on the slower torch path: %s", dtype, err)
    return _loaded[key]


def load_error() -> str | None:
    """Why `load()` returned None (after it did), else None."""
    return _loaded.get("error")


def supports(num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int, block_size: int) -> bool:
    """Whether the kernel takes these shapes (the rest run on the torch path)."""
    return (num_kv_heads > 0 and num_q_heads % num_kv_heads == 0 and block_size <= MAX_BLOCK_SIZE
            and all(d % LANES == 0 and 0 < d <= MAX_HEAD_DIM for d in (head_dim, head_dim_v)))


def can_run(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scales=None) -> bool:
    """Whether this call's tensors are ones the kernel reads: CPU tensors, queries fp32 / bf16 / fp16,
    K/V of one dtype (`FLOAT_KV_DTYPES` of the query's, or quantised with `scales`, a
    `kv_quant.KVScales` of float32 [num_blocks, block_size, 1 or num_kv_heads, 1 or 2] contiguous
    tensors), each block's [block_size, num_kv_heads, head_dim] contiguous (any block stride), and
    nothing autograd would need to differentiate. The rest runs on the torch path."""
    if query.device.type != "cpu" or query.dtype not in QUERY_DTYPES or value_cache.dtype != key_cache.dtype:
        return False
    if scales is None:
        if key_cache.dtype not in FLOAT_KV_DTYPES[query.dtype]:
            return False
    elif key_cache.dtype not in QUANTIZED_KV_DTYPES or not _scales_fit(scales, key_cache):
        return False
    if not (_blocks_contiguous(key_cache) and _blocks_contiguous(value_cache)):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key_cache.requires_grad or value_cache.requires_grad):
        return False
    return (supports(query.shape[1], key_cache.shape[2], query.shape[2], value_cache.shape[3], key_cache.shape[1])
            and _entry(query, key_cache, value_cache, scales) is not None)


def _entry(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scales):
    """The kernel's function for this call: the fp32 one (`SYMBOL`) for fp32 queries over contiguous
    fp32 K/V, else the typed one of the K/V dtype's library (`load_kv`); None where there is none."""
    if (scales is None and query.dtype == key_cache.dtype == torch.float32 and key_cache.is_contiguous()
            and value_cache.is_contiguous()):
        return load()
    return load_kv(key_cache.dtype)


def _blocks_contiguous(cache: torch.Tensor) -> bool:
    """Whether `cache` [num_blocks, block_size, Hkv, D] is blocks of contiguous rows, one block stride apart."""
    if cache.dim() != 4 or cache.device.type != "cpu" or not cache.shape[0] or not cache[0].is_contiguous():
        return False
    return cache.shape[0] == 1 or cache.stride(0) >= cache[0].numel()


def _scales_fit(scales, key_cache: torch.Tensor) -> bool:
    """Whether a quantised cache's scales are ones the kernel reads (see `can_run`)."""
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    key, value = scales.key, scales.value
    return (key.dim() == 4 and key.shape == value.shape and key.shape[:2] == (num_blocks, block_size)
            and key.shape[2] in (1, num_kv_heads) and key.shape[3] in (1, 2)
            and key.dtype == value.dtype == torch.float32 and key.device.type == value.device.type == "cpu"
            and key.is_contiguous() and value.is_contiguous())


def num_splits(num_seqs: int, max_blocks: int) -> int:
    """Key splits per sequence: enough work items for every thread when few sequences are long."""
    threads = torch.get_num_threads()
    if num_seqs >= ITEMS_PER_THREAD * threads:
        return 1
    want = -(-ITEMS_PER_THREAD * threads // max(num_seqs, 1))
    return max(1, min(want, max_blocks // MIN_BLOCKS_PER_SPLIT))


def attend(
    query: torch.Tensor,  # [T, Hq, D] fp32 / bf16 / fp16, last dim contiguous: the short runs' tokens only, packed
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], each block contiguous (`can_run`)
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv], the key cache's dtype
    block_tables: torch.Tensor,  # [S, max_blocks] int32 contiguous, the runs' rows
    seq_lens: torch.Tensor,  # [S] int32
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32, into `query`
    max_rows: int,  # max q_len * Hq
    nsplit: int,
    kv_tokens: int,  # sum of the runs' lengths (decides whether the call is worth more than one thread)
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [Hq]
    scratch,  # callable(name, shape) -> an fp32 buffer (the step's workspace)
    chunk_size: int | None = None,  # Llama 4's local chunk: keys from (pos // C) * C on
    scales=None,  # a quantised cache's `kv_quant.KVScales` (`can_run` has checked them)
) -> torch.Tensor:  # [T, Hq, Dv] in the query's dtype
    """The short runs' attention, by the native kernel. It reads and writes through every pointer and
    count it is given, unchecked: its caller, `torch_paged.paged_attention`, has checked the step's
    metadata (`AttentionPlan`), each call's shapes and the block ids against the pool, and that the
    kernel reads these tensors (`can_run`)."""
    fn = _entry(query, key_cache, value_cache, scales)
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    head_dim_v = value_cache.shape[3]
    num_seqs = block_tables.shape[0]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()
    out = query.new_empty(num_tokens, num_q_heads, head_dim_v)
    kv_bytes = kv_tokens * num_kv_heads * (head_dim + head_dim_v) * key_cache.element_size()
    threads = torch.get_num_threads() if kv_bytes >= PARALLEL_MIN_BYTES else 1
    part_ml = scratch("cpu_ml", (num_seqs, nsplit, 2, max_rows))
    part_acc = scratch("cpu_acc", (num_seqs, nsplit, max_rows, head_dim_v))
    metadata = (block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), cu_seqlens_q.data_ptr(),
                num_seqs, num_q_heads, num_kv_heads, head_dim, head_dim_v, block_size, float(scale),
                int(sliding_window or 0), int(chunk_size or 0), float(softcap or 0.0),
                None if sinks is None else sinks.data_ptr(), nsplit, max_rows, part_ml.data_ptr(), part_acc.data_ptr())
    if fn is _loaded.get("fn"):
        status = fn(query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
                    *metadata, out.data_ptr(), threads)
    else:
        if scales is None:
            scale_args = (None, None, 0, 0, 0, 0)
        else:  # [num_blocks, block_size, groups, channels] contiguous; one group: every head reads it
            groups, channels = scales.key.shape[2:]
            scale_args = (scales.key.data_ptr(), scales.value.data_ptr(), scales.key.stride(0), groups * channels,
                          channels if groups > 1 else 0, channels)
        code = DTYPE_CODES[query.dtype]
        status = fn(
            query.data_ptr(), query.stride(0), query.stride(1), code, key_cache.data_ptr(), value_cache.data_ptr(),
            key_cache.stride(0) if key_cache.shape[0] > 1 else key_cache[0].numel(),
            value_cache.stride(0) if value_cache.shape[0] > 1 else value_cache[0].numel(),
            DTYPE_CODES[key_cache.dtype], *scale_args, *metadata, out.data_ptr(), code, threads)
    if status != 0:
        raise ValueError(f"hf_paged CPU kernel: shapes it does not take (Hq={num_q_heads}, Hkv={num_kv_heads}, "
                         f"D={head_dim}, Dv={head_dim_v}, block_size={block_size})")
    return out


class ShortRuns:
    """Every short-query sequence of a step (decode, speculative verify), for this kernel in one call
    over all of them: their block-table rows, lengths and query offsets, and where their tokens sit
    in the packed query (built by `torch_paged.AttentionPlan`)."""

    def __init__(self, seqs: list[int], q_lens: list[int], seq_lens: list[int], cu: list[int],
                 block_tables: torch.Tensor, block_size: int, num_tokens: int):
        used = [-(-seq_lens[i] // block_size) for i in seqs]
        num_blocks = max(used)  # within the table's width (`torch_paged._check_metadata`)
        rows = torch.tensor(seqs, device=block_tables.device)
        self.block_tables = block_tables[rows, :num_blocks].to(torch.int32).contiguous()  # [S, num_blocks]
        # The kernel reads whatever a block id points at: the ids it will read, checked per call against
        # the pool (a bad id is an IndexError here, as on the torch path, not a crash).
        named = self.block_tables[torch.arange(num_blocks)[None, :] < torch.tensor(used)[:, None]]
        self.block_range = (int(named.min()), int(named.max()))
        self.seq_lens = torch.tensor([seq_lens[i] for i in seqs], dtype=torch.int32)  # [S]
        offsets = [0]
        for i in seqs:
            offsets.append(offsets[-1] + q_lens[i])
        self.cu_seqlens_q = torch.tensor(offsets, dtype=torch.int32)  # [S + 1]
        tokens = [t for i in seqs for t in range(cu[i], cu[i] + q_lens[i])]
        # The runs hold the whole packed query in order (a pure decode step): no gather, no scatter.
        self.is_whole = tokens == list(range(num_tokens))
        self.token_index = None if self.is_whole else torch.tensor(tokens)  # [T_short]
        self.max_q_len = max(q_lens[i] for i in seqs)
        self.kv_tokens = sum(seq_lens[i] for i in seqs)
        self.num_splits = num_splits(len(seqs), num_blocks)


# -- latent attention (absorbed MLA) ------------------------------------------------------------------

LATENT_ROW_TILE = 4  # query rows the kernel computes together (csrc: LRT)
# Below this many flops (0.1 ms of a core) a latent call runs on one thread; flops: all heads read the same rows.
LATENT_PARALLEL_MIN_FLOPS = 1 << 23


def latent_attention(call, workspace=None) -> torch.Tensor | None:
    """Absorbed latent attention (MLA) of a decode or verify step on the native kernel, reading the
    paged rows in place: all query heads of a sequence read one row per token, K its first L + R
    columns and V its first L, each block once per tile of query rows.

    Args:
        call: a `backend.LayerCall` with `latent_dim` L: `query` [num_tokens, num_q_heads, L + R]
            (q_nope through W_UK, then q_rot), `key_cache` [num_blocks, block_size, 1, L + R], a view
            of the pool's rows (any token and block stride), `value_cache` its first L columns.
        workspace: the step's scratch (`workspace.Workspace`); None: fresh buffers.

    Returns:
        [num_tokens, num_q_heads, L] fp32; None for a call it does not take, which the torch path then
        runs (and which names any error in it): `max_seqlen_q` past MAX_DECODE_QUERY_LEN (prefill),
        other than fp32 CPU tensors and int32 CPU metadata, a mask, softcap, sinks, quantised cache or
        autograd, a `value_cache` other than `key_cache`'s prefix, blocks past MAX_BLOCK_SIZE, no
        kernel, metadata that would read outside the tensors (the kernel checks it before it reads
        through it). L and R may be any widths (a partial chunk of lanes is read masked).

    Raises:
        IndexError: a block id the sequences read lies outside the pool.
    """
    query, key_cache, value_cache, latent_dim = call.query, call.key_cache, call.value_cache, call.latent_dim
    metadata = (call.block_tables, call.seq_lens, call.cu_seqlens_q)
    if (load() is None or "latent" not in _loaded or call.max_seqlen_q > MAX_DECODE_QUERY_LEN or call.needs_grad
            or call.scales is not None or call.softcap is not None or call.sinks is not None or call.mask.kinds
            or (query.dim(), key_cache.dim(), value_cache.dim(), call.block_tables.dim()) != (3, 4, 4, 2)
            or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (query, key_cache, value_cache))
            or any(t.dtype != torch.int32 or t.device.type != "cpu" for t in metadata)):
        return None
    num_tokens, num_q_heads, width = query.shape
    num_blocks, block_size, num_kv_heads, key_width = key_cache.shape
    # V is read as K's prefix: only where it is exactly that view.
    if not (0 < latent_dim <= width == key_width and num_kv_heads == 1 and num_q_heads > 0
            and 0 < block_size <= MAX_BLOCK_SIZE and key_cache.stride(3) == 1 == value_cache.stride(3)
            and value_cache.data_ptr() == key_cache.data_ptr() and value_cache.stride()[:2] == key_cache.stride()[:2]
            and value_cache.shape == (num_blocks, block_size, 1, latent_dim)
            and call.block_tables.shape[0] == call.seq_lens.numel() == call.cu_seqlens_q.numel() - 1):
        return None
    if num_tokens == 0:
        return query.new_zeros(0, num_q_heads, latent_dim)
    max_seqlen_k = max(call.max_seqlen_k, 1)
    flops = 2 * (width + latent_dim) * num_q_heads * num_tokens * max_seqlen_k  # at most
    threads = torch.get_num_threads() if flops >= LATENT_PARALLEL_MIN_FLOPS else 1
    splits, heads_per_group = latent_partition(call.seq_lens.numel(), num_q_heads, call.max_seqlen_q,
                                               -(-max_seqlen_k // block_size), threads)
    return attend_latent(query, key_cache, latent_dim, *(t.contiguous() for t in metadata), call.max_seqlen_q,
                         call.scale, splits, heads_per_group, threads, workspace)


def latent_partition(num_seqs: int, num_q_heads: int, max_q_len: int, max_blocks: int, threads: int) -> tuple:
    """(key splits per sequence, query heads per group) of a latent call: whole sequences when there
    are enough for every thread, else their keys split (a row is still read once), then their heads
    grouped (each group reads the rows again) while there are too few blocks to split."""
    want = ITEMS_PER_THREAD * threads
    if threads == 1 or num_seqs >= want:
        return 1, num_q_heads
    splits = max(1, min(-(-want // num_seqs), max_blocks // MIN_BLOCKS_PER_SPLIT))
    groups = max(1, min(-(-want // (num_seqs * splits)), num_q_heads * max_q_len // LATENT_ROW_TILE, num_q_heads))
    return splits, -(-num_q_heads // groups)


def attend_latent(
    query: torch.Tensor,  # [T, Hq, L + R] fp32
    key_cache: torch.Tensor,  # [num_blocks, block_size, 1, L + R] fp32, last dim contiguous: the rows
    latent_dim: int,  # L: V is key_cache[..., :L]
    block_tables: torch.Tensor,  # [S, max_blocks] int32, last dim contiguous
    seq_lens: torch.Tensor,  # [S] int32 contiguous
    cu_seqlens_q: torch.Tensor,  # [S + 1] int32 contiguous
    max_q_len: int,
    scale: float,
    num_splits: int = 1,  # key splits per sequence
    heads_per_group: int | None = None,  # None: every head in one group
    threads: int = 1,
    workspace=None,
) -> torch.Tensor | None:  # [T, Hq, L] fp32
    """The latent kernel's call on tensors of the dtypes, shapes and strides above (not checked here).
    The kernel checks the metadata against them before it reads through it: None where it would read
    outside them (a run longer than `max_q_len` or its sequence, a table row too short, `cu_seqlens_q`
    not ending at T), an IndexError for a block id outside the pool."""
    num_tokens, num_q_heads, width = query.shape
    query = query if query.stride(2) == 1 else query.contiguous()
    heads_per_group = min(heads_per_group or num_q_heads, num_q_heads)
    items = block_tables.shape[0] * -(-num_q_heads // heads_per_group) * num_splits
    max_rows = max(1, max_q_len * heads_per_group)
    padded = -(-latent_dim // LANES) * LANES  # a partial output row is whole chunks of lanes
    shapes = {"latent_ml": (items, 2, max_rows), "latent_acc": (items, max_rows, padded)}
    part_ml, part_acc = (workspace.get(name, shape, torch.float32, query.device) if workspace is not None
                         else torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items())
    out = query.new_empty(num_tokens, num_q_heads, latent_dim)
    status = _loaded["latent"](
        query.data_ptr(), query.stride(0), query.stride(1), num_tokens, key_cache.data_ptr(), key_cache.stride(0),
        key_cache.stride(1), key_cache.shape[0], block_tables.data_ptr(), block_tables.stride(0),
        block_tables.shape[1], seq_lens.data_ptr(), cu_seqlens_q.data_ptr(), block_tables.shape[0], num_q_heads,
        latent_dim, width - latent_dim, key_cache.shape[1], float(scale), num_splits, heads_per_group, max_rows,
        part_ml.data_ptr(), part_acc.data_ptr(), out.data_ptr(), threads)
    if status == -3:  # as the native path of `torch_paged.paged_attention` says it
        raise IndexError(f"paged_attention: the block tables name a block outside the pool of {key_cache.shape[0]} "
                         "blocks")
    if status != 0:
        return None  # the torch path names what is wrong
    return out
