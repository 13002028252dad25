"""Lockstep sampling for the requests of one batch processor (`SamplingParams.batch_processor`).

A caller's logits processors (a drop-in `generate` call's `logits_processor` list: outlines',
xgrammar's, or the caller's own) are written for stock's loop, where every row of the batch samples
its t-th token in the same call. Many keep per-row state and advance it on each call from the last
column of `input_ids`. The engine schedules requests independently: a prompt that finishes its prefill
a step early, or a row that was preempted, would reach step t alone.

So a batch's rows sample together or not at all. In a step where some live row of a batch does not
sample (its prefill is still running, it waits to be scheduled), the rows that would sample are
deferred: their last position is forgotten (`Scheduler.rollback` of one token) and recomputed in a later
step, and nothing is drawn for them. Rows that ended are no longer live; the processor sees them as
its batch's padded rows. A batch that cannot come together within `MAX_LOCKSTEP_WAITS` consecutive
steps ends with an error rather than waiting forever.
"""

from __future__ import annotations

MAX_LOCKSTEP_WAITS = 1000  # consecutive deferred steps after which a batch's requests end with an error


class LockstepError(RuntimeError):
    """A batch processor's rows could not be brought to sample in the same step."""


class Lockstep:
    """Which of a step's sampling requests wait for the rest of their batch (torch-free bookkeeping)."""

    def __init__(self):
        self._waits: dict[int, int] = {}  # id(batch processor) -> consecutive deferred steps

    def deferred(self, sampling: dict[str, object | None], live: dict[str, object | None]
                 ) -> tuple[set[str], dict[str, LockstepError]]:
        """`sampling`: request id -> batch processor (or None) of the step's sampling requests; `live`:
        the same for every live request. Returns the ids to defer this step, and the requests to end:
        those of a batch that waited `MAX_LOCKSTEP_WAITS` steps in a row, with the error to end them."""
        present: dict[int, set[str]] = {}  # id(batch processor) -> its requests sampling in this step
        for rid, processor in sampling.items():
            if processor is not None:
                present.setdefault(id(processor), set()).add(rid)
        members: dict[int, set[str]] = {}  # id(batch processor) -> its live requests
        for rid, processor in live.items():
            if processor is not None and id(processor) in present:
                members.setdefault(id(processor), set()).add(rid)
        deferred, ended, waits = set(), {}, {}
        for key, ids in present.items():
            if ids == members.get(key, set()):
                continue  # the whole batch samples: its wait is over
            waits[key] = self._waits.get(key, 0) + 1
            if waits[key] > MAX_LOCKSTEP_WAITS:
                del waits[key]
                error = LockstepError(f"the rows of a batch processor could not sample in the same step for "
                                      f"{MAX_LOCKSTEP_WAITS} steps (a row could not be scheduled with the others)")
                ended.update(dict.fromkeys(members[key], error))
            deferred |= ids
        self._waits = waits  # a batch that did not wait in this step (or ended) starts afresh
        return deferred, ended
