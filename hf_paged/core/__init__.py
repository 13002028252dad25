"""Torch-free bookkeeping: which physical block holds which token, and which request runs next.

Owns the block pool (free list, reference counts, the prefix-cache hash chain, copy-on-write), the
per-sequence block tables (one per KV group: sliding-window layers release what left their window,
by the rule in `config.kv_layout`), and the iteration-level scheduler. Everything here is plain Python over
integer ids: it never imports torch or transformers, never touches a tensor and never computes a
kernel address beyond a slot number (`block_id * block_size + offset`). `tests/core` checks that it
imports with torch unavailable.
"""

from .block_pool import AppendResult, BlockManager, BlockPool, NoFreeBlocksError, hash_block_tokens
from .rope import LengthRope
from .scheduler import Request, RequestStatus, ScheduledRequest, Scheduler, SchedulerOutput
from .sequence import NULL_BLOCK, KVSequence

__all__ = [
    "AppendResult",
    "BlockManager",
    "BlockPool",
    "KVSequence",
    "LengthRope",
    "NULL_BLOCK",
    "NoFreeBlocksError",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "hash_block_tokens",
]
