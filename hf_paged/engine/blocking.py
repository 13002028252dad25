"""`BlockingAPI`: the engine's calls that run many requests to their end and return (`generate`) or
yield as they go (`stream`), driving steps themselves unless the background loop runs. A base of
`Engine`, which provides `add_owned_request`, `advance`, `abort`, `is_running` and the rest.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence as SequenceABC

from ..core import KVSequence
from ..sampling_params import SamplingParams
from .delivery import Inbox, drain
from .inputs import as_params_list, as_prompt_list
from .outputs import CompletionOutput, RequestOutput, StreamEvent

logger = logging.getLogger(__name__)


class BlockingAPI:
    """`generate` and `stream` over the engine's request API."""

    def generate(
        self,
        prompts: str | SequenceABC[int] | SequenceABC[str | SequenceABC[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        *,
        column: str | None = None,
        kv_prefixes: SequenceABC[KVSequence | None] | None = None,
        retain_kv: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one `RequestOutput` per prompt, in input order.

        A prompt that is rejected (empty, too long, out-of-vocabulary ids, bad sampling params) gets an
        output with `finish_reason="error"` and `.error` set, and so does a request whose steps keep
        failing; the others still run and return their outputs. With `column`, `prompts` is a table
        (a `datasets.Dataset`, or a list of dicts) and each row's `column` is its prompt.
        `kv_prefixes` (one per prompt) and `retain_kv`: see `add_owned_request`; collect what was kept
        with `kept_kv(request_id)`.

        Raises:
            EngineClosedError: the engine was shut down.
        """
        self._check_open()
        if column is not None:
            names = getattr(prompts, "column_names", None)
            if names is not None and column not in names:
                raise ValueError(f"the dataset has no column {column!r} (it has {names})")
            try:
                prompts = list(prompts[column]) if names is not None else [row[column] for row in prompts]
            except (KeyError, TypeError) as exc:
                raise ValueError(f"column={column!r} needs a table whose every row has that column ({exc!r})") from exc
        prompts = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(prompts))
        prefixes = _prefix_list(kv_prefixes, len(prompts))
        inbox = Inbox(wants_tokens=False)
        results: dict[int, RequestOutput] = {}
        live: dict[str, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                live[self.add_owned_request(prompt, p, None, inbox, i, kv_prefix=prefixes[i], retain_kv=retain_kv)] = i
            except (ValueError, TypeError) as exc:
                logger.warning("hf_paged: request %d rejected: %s", i, exc)
                prompt_ids = list(prompt) if not isinstance(prompt, str) else []
                n = p.n if isinstance(p, SamplingParams) and isinstance(p.n, int) and 0 < p.n <= 1024 else 1
                results[i] = RequestOutput(request_id=f"rejected-{i}", prompt_token_ids=prompt_ids,
                                           outputs=[CompletionOutput(j, finish_reason="error", error=exc)
                                                    for j in range(n)], finish_reason="error")
        bar = self._progress_bar(len(live), use_tqdm)
        try:
            for _, final in drain(inbox, len(live), self.advance, self.is_running):
                results[live[final.request_id]] = final
                if bar is not None:
                    bar.update(1)
        except BaseException:  # interrupted (KeyboardInterrupt...): stop what this call started
            for rid in live:
                self.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in range(len(prompts))]

    def stream(
        self,
        prompts: str | SequenceABC[int] | SequenceABC[str | SequenceABC[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        kv_prefixes: SequenceABC[KVSequence | None] | None = None,
        retain_kv: bool = False,
    ) -> Iterator[StreamEvent]:
        """Yield each token as it is produced, in order per request, for one prompt or many; each
        request's last event has its finish_reason. Another caller's `step()` (or the background
        loop) may produce them: they wait here until this iterator takes them.

        Invalid prompts raise before anything runs. Closing the iterator early aborts the requests
        it started (their blocks are freed). `kv_prefixes`, `retain_kv`: as for `generate`."""
        self._check_open()
        prompts = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(prompts))
        prefixes = _prefix_list(kv_prefixes, len(prompts))
        inbox = Inbox(wants_tokens=True)
        live: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                live.append(self.add_owned_request(prompt, p, None, inbox, i, streamed=True, kv_prefix=prefixes[i],
                                                   retain_kv=retain_kv))
            for event, _ in drain(inbox, len(live), self.advance, self.is_running):
                yield event
        finally:
            for rid in live:
                if self.core.is_live(rid):
                    self.abort(rid)

    def _progress_bar(self, total: int, use_tqdm: bool | None):
        show = use_tqdm if use_tqdm is not None else self.show_progress
        if show is None:
            show = sys.stderr.isatty() and total > 1
        if not show:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="hf_paged", unit="req")


def _prefix_list(kv_prefixes, num_prompts: int) -> list:
    if kv_prefixes is None:
        return [None] * num_prompts
    kv_prefixes = list(kv_prefixes)
    if len(kv_prefixes) != num_prompts:
        raise ValueError(f"kv_prefixes has {len(kv_prefixes)} entries for {num_prompts} prompts")
    return kv_prefixes
