"""Engine metrics stay bounded in a long-running engine: histograms summarise a window."""

from __future__ import annotations

from hf_paged.engine.metrics import METRICS_WINDOW, EngineMetrics, RequestMetrics


def test_histograms_keep_a_bounded_window_and_counters_keep_totals():
    m = EngineMetrics()
    n = METRICS_WINDOW + 2500
    for i in range(n):
        r = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.2 + i, finished_time=1.0 + i)
        r.inter_token_latencies = [0.01, 0.02]
        m.on_finished(r, "length")
        m.iteration_tokens.append(i)
        m.on_verification(3, i % 4)
    assert len(m.ttft) == len(m.e2e) == len(m.queue_time) == len(m.iteration_tokens) == METRICS_WINDOW
    assert len(m.itl) == METRICS_WINDOW and len(m.spec_k_counts) == 1
    d = m.as_dict()
    assert d["vllm:request_success"] == n and d["vllm:time_to_first_token_seconds"]["count"] == METRICS_WINDOW
    assert d["vllm:time_to_first_token_seconds"]["p50"] > 2500  # the oldest observations left the window
    assert d["vllm:spec_decode_num_drafts"] == n and d["mean_num_speculative_tokens"] == 3
