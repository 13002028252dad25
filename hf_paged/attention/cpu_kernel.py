"""The native CPU kernel of paged attention for short query runs: its build, its shape rules, its call.

`csrc/paged_attention.c` reads fp32 K/V in place through the block table (no gather into a
workspace, no copy): decode and speculative-verify sequences of a step, all in one call. It is
compiled on first use with the host's C compiler (`$CC`, else `cc`), `-O3 -march=native -fopenmp`,
into `$HF_PAGED_KERNEL_CACHE` (default `~/.cache/hf_paged/kernels`), under a name that hashes the
source, the flags, the compiler's version and the CPU's flags, and is loaded with ctypes (which releases the GIL for
the call). Inductor builds its CPU kernels the same way (gcc, OpenMP), so a machine where
`torch.compile` works builds this too. Without a compiler, or if the build fails, `load()` says why
once (a warning) and returns None: the step then runs on the torch path (`torch_paged`), which is
slower and the same up to float rounding.

Owns the build and the ctypes signature; `torch_paged.AttentionPlan` decides which sequences go
here (`supports`), and `torch_paged.paged_attention` calls `attend`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
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
_ARGTYPES = [_P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I32, _I32, _I32, _I32, _I32, _I32, _F32, _I32, _F32, _P,
             _I32, _I32, _P, _P, _P, _I32]

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "fn" -> the ctypes function, or "error" -> why there is none


def cache_dir() -> Path:
    return Path(os.environ.get("HF_PAGED_KERNEL_CACHE") or Path.home() / ".cache" / "hf_paged" / "kernels")


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc) or shutil.which("gcc")


def _machine() -> str:
    """What `-march=native` compiles for: a cache shared between machines (a network home) keeps one
    library per kind of CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout + _machine()
    source = SOURCE.read_bytes()
    errors = []
    for openmp in (("-fopenmp",), ()):  # a compiler without OpenMP still gets a one-thread kernel
        flags = (*FLAGS, *openmp)
        digest = hashlib.sha256(source + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
        target = cache_dir() / f"paged_attention-{digest}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            done = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode != 0:
                os.unlink(tmp)
                errors.append(f"{cc} {' '.join(flags)}: {done.stderr.strip()[-800:]}")
                continue
            os.replace(tmp, target)  # atomic: a concurrent process sees the old name or a whole library
        return ctypes.CDLL(str(target))
    raise RuntimeError("; ".join(errors))


def load():
    """The kernel's ctypes function, built on first call; None (with one warning) where it cannot be built."""
    if "fn" in _loaded or "error" in _loaded:
        return _loaded.get("fn")
    with _lock:
        if "fn" not in _loaded and "error" not in _loaded:
            try:
                fn = _build().hf_paged_attention_f32
                fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
                _loaded["fn"] = fn
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                _loaded["error"] = str(err)
                logger.warning("hf_paged: the CPU attention kernel could not be built, so attention runs on the "
                               "slower torch path: %s", err)
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
) -> torch.Tensor:  # [T, Hq, Dv] fp32
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
                int(sliding_window or 0), float(softcap or 0.0), None if sinks is None else sinks.data_ptr(),
                nsplit, max_rows, part_ml.data_ptr(), part_acc.data_ptr(), out.data_ptr(), threads)
    if status != 0:
        raise ValueError(f"hf_paged CPU kernel: shapes it does not take (Hq={num_q_heads}, Hkv={num_kv_heads}, "
                         f"D={head_dim}, Dv={head_dim_v}, block_size={block_size})")
    return out
