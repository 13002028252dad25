"""Rows that repeat a prompt run as one engine request with n samples, so they share its blocks.

RL trainers (TRL's `GRPOTrainer`, its RLOO and online-DPO cousins) put each prompt in the batch
`num_generations` times, one row per sampled completion. Stock generate computes every copy's
prefill and holds every copy's K/V. Here the rows whose token ids and sampling are equal become one
request whose `n` is the sum of theirs: the engine computes the prompt once and forks its blocks
copy-on-write for each sample (`Engine` n-sample requests), so only the completions take new blocks.

Rows with an explicit `SamplingParams.seed` are never merged: two requests with one seed draw the
same tokens, while the samples of one request draw different ones.
"""

from __future__ import annotations

import dataclasses

from ..engine import Engine
from ..engine.outputs import CompletionOutput
from ..sampling_params import SamplingParams


def share_groups(rows: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """The row indices of each request: rows with equal token ids and equal unseeded params together,
    in order of their first row. Torch-free bookkeeping."""
    groups: dict[tuple, list[int]] = {}
    distinct: list[SamplingParams] = []  # SamplingParams holds lists, so it is compared, not hashed
    for i, (row, p) in enumerate(zip(rows, params)):
        if p.seed is not None:
            groups[("seeded", i)] = [i]
            continue
        for j, q in enumerate(distinct):
            if q is p or q == p:
                break
        else:
            j = len(distinct)
            distinct.append(p)
        groups.setdefault((tuple(row), j), []).append(i)
    return list(groups.values())


def generate_rows(engine: Engine, rows: list[list[int]], params: SamplingParams | list[SamplingParams],
                  use_tqdm: bool | None = False) -> list[list[CompletionOutput]]:
    """Each row's `params.n` samples, in row order, generated with repeated prompts shared.

    A sample that failed carries `error` (its whole request failed: every row of the group has it);
    the other rows' samples are unaffected."""
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(rows)
    groups = share_groups(rows, params)
    merged = [_with_n(params[g[0]], params[g[0]].n * len(g)) for g in groups]
    outputs = engine.generate([rows[g[0]] for g in groups], merged, use_tqdm=use_tqdm)
    samples: list[list[CompletionOutput] | None] = [None] * len(rows)
    for group, out in zip(groups, outputs):
        n = params[group[0]].n
        for k, i in enumerate(group):
            mine = out.outputs[k * n: (k + 1) * n]
            if len(mine) < n:  # a request that ended before it forked: its error is every sample's
                mine += [CompletionOutput(j, finish_reason="error", error=out.error or RuntimeError(
                    f"request {out.request_id!r} returned {len(out.outputs)} of {n * len(group)} samples"))
                    for j in range(len(mine), n)]
            samples[i] = mine
    return samples


def _with_n(params: SamplingParams, n: int) -> SamplingParams:
    return params if n == params.n else dataclasses.replace(params, n=n)
