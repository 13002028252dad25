"""A drop-in `generate` call's own logits processors, run inside the engine.

`generate(..., logits_processor=LogitsProcessorList([...]))` and `prefix_allowed_tokens_fn=` are how
transformers users constrain output: outlines, xgrammar's transformers integration,
lm-format-enforcer and transformers-cfg all hand `generate` such a processor. `StockProcessors` makes
the call's list the engine's batch processor (`SamplingParams.batch_processor`): the engine samples the
call's rows in lockstep (`engine/lockstep.py`) and hands it their logits each step, after the
processors it mirrors from the generation config and before the warpers, which is where stock's
`_get_logits_processor` puts a caller's list. The list then sees what it sees in stock's loop:

* `input_ids`: stock's `[batch * num_return_sequences, width + t]` tensor, on the caller's device: the
  left-padded prompts as the caller passed them (expanded per sample), then one column per step, in
  which a row that ended holds the pad id, as stock pads its finished rows;
* `scores`: fp32 `[batch * num_return_sequences, vocab]` on that device, each live row's logits
  processed by the built-in processors. A row that ended still has a row here, as in stock, but its
  values are zeros: stock computes them by feeding the row pads, which changes nothing any row
  samples, so the engine does not compute them.

A processor that keeps per-row state (xgrammar's, outlines') thus advances exactly as in stock.
`prefix_allowed_tokens_fn` becomes stock's own `PrefixConstrainedLogitsProcessor`, placed first in the
list, as stock places it.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

from ..config import PagedCacheConfig
from ..hf import PagedCache
from .stock_scores import stock_processors


class StockProcessors:
    """The call's processors as a `worker.sampler.BatchProcessor` over its rows (`i * n + j`: prompt i's
    sample j, stock's row order).

    Args:
        processors: what the call passed (`prefix_allowed_tokens_fn` already made a processor).
        input_ids: [batch * n, width] stock's prompt ids (left padding included), expanded per sample.
        pad: the pad id stock writes in a finished row's columns.
    """

    def __init__(self, processors: LogitsProcessorList, input_ids: torch.Tensor, pad: int):
        self.processors = processors
        self.ids = input_ids  # [batch * n, width + steps so far]: stock's input_ids
        self.width = input_ids.shape[1]
        self.pad = pad
        # Per row, the engine's token list (prompt + output) and its prompt length, as last seen live.
        self.seen: list[tuple[list[int], int] | None] = [None] * input_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.ids.shape[0]

    def __call__(self, rows: list[int], token_ids: list[list[int]], num_prompt_tokens: list[int],
                 scores: torch.Tensor) -> torch.Tensor:  # scores: [len(rows), vocab] fp32
        steps = {len(ids) - p for ids, p in zip(token_ids, num_prompt_tokens)}
        if len(steps) != 1:
            raise RuntimeError(f"hf_paged: the rows of one generate call reached different steps {sorted(steps)}")
        for row, ids, p in zip(rows, token_ids, num_prompt_tokens):
            self.seen[row] = (ids, p)
        step = steps.pop()
        while self.ids.shape[1] - self.width < step:  # the columns since the last call (one, but for the first)
            s = self.ids.shape[1] - self.width
            column = torch.tensor([self._token(r, s) for r in range(self.num_rows)], dtype=self.ids.dtype,
                                  device=self.ids.device)
            self.ids = torch.cat([self.ids, column[:, None]], dim=1)
        index = torch.tensor(rows, dtype=torch.long, device=self.ids.device)
        full = torch.zeros((self.num_rows, scores.shape[-1]), dtype=torch.float32, device=self.ids.device)
        full.index_copy_(0, index, scores.to(device=self.ids.device, dtype=torch.float32))
        out = self.processors(self.ids, full)
        return out.index_select(0, index)

    def _token(self, row: int, step: int) -> int:
        """Row `row`'s token at output step `step`: its own, or the pad id once it ended."""
        seen = self.seen[row]
        if seen is None:
            return self.pad
        ids, p = seen
        return ids[p + step] if len(ids) - p > step else self.pad


def call_processors(logits_processor, prefix_allowed_tokens_fn, gc) -> LogitsProcessorList | None:
    """The call's processors as one list, `prefix_allowed_tokens_fn` first (as stock orders them); None
    when it passed neither (or only empty lists)."""
    processors = LogitsProcessorList()
    if prefix_allowed_tokens_fn is not None:
        processors.append(PrefixConstrainedLogitsProcessor(prefix_allowed_tokens_fn,
                                                           max(gc.num_beams, gc.num_return_sequences)))
    processors.extend(logits_processor or [])
    return processors or None


def plan_processors(model, gc, kwargs: dict, params, attention_mask, width: int, assistant,
                    image_data) -> LogitsProcessorList | None | str:
    """The call's `logits_processor` / `prefix_allowed_tokens_fn` as one list for the engine (None: both
    empty), or why stock must serve the call with them."""
    given = kwargs.get("logits_processor")
    if given is not None and not isinstance(given, list):  # stock raises its own error
        return f"a logits_processor that is not a list ({type(given).__name__})"
    processors = call_processors(given, kwargs.get("prefix_allowed_tokens_fn"), gc)
    if processors is None:
        return None
    if assistant is not None or params.output_scores or params.output_logits or image_data is not None:
        # Stock runs them on every draft position (assisted), and on finished rows' pad-fed scores.
        why = ("an assistant_model" if assistant is not None else "images" if image_data is not None
               else "output_scores or output_logits")
        return f"logits processors with {why}"
    try:
        built_in = {type(p) for p in stock_processors(model, gc, attention_mask.long(), width, attention_mask.device)}
    except Exception as exc:  # noqa: BLE001 - whatever stops it here, stock serves the call
        return f"its processors ({exc})"
    same = sorted({type(p).__name__ for p in given or () if type(p) in built_in})
    if same:
        # Stock replaces its own processor of the same type by the caller's, in its place in the list.
        return f"a logits processor of the same type as one the generation config builds ({', '.join(same)})"
    return processors


def pool_holds_rows(model, engine_kwargs: dict, num_rows: int, max_len: int) -> bool:
    """Whether the engine that `engine_kwargs` build holds `num_rows` rows of `max_len` tokens at once:
    lockstep needs every row of the call running together, and a pool the caller capped may not hold
    them (preemption would split them)."""
    if engine_kwargs["max_kv_bytes"] is not None:
        return False
    cfg = getattr(model, "hf_paged_cache_config", None) or PagedCacheConfig()
    needed = num_rows * PagedCache(model.config, cfg).manager.max_blocks_for(max_len)
    return engine_kwargs["num_blocks"] is None or engine_kwargs["num_blocks"] >= needed
