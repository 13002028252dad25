"""Request and engine metrics, named as vLLM names them (`vllm:...`) so dashboards translate.

Times are `time.perf_counter()` seconds. Histograms are summarised (count, sum, mean, p50, p90,
p99) rather than bucketed, over the last `METRICS_WINDOW` observations, so a long-running engine's
memory stays bounded; counters are totals.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from ..spec_decode.verify import expected_tokens_per_forward


METRICS_WINDOW = 10_000  # latest observations each latency histogram summarises


def kv_cache_usage(num_blocks: int, num_free_blocks: int) -> float:
    """`vllm:kv_cache_usage_perc`, in [0, 1]: the share of `num_blocks` in use. `num_free_blocks` counts
    once each block a new request could take, free or only prefix-cached (`BlockPool.num_free_blocks`,
    what a worker reports as its `free_blocks`); one engine's pool, or several summed."""
    return (num_blocks - num_free_blocks) / num_blocks if num_blocks > 0 else 0.0


def _window() -> deque:
    return deque(maxlen=METRICS_WINDOW)


def _summary(values) -> dict:
    if not values:
        return {"count": 0, "sum": 0.0, "mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"count": len(values), "sum": sum(values), "mean": statistics.fmean(values), "p50": pct(0.5),
            "p90": pct(0.9), "p99": pct(0.99)}


@dataclass
class RequestMetrics:
    """Timeline and counts of one request.

    Attributes:
        arrival_time: when it was added.
        first_scheduled_time: when its first chunk was scheduled (end of queueing).
        first_token_time, last_token_time: when its first / latest token was sampled.
        finished_time: when it finished (any reason).
        num_prompt_tokens, num_generation_tokens: prompt length, tokens generated.
        num_cached_tokens: prompt tokens served by the prefix cache at its (last) admission.
        num_preemptions: times it was preempted and recomputed.
        inter_token_latencies: seconds between consecutive tokens.
    """

    arrival_time: float
    num_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def mean_inter_token_latency(self) -> float | None:
        return statistics.fmean(self.inter_token_latencies) if self.inter_token_latencies else None

    def on_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now
        self.num_generation_tokens += 1

    def as_dict(self) -> dict:
        return {
            "time_to_first_token_seconds": self.time_to_first_token,
            "inter_token_latency_seconds": self.mean_inter_token_latency,
            "request_queue_time_seconds": self.queue_time,
            "e2e_request_latency_seconds": self.e2e_latency,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_preemptions": self.num_preemptions,
        }


