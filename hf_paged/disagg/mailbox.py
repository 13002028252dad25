"""Control messages between the router and the workers, over a `torch.distributed.TCPStore`.

The store is the rendezvous every torch.distributed job already has (torchrun's, or the one
`DisaggregatedEngine` hosts), so control needs no socket protocol of its own.

Every sender writes to each recipient a stream of its own: message k of sender s to recipient r is
one key, `mail/r/s/k`, written with one `set`, k counted by the sender. A sender announces its
stream once (one atomic `append` to the recipient's list of streams) before its first message, and
rings the recipient's bell (one `add`) after each. Each step is a single store operation, so a
sender killed at any point leaves no half-written state that could hold back anyone else's mail: a
stream announced but empty is just empty, and a message written before the bell is rung is found by
the recipient's periodic full scan. Messages from one sender to one recipient arrive in the order
they were sent (the K/V transfers rely on it under NCCL, whose point-to-point messages match by
order, not tag); messages from different senders have no order between them.

A recipient's `poll` costs one store round trip when its bell has not moved (a full scan at most
every `rescan_interval` seconds otherwise). Liveness is a per-worker beat counter the router
watches with its own clock (no clock is compared across machines).

The processes of one job trust each other (pickle); the store listens where torch.distributed's
does.
"""

from __future__ import annotations

import pickle
import time
from collections import Counter

PREFIX = "hf_paged/disagg"


class Mailbox:
    """One participant's end: `send` to any name, `poll` its own messages without waiting.

    Args:
        store: a `torch.distributed.Store` every participant reaches (a `TCPStore`, or a `HashStore`
            within one process for tests).
        name: this participant's name ("router", "prefill0", "decode1", ...).
        rescan_interval: seconds between full scans of this participant's streams when its bell
            has not rung (a sender that died between writing a message and ringing).
    """

    def __init__(self, store, name: str, rescan_interval: float = 0.1):
        self.store = store
        self.name = name
        self.rescan_interval = rescan_interval
        # This incarnation's stream name: a participant that comes back under the same name writes a
        # new stream rather than numbers its recipients have already read.
        self.stream = f"{name}.{store.add(f'{PREFIX}/incarnation/{name}', 1)}"
        self._sent_to: dict[str, int] = {}  # recipient -> messages sent to it
        self._streams: list[str] = []  # the streams writing to this participant, in announcement order
        self._next: dict[str, int] = {}  # stream -> the number of its next message to read
        self._bell = 0
        self._last_scan = float("-inf")
        self.num_sent: Counter = Counter()  # message op -> how many this end sent

    def send(self, to: str, message: dict) -> None:
        number = self._sent_to.get(to, 0) + 1
        if number == 1:
            self.store.append(f"{PREFIX}/mail/{to}/streams", f"{self.stream}\n")
        self.store.set(f"{PREFIX}/mail/{to}/{self.stream}/{number}",
                       pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        self._sent_to[to] = number
        self.store.add(f"{PREFIX}/mail/{to}/bell", 1)
        self.num_sent[message.get("op")] += 1

    def poll(self, limit: int = 256) -> list[dict]:
        """The messages that arrived (at most `limit`), each sender's in its order; never waits."""
        bell = self.store.add(f"{PREFIX}/mail/{self.name}/bell", 0)
        now = time.monotonic()
        if bell == self._bell and now - self._last_scan < self.rescan_interval:
            return []
        self._bell, self._last_scan = bell, now
        self._refresh_streams()
        out: list[dict] = []
        for stream in self._streams:
            while len(out) < limit:
                key = f"{PREFIX}/mail/{self.name}/{stream}/{self._next[stream]}"
                if not self.store.check([key]):
                    break
                out.append(pickle.loads(self.store.get(key)))
                self.store.delete_key(key)
                self._next[stream] += 1
        if len(out) >= limit:
            self._last_scan = float("-inf")  # more may be waiting: scan again at the next poll
        return out

    def _refresh_streams(self) -> None:
        key = f"{PREFIX}/mail/{self.name}/streams"
        if not self.store.check([key]):
            return
        names = self.store.get(key).decode().split("\n")[:-1]  # a partial last line cannot happen: append is atomic
        for stream in names[len(self._streams):]:
            self._streams.append(stream)
            self._next[stream] = 1

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
