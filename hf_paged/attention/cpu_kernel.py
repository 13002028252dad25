"""The native CPU kernel of paged attention for short query runs: its build, its shape rules, its call.

`csrc/paged_attention.c` reads fp32 K/V in place through the block table (no gather into a
workspace, no copy): decode and speculative-verify sequences of a step, all in one call. It is
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

Owns the build and the ctypes signature; `torch_paged.AttentionPlan` decides which sequences go
here (`supports`) and checks the step's metadata, `torch_paged.paged_attention` checks each call's
shapes and calls `attend`, which trusts both checks.
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

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
SYMBOL = "hf_paged_attention_f32"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC")
MAX_HEAD_DIM = 256  # the kernel's limits (csrc: MAXC * W, MAXBS)
MAX_BLOCK_SIZE = 64
LANES = 16
# Work items (sequence x key split) per thread to aim for; a split keeps at least this many blocks.
ITEMS_PER_THREAD = 4
MIN_BLOCKS_PER_SPLIT = 4
# Below this many bytes of K/V a call runs on one thread: waking OpenMP's team costs more than the
# work, and its threads would then spin-wait, taking the cores from other processes on the machine.
PARALLEL_MIN_BYTES = 1 << 20

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32, _I32, _F32, _I32, _I32, _F32,
             _P, _I32, _I32, _P, _P, _P, _I32]

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "fn" -> the ctypes function, or "error" -> why there is none


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


def _load(data: bytes, library: Path):
    """The kernel's function from `data`, the verified bytes of `library`; `_Unusable` if they do not load.

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
    fn = getattr(lib, SYMBOL, None)
    if fn is None:
        raise _Unusable(f"{library} has no symbol {SYMBOL}")
    fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return fn


def _open_kernel():
    """The kernel's ctypes function: the cached library if it is trusted and verified, else built
    (once more when the cached one is unusable). Raises when there is none."""
    cc = _compiler()
    folder = _trusted_folder()
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout + _machine()
    source = SOURCE.read_bytes()
    errors = []
    for openmp in (("-fopenmp",), ()):  # a compiler without OpenMP still gets a one-thread kernel
        flags = (*FLAGS, *openmp)
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
                _loaded["fn"] = _open_kernel()
            except Exception as err:  # the kernel is an optimisation: no failure of it may stop a forward
                _loaded["error"] = str(err) or type(err).__name__
                logger.warning("hf_paged: the CPU attention kernel could not be built or loaded, so attention "
                               "runs on the slower torch path: %s", _loaded["error"])
    return _loaded.get("fn")


def load_error() -> str | None:
    """Why `load()` returned None (after it did), else None."""
    return _loaded.get("error")


def supports(num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int, block_size: int) -> bool:
    """Whether the kernel takes these shapes (the rest run on the torch path)."""
    return (num_kv_heads > 0 and num_q_heads % num_kv_heads == 0 and block_size <= MAX_BLOCK_SIZE
            and all(d % LANES == 0 and 0 < d <= MAX_HEAD_DIM for d in (head_dim, head_dim_v)))


def can_run(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether this call's tensors are ones the kernel reads: fp32 on the CPU, contiguous caches, and
    nothing autograd would need to differentiate."""
    if query.device.type != "cpu" or query.dtype != torch.float32:
        return False
    if key_cache.dtype != torch.float32 or value_cache.dtype != torch.float32:
        return False
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key_cache.requires_grad or value_cache.requires_grad):
        return False
    return supports(query.shape[1], key_cache.shape[2], query.shape[2], value_cache.shape[3], key_cache.shape[1])


def num_splits(num_seqs: int, max_blocks: int) -> int:
    """Key splits per sequence: enough work items for every thread when few sequences are long."""
    threads = torch.get_num_threads()
    if num_seqs >= ITEMS_PER_THREAD * threads:
        return 1
    want = -(-ITEMS_PER_THREAD * threads // max(num_seqs, 1))
    return max(1, min(want, max_blocks // MIN_BLOCKS_PER_SPLIT))


def attend(
    query: torch.Tensor,  # [T, Hq, D] fp32, last dim contiguous: the short runs' tokens only, packed
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] fp32 contiguous
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv] fp32 contiguous
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
) -> torch.Tensor:  # [T, Hq, Dv] fp32
    """The short runs' attention, by the native kernel. It reads and writes through every pointer and
    count it is given, unchecked: its caller, `torch_paged.paged_attention`, has checked the step's
    metadata (`AttentionPlan`), each call's shapes and the block ids against the pool."""
    fn = load()
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    head_dim_v = value_cache.shape[3]
    num_seqs = block_tables.shape[0]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()
    out = query.new_empty(num_tokens, num_q_heads, head_dim_v)
    kv_bytes = kv_tokens * num_kv_heads * (head_dim + head_dim_v) * 4
    threads = torch.get_num_threads() if kv_bytes >= PARALLEL_MIN_BYTES else 1
    part_ml = scratch("cpu_ml", (num_seqs, nsplit, 2, max_rows))
    part_acc = scratch("cpu_acc", (num_seqs, nsplit, max_rows, head_dim_v))
    status = fn(query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
                block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), cu_seqlens_q.data_ptr(),
                num_seqs, num_q_heads, num_kv_heads, head_dim, head_dim_v, block_size, float(scale),
                int(sliding_window or 0), int(chunk_size or 0), float(softcap or 0.0),
                None if sinks is None else sinks.data_ptr(),
                nsplit, max_rows, part_ml.data_ptr(), part_acc.data_ptr(), out.data_ptr(), threads)
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
