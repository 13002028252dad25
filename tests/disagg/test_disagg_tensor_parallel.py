"""Disaggregated prefill and decode workers with their own tensor-parallel sizes (gloo, CPU): prefill
TP 2 -> decode TP 1, TP 1 -> TP 2 and TP 2 -> TP 2 give one `Engine`'s output, and a request's K/V move
in pieces, each KV head once: the bytes moved are exactly the prompts' K/V. A killed rank of a
tensor-parallel worker takes its worker down, and its requests are re-run on what is left."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from transformers import AutoModelForCausalLM

from hf_paged import Engine, SamplingParams
from hf_paged.disagg import DisaggregatedEngine
from hf_paged.disagg.transfer import plan_pieces
from hf_paged.parallel import TensorParallelReplica
from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.slow

PROMPTS = [[3 + (i * 7 + j) % (VOCAB - 3) for j in range(n)] for i, n in enumerate([5, 20, 37, 64, 16, 90])]
KV_BYTES_PER_TOKEN = 3 * 2 * 2 * 16 * 4  # layers x (K, V) x 2 KV heads x head_dim x fp32: the whole model's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return str(path)


def _reference(model_dir, prompts, params):
    engine = Engine(AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="hf_paged"))
    return [o.token_ids for o in engine.generate(prompts, params)]


def _tree(pids) -> list[int]:
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        todo += [int(p) for p in out.split()]
    return found


def _all_gone(pids, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_pieces_move_each_kv_head_once_from_its_holder_to_its_user():
    assert plan_pieces(4, [0, 1], [2]) == [
        {"src": 0, "dst": 2, "heads": (0, 2), "src_heads": (0, 2), "dst_heads": (0, 2)},
        {"src": 1, "dst": 2, "heads": (2, 4), "src_heads": (0, 2), "dst_heads": (2, 4)}]
    assert [(p["src"], p["dst"], p["heads"]) for p in plan_pieces(4, [0], [1, 2])] == [(0, 1, (0, 2)), (0, 2, (2, 4))]
    for src, dst in (([0, 1], [2, 3, 4]), ([0, 1, 2], [3, 4]), ([0, 1, 2, 3, 4, 5], [6, 7])):
        pieces = plan_pieces(6, src, dst)
        heads = sorted(h for p in pieces for h in range(*p["heads"]))
        assert heads == list(range(6))  # every head exactly once
        for p in pieces:
            assert p["src_heads"][1] - p["src_heads"][0] == p["dst_heads"][1] - p["dst_heads"][0]
    with pytest.raises(ValueError, match="do not split"):
        plan_pieces(3, [0, 1], [2])


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_pools_with_their_own_tp_sizes_equal_one_engine_and_move_the_prompts_kv_once(model_dir, prefill_tp,
                                                                                      decode_tp):
    greedy = SamplingParams(max_new_tokens=10)
    seeded = [SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=50 + i) for i in range(len(PROMPTS))]
    with DisaggregatedEngine(TensorParallelReplica(model_dir), num_prefill=1, num_decode=1,
                             prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp) as engine:
        tree = _tree(engine.worker_pids.values())
        assert len(tree) >= prefill_tp + decode_tp  # each worker started its other ranks
        out = engine.generate(PROMPTS, greedy)
        assert [o.token_ids for o in out] == _reference(model_dir, PROMPTS, greedy)
        m = engine.metrics()
        assert m["kv_bytes_transferred"] == sum(len(p) for p in PROMPTS) * KV_BYTES_PER_TOKEN  # each head once
        assert m["transfers"]["prefill0->decode0"]["count"] == len(PROMPTS) and not m.get("recomputed")
        out = engine.generate(PROMPTS, seeded)
        assert [o.token_ids for o in out] == _reference(model_dir, PROMPTS, seeded)
    assert _all_gone(tree)


def _kill_second_rank(engine, victim: str) -> None:
    """SIGKILL the worker's second rank, not the process the router watches."""
    [rank1] = [int(p) for p in subprocess.run(["pgrep", "-P", str(engine.worker_pids[victim])],
                                              capture_output=True, text=True).stdout.split()
               if "hf_paged.disagg.rank" in open(f"/proc/{p}/cmdline").read()]
    os.kill(rank1, signal.SIGKILL)


# The prefill worker's rank dies while it is idle (found at its next step); the decode worker's mid-run.
@pytest.mark.parametrize("victim", ["prefill0", "decode0"])
def test_a_killed_rank_takes_its_worker_down_and_its_requests_are_rerun(model_dir, victim):
    import threading

    long = SamplingParams(max_new_tokens=40, ignore_eos=True)
    many = [PROMPTS[i % len(PROMPTS)] + [7 + i] for i in range(12)]
    # A dead decode worker's requests need a second decode worker; a dead prefill worker's go to the decode
    # worker whole, so one (two more ranks would add only their start-up).
    num_decode = 2 if victim.startswith("decode") else 1
    with DisaggregatedEngine(TensorParallelReplica(model_dir), num_prefill=1, num_decode=num_decode,
                             heartbeat_timeout=5.0,
                             prefill_tensor_parallel_size=2, decode_tensor_parallel_size=2,
                             faults={victim: {"slow_step_seconds": 0.1}}) as engine:
        tree = _tree(engine.worker_pids.values())
        if victim == "prefill0":
            _kill_second_rank(engine, victim)
        box = {}
        thread = threading.Thread(target=lambda: box.setdefault("out", engine.generate(many, long)))
        thread.start()
        if victim == "decode0":
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                status = engine.metrics()["workers"].get(victim, {})
                if status.get("engine", {}).get("vllm:generation_tokens", 0) > 0 and status.get("running", 0) > 0:
                    break
                time.sleep(0.05)
            _kill_second_rank(engine, victim)
        thread.join(180)
        assert not thread.is_alive()
        m = engine.metrics()
        assert m["dead_workers"] == [victim] and m["reroutes"] >= 1
    assert [o.token_ids for o in box["out"]] == _reference(model_dir, many, long)
    assert len({o.request_id for o in box["out"]}) == len(many)
    assert _all_gone(tree)
