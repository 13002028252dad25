"""Torch-free bookkeeping: which physical block holds which token, and which request runs next.

Owns the block pool (free list, reference counts, the prefix-cache hash chain, copy-on-write), the
per-sequence block tables, the iteration-level scheduler, and the KV-group rule of which blocks a
sliding-window layer group may drop (`kv_groups`, not yet wired into the tables). Everything here is plain Python over
integer ids: it never imports torch or transformers, never touches a tensor and never computes a
kernel address beyond a slot number (`block_id * block_size + offset`). `tests/core` checks that it
imports with torch unavailable.
"""

from .block_pool import AppendResult, BlockManager, BlockPool, NoFreeBlocksError, hash_block_tokens
from .kv_groups import KVGroup, blocks_held, kv_groups, num_freeable_blocks
from .scheduler import Request, RequestStatus, ScheduledRequest, Scheduler, SchedulerOutput
from .sequence import KVSequence

__all__ = [
    "AppendResult",
    "BlockManager",
    "BlockPool",
    "KVGroup",
    "KVSequence",
    "NoFreeBlocksError",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "blocks_held",
    "hash_block_tokens",
    "kv_groups",
    "num_freeable_blocks",
]