class EngineMetrics:
    """Counters, gauges and latency histograms of one engine, since creation or `reset()`."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.start_time = time.perf_counter()
        self.prompt_tokens = 0  # tokens actually computed for prompts (prefix-cache hits excluded)
        self.generation_tokens = 0
        self.num_preemptions = 0
        # Sequences recomputed with longrope's long factors on passing the threshold (Phi-3: as stock drops its cache)
        self.num_rope_recomputes = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which served from it
        # Images: queried in the encoder's cache, encoded (cache misses), and their placeholder tokens
        # among the prefix-cache hits (blocks hashed with the images' digests).
        self.mm_cache_queries = 0
        self.mm_encoder_runs = 0
        self.mm_prefix_cache_hits = 0
        self.request_success = 0
        self.request_aborted = 0
        self.request_errored = 0
        self.num_steps = 0
        self.num_failed_steps = 0  # steps (or single requests in them) that raised and were undone
        self.num_forward_tokens = 0  # tokens fed to the model's forwards (prefill chunks, decodes, drafts)
        # Step profile: wall seconds inside `step()`; of it, scheduling (drafts included), the forwards
        # (of which building inputs and metadata, and the model call), and the sampler calls.
        self.step_seconds = 0.0
        self.schedule_seconds = 0.0
        self.forward_seconds = 0.0
        self.metadata_seconds = 0.0
        self.model_seconds = 0.0
        self.sampler_seconds = 0.0
        self.iteration_tokens: deque[int] = _window()
        self.ttft: deque[float] = _window()
        self.itl: deque[float] = _window()
        self.queue_time: deque[float] = _window()
        self.e2e: deque[float] = _window()
        self.finish_reasons: dict[str, int] = {}
        self.num_requests_running = 0
        self.num_requests_waiting = 0
        self.kv_cache_usage_perc = 0.0
        self.peak_kv_blocks = 0  # most blocks in use right after any step's scheduling
        self.peak_num_running = 0  # most requests running at once, right after any step's scheduling
        # Speculative decoding (one "draft" = one request's k drafts verified in one target forward).
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = []
        self.spec_drafted_per_pos: list[int] = []
        self.spec_num_rejections = 0  # verifications that stopped at a rejected draft
        self.spec_k_counts: Counter[int] = Counter()  # verifications per number of drafts k

    def on_verification(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        self.spec_k_counts[num_drafts] += 1
        if num_accepted < num_drafts:
            self.spec_num_rejections += 1
        while len(self.spec_accepted_per_pos) < num_drafts:
            self.spec_accepted_per_pos.append(0)
            self.spec_drafted_per_pos.append(0)
        for pos in range(num_drafts):
            self.spec_drafted_per_pos[pos] += 1
            if pos < num_accepted:
                self.spec_accepted_per_pos[pos] += 1

    def spec_summary(self) -> dict:
        """Speculative decoding figures. `acceptance_rate` is vLLM's accepted / drafted tokens;
        `alpha` is the per-token acceptance probability (accepted / drafts actually judged: a
        verification stops at its first rejection), the alpha of the closed form
        E[tokens per target forward] = (1 - alpha^(k+1)) / (1 - alpha), averaged over the k used."""
        n = self.spec_num_drafts
        judged = self.spec_num_accepted_tokens + self.spec_num_rejections
        alpha = self.spec_num_accepted_tokens / judged if judged else None
        measured = (self.spec_num_accepted_tokens + n) / n if n else None
        predicted = (sum(c * expected_tokens_per_forward(alpha, k) for k, c in self.spec_k_counts.items()) / n
                     if n and alpha is not None else None)
        return {
            "vllm:spec_decode_num_drafts": n,
            "vllm:spec_decode_num_draft_tokens": self.spec_num_draft_tokens,
            "vllm:spec_decode_num_accepted_tokens": self.spec_num_accepted_tokens,
            "vllm:spec_decode_num_accepted_tokens_per_pos": list(self.spec_accepted_per_pos),
            "acceptance_rate": (self.spec_num_accepted_tokens / self.spec_num_draft_tokens
                                if self.spec_num_draft_tokens else None),
            "acceptance_rate_per_pos": [a / d if d else None for a, d in
                                        zip(self.spec_accepted_per_pos, self.spec_drafted_per_pos)],
            "alpha": alpha,
            "mean_acceptance_length": measured,  # vLLM's: 1 + accepted / drafts
            "tokens_per_target_forward": measured,
            "predicted_tokens_per_target_forward": predicted,
            "mean_num_speculative_tokens": sum(k * c for k, c in self.spec_k_counts.items()) / n if n else None,
        }

    def on_finished(self, metrics: RequestMetrics, reason: str) -> None:
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        if reason == "abort":
            self.request_aborted += 1
            return
        if reason == "error":
            self.request_errored += 1
            return
        self.request_success += 1
        for values, value in ((self.ttft, metrics.time_to_first_token), (self.queue_time, metrics.queue_time),
                              (self.e2e, metrics.e2e_latency)):
            if value is not None:
                values.append(value)
        self.itl.extend(metrics.inter_token_latencies)

    def as_dict(self) -> dict:
        """Everything, keyed by vLLM's metric names (plus throughput over the elapsed time)."""
        elapsed = max(time.perf_counter() - self.start_time, 1e-9)
        hit_rate = self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        return {
            "vllm:num_requests_running": self.num_requests_running,
            "vllm:num_requests_waiting": self.num_requests_waiting,
            "vllm:kv_cache_usage_perc": self.kv_cache_usage_perc,
            "vllm:num_preemptions": self.num_preemptions,
            "vllm:prefix_cache_queries": self.prefix_cache_queries,
            "vllm:prefix_cache_hits": self.prefix_cache_hits,
            "vllm:prompt_tokens": self.prompt_tokens,
            "vllm:generation_tokens": self.generation_tokens,
            "vllm:request_success": self.request_success,
            "vllm:iteration_tokens_total": _summary([float(n) for n in self.iteration_tokens]),
            "vllm:time_to_first_token_seconds": _summary(self.ttft),
            "vllm:inter_token_latency_seconds": _summary(self.itl),
            "vllm:request_queue_time_seconds": _summary(self.queue_time),
            "vllm:e2e_request_latency_seconds": _summary(self.e2e),
            "num_requests_aborted": self.request_aborted,
            "num_requests_errored": self.request_errored,
            "num_failed_steps": self.num_failed_steps,
            "num_rope_recomputes": self.num_rope_recomputes,
            "finish_reasons": dict(self.finish_reasons),
            "num_steps": self.num_steps,
            "num_forward_tokens": self.num_forward_tokens,
            "peak_num_running": self.peak_num_running,
            "step_seconds": self.step_seconds,
            "schedule_seconds": self.schedule_seconds,
            "forward_seconds": self.forward_seconds,
            "metadata_seconds": self.metadata_seconds,
            "model_seconds": self.model_seconds,
            "sampler_seconds": self.sampler_seconds,
            "elapsed_seconds": elapsed,
            "prompt_throughput_tokens_per_s": self.prompt_tokens / elapsed,
            "generation_throughput_tokens_per_s": self.generation_tokens / elapsed,
            "prefix_cache_hit_rate": hit_rate,
            **({"vllm:mm_cache_queries": self.mm_cache_queries,
                "vllm:mm_cache_hits": self.mm_cache_queries - self.mm_encoder_runs,
                "mm_encoder_runs": self.mm_encoder_runs,
                "mm_prefix_cache_hits": self.mm_prefix_cache_hits} if self.mm_cache_queries else {}),
            **(self.spec_summary() if self.spec_num_drafts else {}),
        }

    def summary(self) -> str:
        """One line in the spirit of vLLM's periodic log line."""
        d = self.as_dict()
        ttft = d["vllm:time_to_first_token_seconds"]["p50"]
        itl = d["vllm:inter_token_latency_seconds"]["p50"]
        fmt = lambda x, scale=1.0: "n/a" if x is None else f"{x * scale:.1f}"  # noqa: E731
        return (
            f"prompt throughput: {d['prompt_throughput_tokens_per_s']:.1f} tok/s, "
            f"generation throughput: {d['generation_throughput_tokens_per_s']:.1f} tok/s, "
            f"running: {d['vllm:num_requests_running']} reqs, waiting: {d['vllm:num_requests_waiting']} reqs, "
            f"KV cache usage: {100 * d['vllm:kv_cache_usage_perc']:.1f}%, "
            f"prefix cache hit rate: {100 * d['prefix_cache_hit_rate']:.1f}%, "
            f"preemptions: {d['vllm:num_preemptions']}, "
            f"TTFT p50: {fmt(ttft, 1e3)} ms, ITL p50: {fmt(itl, 1e3)} ms"
        )
