"""The disaggregated router's policy (torch-free) and the control mailbox, in one process."""

from __future__ import annotations

import pytest
from torch.distributed import HashStore

from hf_paged.serve.mailbox import Mailbox
from hf_paged.serve.router import Router


def test_prefill_goes_where_the_prompts_leading_blocks_were_computed_then_to_the_least_loaded():
    router = Router(["p0", "p1"], ["d0"], block_size=4)
    system = list(range(100, 112))  # three full blocks
    first = router.choose_prefill(system + [1, 2])
    router.start_prefill(first, system + [1, 2])
    other = "p1" if first == "p0" else "p0"
    assert router.choose_prefill(system + [7, 8, 9]) == first  # affinity beats load
    assert router.choose_prefill([50, 51, 52, 53, 54]) == other  # no shared block: the idle worker
    router.end_prefill(first, system + [1, 2])
    router.start_prefill(other, list(range(40)))
    assert router.choose_prefill([60, 61]) == first  # least prompt tokens outstanding


def test_affinity_follows_the_chain_not_single_blocks():
    router = Router(["p0", "p1"], ["d0"], block_size=2)
    router.start_prefill("p1", [1, 2, 3, 4])
    router.end_prefill("p1", [1, 2, 3, 4])
    router.start_prefill("p0", list(range(20)))  # p0 busy
    assert router.choose_prefill([1, 2, 3, 4, 5]) == "p1"
    assert router.choose_prefill([9, 9, 3, 4]) == "p1"  # block [3, 4] after another block: no match; load decides


def test_decode_goes_to_the_most_free_blocks_less_what_was_pledged():
    router = Router(["p0"], ["d0", "d1"], block_size=16)
    router.report("d0", 100)
    router.report("d1", 80)
    assert router.choose_decode() == "d0"
    router.pledge("d0", 30)
    assert router.choose_decode() == "d1"
    router.unpledge("d0", 30)
    assert router.choose_decode() == "d0"
    assert router.blocks_for(33) == 3


def test_dead_workers_are_never_chosen():
    router = Router(["p0", "p1"], ["d0", "d1"], block_size=4)
    router.start_prefill("p0", list(range(8)))
    router.mark_dead("p0")
    router.mark_dead("d0")
    assert router.choose_prefill(list(range(8))) == "p1" and router.choose_decode() == "d1"
    router.mark_dead("p1")
    router.mark_dead("d1")
    assert router.choose_prefill([1]) is None and router.choose_decode() is None
    assert router.alive() == []


def test_a_router_needs_workers():
    with pytest.raises(ValueError, match="at least one worker"):
        Router([], [], block_size=16)


def test_mailbox_delivers_in_order_and_counts_what_it_sent():
    store = HashStore()
    a, b = Mailbox(store, "a"), Mailbox(store, "b")
    assert b.poll() == []
    for i in range(5):
        a.send("b", {"op": "x", "i": i})
    a.send("b", {"op": "y"})
    assert [m.get("i") for m in b.poll(limit=3)] == [0, 1, 2]
    assert [m.get("i") for m in b.poll()] == [3, 4, None]
    assert b.poll() == [] and a.num_sent == {"x": 5, "y": 1}


def test_mailbox_beats_and_status():
    store = HashStore()
    w, r = Mailbox(store, "w"), Mailbox(store, "router")
    assert r.beats_of("w") == 0 and r.status_of("w") is None
    w.beat({"free_blocks": 7})
    w.beat({"free_blocks": 5})
    assert r.beats_of("w") == 2 and r.status_of("w") == {"free_blocks": 5}
