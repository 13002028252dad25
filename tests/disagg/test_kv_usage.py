"""The KV pool figures a disaggregated (or data-parallel) worker reports, and what the router and the
served `vllm:kv_cache_usage_perc` make of them, in one process: a block that a new request could take
(free, or only prefix-cached) counts once, as in one `Engine`'s own figure. Counting the cached blocks
on top of the free ones (which already hold them) made the usage negative after a prefix-cache-heavy
workload, and made a replica with a warm cache look roomier to the router than it is."""

from __future__ import annotations

from types import SimpleNamespace

from torch.distributed import HashStore

from hf_paged import Engine, SamplingParams
from hf_paged.disagg import AsyncDisaggregatedEngine
from hf_paged.disagg.mailbox import Mailbox
from hf_paged.disagg.router import Router
from hf_paged.disagg.worker import Worker, WorkerSpec
from tiny_models import VOCAB, tiny_model

SYSTEM = list(range(100, 132))  # eight full blocks of 4, shared by every prompt


def _status(engine: Engine, name: str) -> dict:
    """What the worker `name` over `engine` reports in its heartbeats."""
    spec = WorkerSpec(name, "replica", 0, 2, "127.0.0.1", 0, "gloo", None)
    return Worker(spec, engine, Mailbox(HashStore(), name)).status()


def test_a_prefix_cached_block_counts_once_in_the_usage_and_the_routers_room():
    engine = Engine(tiny_model("llama", "hf_paged"), num_blocks=40, block_size=4)
    engine.generate([SYSTEM + [3 + i, 7, 9] for i in range(4)], SamplingParams(max_new_tokens=4))
    engine.add_request(SYSTEM + [50, 51, 52, 53, 54], SamplingParams(max_new_tokens=8))
    engine.step()  # one request running: it holds the shared blocks (cached, in use) and its own
    pool = engine.cache.pool
    assert 0 < pool.num_used_blocks < pool.num_blocks and pool.num_cached_blocks > pool.num_used_blocks
    single = engine.metrics()["vllm:kv_cache_usage_perc"]
    assert single == pool.num_used_blocks / pool.num_blocks

    names = ["replica0", "replica1"]
    workers = {name: _status(engine, name) for name in names}  # two replicas in this very state
    assert all(st["free_blocks"] == pool.num_free_blocks for st in workers.values())
    stub = SimpleNamespace(supervisor=SimpleNamespace(ready_reports={n: {"vocab_size": VOCAB} for n in names},
                                                      decode_names=names),
                           metrics=lambda: {"workers": workers})
    usage = AsyncDisaggregatedEngine(stub).metrics()["vllm:kv_cache_usage_perc"]
    assert 0.0 <= usage <= 1.0 and abs(usage - single) < 1e-12

    router = Router([], names, block_size=4)
    for name, st in workers.items():
        router.report(name, st["free_blocks"])
    assert router.reported_free == {name: pool.num_free_blocks for name in names}
