"""Control messages between the router and the workers, over a `torch.distributed.TCPStore`.

The store is the rendezvous every torch.distributed job already has (torchrun's, or the one
`DisaggregatedEngine` hosts), so control needs no socket protocol of its own. Each recipient has a
counter and numbered keys: a sender claims the next number with `add` and writes the pickled
message under it; the recipient reads its keys in number order and deletes them. Messages from one
sender to one recipient therefore arrive in the order they were sent (the K/V transfers rely on it
under NCCL, whose point-to-point messages match by order, not tag). Liveness is a per-worker beat
counter the router watches with its own clock (no clock is compared across machines).

The processes of one job trust each other (pickle); the store listens where torch.distributed's
does.
"""

from __future__ import annotations

import pickle
from collections import Counter

PREFIX = "hf_paged/disagg"


class Mailbox:
    """One participant's end: `send` to any name, `poll` its own messages without waiting.

    Args:
        store: a `torch.distributed.Store` every participant reaches (a `TCPStore`, or a `HashStore`
            within one process for tests).
        name: this participant's name ("router", "prefill0", "decode1", ...).
    """

    def __init__(self, store, name: str):
        self.store = store
        self.name = name
        self._next = 1  # the number of the next message to read
        self.num_sent: Counter = Counter()  # message op -> how many this end sent

    def send(self, to: str, message: dict) -> None:
        number = self.store.add(f"{PREFIX}/mail/{to}/n", 1)
        self.store.set(f"{PREFIX}/mail/{to}/{number}", pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        self.num_sent[message.get("op")] += 1

    def poll(self, limit: int = 256) -> list[dict]:
        """The messages that arrived, in order (at most `limit`); never waits. A message whose number is
        claimed but not yet written is read at the next poll."""
        total = self.store.add(f"{PREFIX}/mail/{self.name}/n", 0)
        out = []
        while self._next <= total and len(out) < limit:
            key = f"{PREFIX}/mail/{self.name}/{self._next}"
            if not self.store.check([key]):
                break
            out.append(pickle.loads(self.store.get(key)))
            self.store.delete_key(key)
            self._next += 1
        return out

    # ------------------------------------------------------------------ liveness
    def beat(self, status: dict) -> None:
        """Say this participant is alive, with its status (free KV blocks, running requests...)."""
        self.store.set(f"{PREFIX}/status/{self.name}", pickle.dumps(status, protocol=pickle.HIGHEST_PROTOCOL))
        self.store.add(f"{PREFIX}/beat/{self.name}", 1)

    def beats_of(self, name: str) -> int:
        return self.store.add(f"{PREFIX}/beat/{name}", 0)

    def status_of(self, name: str) -> dict | None:
        key = f"{PREFIX}/status/{name}"
        return pickle.loads(self.store.get(key)) if self.store.check([key]) else None
