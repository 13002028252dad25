"""Bounds on the CPU kernel caches that grow with every new step shape, for long-running processes.

On CPU, the engine's linears run through oneDNN's inner product (`hf.linear`'s fast kernel), and
oneDNN caches a compiled primitive per problem shape in two places: its own primitive cache
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, default 1024 entries) and ideep's computation cache in front of
it (`LRU_CACHE_CAPACITY`, default 1024). A continuous-batching engine packs a different number of
tokens into almost every step, and each new row count holds about 0.5 MB across the two caches
until each holds a thousand entries: a server's RSS climbs for hours (measured: +10% over 1,000
requests of the soak's load, with every Python object and tensor count flat).

Capping both at a few entries keeps memory flat (the soak's load: under 1% between the first and
last quarter) and costs nothing measurable: creating a primitive for a new shape takes far less
than the step it serves. Both libraries read these variables when they first create a primitive,
so `bound_cpu_kernel_caches` must run before the process's first forward; `hf-paged serve` and
`hf-paged generate --input` call it first thing. A value already in the environment wins. A library
cannot change the process's environment behind its user's back (other oneDNN work shares these
caches), so a program that runs its own long-lived `Engine` calls it, or sets the two variables.
"""

from __future__ import annotations

import os

# Entries per cache. A step uses one primitive per distinct weight shape (q/k/v/o, gate/up, down,
# lm_head: at most ~8), so 16 keeps every primitive of the current step cached.
DEFAULT_CAPACITY = 16
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_cpu_kernel_caches(capacity: int = DEFAULT_CAPACITY) -> dict[str, str]:
    """Cap oneDNN's and ideep's primitive caches at `capacity` entries unless the environment already
    sets them. Returns the values in effect. Call it before the process's first forward."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
    for name in VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return {name: os.environ[name] for name in VARIABLES}
