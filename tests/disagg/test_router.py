"""The disaggregated router's policy (torch-free) and the control mailbox, in one process."""

from __future__ import annotations

import time

import pytest
from torch.distributed import HashStore

from hf_paged.disagg.mailbox import Mailbox
from hf_paged.disagg.router import Router


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


def test_each_senders_messages_keep_their_order_among_other_senders():
    store = HashStore()
    a, c, b = Mailbox(store, "a"), Mailbox(store, "c"), Mailbox(store, "b")
    for i in range(4):
        a.send("b", {"op": "a", "i": i})
        c.send("b", {"op": "c", "i": i})
    got = b.poll()
    assert [m["i"] for m in got if m["op"] == "a"] == [0, 1, 2, 3]
    assert [m["i"] for m in got if m["op"] == "c"] == [0, 1, 2, 3]


class _DiesAt:
    """A store whose owner is SIGKILLed just before its `n`-th operation: that one and every later one never
    happen (what a killed sender leaves behind)."""

    def __init__(self, store, n: int):
        self.store, self.left = store, n

    def __getattr__(self, op):
        def call(*args):
            self.left -= 1
            if self.left <= 0:
                raise SystemExit("killed")
            return getattr(self.store, op)(*args)
        return call


@pytest.mark.parametrize("dies_at", range(1, 8))
def test_a_sender_killed_at_any_store_operation_never_holds_back_anyone_elses_mail(dies_at):
    """Killed between any two of its store operations (announce, write, ring; a second message), a sender
    loses at most what it was sending: the recipient still gets everything the others send, at once."""
    store = HashStore()
    router = Mailbox(store, "router", rescan_interval=0.05)
    victim = Mailbox(_DiesAt(store, dies_at + 1), "prefill0")  # its first operation claims its incarnation
    decode = Mailbox(store, "decode0")
    assert router.poll() == []
    try:
        victim.send("router", {"op": "first", "i": 0})
        victim.send("router", {"op": "first", "i": 1})
    except SystemExit:
        pass
    time.sleep(0.06)  # a message written before its bell rang is found by the next full scan
    # The victim's operations: announce (1), write 0 (2), ring (3), write 1 (4), ring (5). Whatever it wrote
    # arrives, in order, rung or not.
    written = (dies_at > 2) + (dies_at > 4)
    assert router.poll() == [{"op": "first", "i": i} for i in range(written)]
    decode.send("router", {"op": "done"})
    assert router.poll() == [{"op": "done"}]  # at once: nothing held back
    decode.send("router", {"op": "done", "again": True})
    assert router.poll() == [{"op": "done", "again": True}]


def test_a_participant_back_under_its_name_writes_a_new_stream():
    store = HashStore()
    r = Mailbox(store, "r")
    Mailbox(store, "w").send("r", {"op": "old"})
    assert r.poll() == [{"op": "old"}]
    Mailbox(store, "w").send("r", {"op": "new"})
    assert r.poll() == [{"op": "new"}]


def test_mailbox_beats_and_status():
    store = HashStore()
    w, r = Mailbox(store, "w"), Mailbox(store, "router")
    assert r.beats_of("w") == 0 and r.status_of("w") is None
    w.beat({"free_blocks": 7})
    w.beat({"free_blocks": 5})
    assert r.beats_of("w") == 2 and r.status_of("w") == {"free_blocks": 5}


def test_affinity_gives_way_to_balance_past_balance_tokens():
    router = Router(["p0", "p1"], ["d0"], block_size=4, balance_tokens=20)
    system = list(range(100, 112))
    router.start_prefill("p0", system + [1])
    assert router.choose_prefill(system + [2]) == "p0"  # 13 tokens ahead: affinity still wins
    router.start_prefill("p0", system + [2])
    assert router.choose_prefill(system + [3]) == "p1"  # 26 ahead of p1: the idle worker takes it
    with pytest.raises(ValueError, match="balance_tokens"):
        Router(["p0"], ["d0"], block_size=4, balance_tokens=-1)


def test_replicas_are_chosen_by_the_same_policy_with_their_whole_requests_as_load():
    router = Router([], ["r0", "r1"], block_size=4, balance_tokens=40)
    system = list(range(100, 112))
    first = router.choose_replica(system + [1])
    router.start_run(first, system + [1], max_new_tokens=10)  # 23 tokens of work
    other = "r1" if first == "r0" else "r0"
    assert router.choose_replica(system + [2]) == first  # the replica that cached the system prompt
    assert router.choose_replica([7, 7, 7, 7, 7]) == other  # nothing shared: the least loaded
    router.start_run(first, system + [2], max_new_tokens=10)  # 46 ahead now
    assert router.choose_replica(system + [3]) == other
    router.end_run(first, system + [2], max_new_tokens=10)
    router.end_run(first, system + [1], max_new_tokens=10)
    assert router.run_tokens[first] == 0 and router.choose_replica(system + [3]) == first
    router.mark_dead(first)
    assert router.choose_replica(system + [3]) == other
