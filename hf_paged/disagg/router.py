"""Where each request of a disaggregated or data-parallel engine goes. Torch-free bookkeeping.

* **Prefill worker, or replica** (a data-parallel engine's workers run whole requests): by
  prefix-cache affinity, then load, one policy (`_by_affinity`). The router remembers which worker
  last computed each leading full block of a prompt, keyed by `core`'s block hash chain
  (`hash_block_tokens`, the function the workers' prefix caches key their blocks with, over the
  same blocks of `block_size` tokens); a new prompt goes to the worker holding the longest run of
  its leading blocks, ties to the least loaded. Affinity gives way to balance: a worker more than
  `balance_tokens` tokens of work ahead of the least loaded one is passed over, so that a hot
  shared prefix cannot pin every request to one worker (SGLang's cache-aware router does the same).
  Load is tokens outstanding: prompt tokens for a prefill worker, prompt plus the completion's cap
  for a replica.
* **Decode worker:** by free KV blocks: the last free-block count each worker reported, less the
  blocks the router has sent it since (pledged, released when the request ends there), most room
  first.

Workers that died or stopped answering are dropped from both choices (`mark_dead`).
"""

from __future__ import annotations

from collections import OrderedDict

from ..core import hash_block_tokens


class Router:
    """Args:
        prefill: the prefill workers' names.
        decode: the decode workers' names.
        block_size: tokens per KV block (the workers' engines use the same).
        max_affinity_entries: leading-block hashes remembered (oldest forgotten first).
        extra_key: the salt the chain is hashed with (`hash_block_tokens`' `extra_key`); affinity
            only compares the router's own hashes, so any fixed value works.
        balance_tokens: how many tokens of outstanding work a worker may be ahead of the least loaded
            one and still win a request by affinity.
    """

    def __init__(self, prefill: list[str], decode: list[str], block_size: int, max_affinity_entries: int = 65536,
                 extra_key: object = None, balance_tokens: int = 2048):
        if not prefill and not decode:
            raise ValueError("a disaggregated engine needs at least one worker")
        if balance_tokens < 0:
            raise ValueError(f"balance_tokens must be >= 0, got {balance_tokens}")
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.block_size = block_size
        self.balance_tokens = balance_tokens
        self.dead: set[str] = set()
        self.prefill_tokens = {name: 0 for name in prefill}  # prompt tokens sent and not yet prefilled
        self.run_tokens = {name: 0 for name in decode}  # replicas: prompt + completion cap of requests running whole
        self.pledged = {name: 0 for name in decode}  # blocks sent to the worker and not yet ended there
        self.reported_free: dict[str, int | None] = {name: None for name in decode}
        self._affinity: OrderedDict[int, str] = OrderedDict()  # leading-block chain hash -> prefill worker
        self._max_affinity = max_affinity_entries
        self.extra_key = extra_key

    # ------------------------------------------------------------------ prefill
    def block_chain(self, prompt: list[int]) -> list[int]:
        """One hash per leading full block of `prompt`, each covering every token before it (the
        prefix cache's chain: the first block's parent is None)."""
        bs, chain, h = self.block_size, [], None
        for start in range(0, len(prompt) - bs + 1, bs):
            h = hash_block_tokens(h, prompt[start:start + bs], self.extra_key)
            chain.append(h)
        return chain

    def _by_affinity(self, workers: list[str], prompt: list[int], load: dict[str, int]) -> str | None:
        """The worker of `workers` (alive ones) holding the longest run of `prompt`'s leading blocks
        among those at most `balance_tokens` ahead of the least loaded, ties to the least loaded."""
        alive = [name for name in workers if name not in self.dead]
        if not alive:
            return None
        matched = dict.fromkeys(alive, 0)
        for depth, h in enumerate(self.block_chain(prompt), start=1):
            owner = self._affinity.get(h)
            if owner not in matched or matched[owner] != depth - 1:
                break  # the chain continues only on the worker that holds every block before
            matched[owner] = depth
        least = min(load[name] for name in alive)
        balanced = [name for name in alive if load[name] - least <= self.balance_tokens]
        return max(balanced, key=lambda name: (matched[name], -load[name], -alive.index(name)))

    def _remember(self, name: str, prompt: list[int]) -> None:
        for h in self.block_chain(prompt):
            self._affinity[h] = name
            self._affinity.move_to_end(h)
        while len(self._affinity) > self._max_affinity:
            self._affinity.popitem(last=False)

    def choose_prefill(self, prompt: list[int]) -> str | None:
        """The prefill worker for `prompt`, or None when every prefill worker is dead."""
        return self._by_affinity(self.prefill, prompt, self.prefill_tokens)

    def start_prefill(self, name: str, prompt: list[int]) -> None:
        self.prefill_tokens[name] += len(prompt)
        self._remember(name, prompt)

    def end_prefill(self, name: str, prompt: list[int]) -> None:
        if name in self.prefill_tokens:
            self.prefill_tokens[name] = max(0, self.prefill_tokens[name] - len(prompt))

    # ------------------------------------------------------------------ replicas (whole requests)
    def choose_replica(self, prompt: list[int]) -> str | None:
        """The worker to run `prompt` whole (data parallelism: every worker is a replica), by the
        prefill policy: affinity, then load. None when every worker is dead."""
        return self._by_affinity(self.decode, prompt, self.run_tokens)

    def start_run(self, name: str, prompt: list[int], max_new_tokens: int) -> None:
        self.run_tokens[name] += len(prompt) + max_new_tokens
        self._remember(name, prompt)

    def end_run(self, name: str, prompt: list[int], max_new_tokens: int) -> None:
        if name in self.run_tokens:
            self.run_tokens[name] = max(0, self.run_tokens[name] - len(prompt) - max_new_tokens)

    # ------------------------------------------------------------------ decode
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def choose_decode(self) -> str | None:
        """The decode worker with the most free blocks (reported, less pledged), or None if all are dead."""
        alive = [name for name in self.decode if name not in self.dead]
        if not alive:
            return None

        def room(name: str) -> float:
            free = self.reported_free[name]
            return (float("inf") if free is None else free) - self.pledged[name]

        return max(alive, key=lambda name: (room(name), -self.pledged[name], -alive.index(name)))

    def pledge(self, name: str, num_blocks: int) -> None:
        self.pledged[name] += num_blocks

    def unpledge(self, name: str, num_blocks: int) -> None:
        if name in self.pledged:
            self.pledged[name] = max(0, self.pledged[name] - num_blocks)

    def report(self, name: str, free_blocks: int | None) -> None:
        if name in self.reported_free:
            self.reported_free[name] = free_blocks

    # ------------------------------------------------------------------ failures
    def mark_dead(self, name: str) -> None:
        self.dead.add(name)
        for h in [h for h, owner in self._affinity.items() if owner == name]:
            del self._affinity[h]

    def alive(self) -> list[str]:
        return [name for name in self.prefill + self.decode if name not in self.dead]
