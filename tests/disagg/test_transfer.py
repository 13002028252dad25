"""`disagg.transfer`'s posting: a peer that is gone when a send or receive is posted (gloo raises at once
when its connection is closed) gives a transfer that failed already, which the worker recomputes, rather
than an exception that takes the whole worker down."""

from __future__ import annotations

import torch

from hf_paged.disagg import transfer


class _GoneGroup:
    def send(self, tensors, peer, tag):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1")

    recv = send


class _Work:
    def wait(self):
        return True


class _LiveGroup:
    def send(self, tensors, peer, tag):
        return _Work()

    recv = send


def test_a_peer_gone_at_posting_gives_a_failed_transfer_not_an_exception():
    key = ("req", 0)
    sent = transfer.send(key, torch.zeros(4), 1, 7, _GoneGroup())
    got = transfer.receive(key, 4, torch.float32, "cpu", 1, 7, _GoneGroup())
    for t in (sent, got):
        assert transfer.state(t, timeout=10.0) == "failed"
        assert "Connection closed by peer" in str(t.error)
    pieces = transfer.Pieces(key, [(got, (0, 1)), (transfer.receive(key, 4, torch.float32, "cpu", 2, 8, _LiveGroup()),
                                                   (1, 2))])
    pieces.parts[1][0].finished.wait(5)
    assert transfer.state(pieces, timeout=10.0) == "failed"  # one failed piece fails the request's import


def test_a_live_peer_gives_a_transfer_that_finishes():
    t = transfer.receive(("req", 0), 4, torch.float32, "cpu", 1, 7, _LiveGroup())
    assert t.finished.wait(5) and transfer.state(t, timeout=10.0) == "done"
