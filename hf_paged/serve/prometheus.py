"""`/metrics`: the engine's counters in Prometheus' text format, under vLLM's names."""

from __future__ import annotations


class EngineCollector:
    """Prometheus metrics read from the engine at each scrape, under vLLM's names."""

    def __init__(self, server):
        """`server`: the `api_server.Server` (its engine, model name and requests in flight)."""
        self.server = server

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        m = self.server.engine.metrics()
        labels = {"model_name": self.server.model_name}

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            g.add_metric(list(labels.values()), float(value or 0))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=list(labels))
            c.add_metric(list(labels.values()), float(value or 0))
            return c

        yield gauge("vllm:num_requests_running", "Requests running on the engine.", m["vllm:num_requests_running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting for the engine.", m["vllm:num_requests_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", m["vllm:kv_cache_usage_perc"])
        yield counter("vllm:prompt_tokens", "Prompt tokens computed.", m["vllm:prompt_tokens"])
        yield counter("vllm:generation_tokens", "Tokens generated.", m["vllm:generation_tokens"])
        yield counter("vllm:num_preemptions", "Preemptions.", m["vllm:num_preemptions"])
        yield counter("hf_paged:num_rope_recomputes", "Sequences recomputed with longrope's long factors at its "
                      "threshold (as stock drops its cache).", m["num_rope_recomputes"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up.", m["vllm:prefix_cache_queries"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache.", m["vllm:prefix_cache_hits"])
        yield counter("vllm:request_success", "Requests finished.", m["vllm:request_success"])
        for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                     "vllm:e2e_request_latency_seconds"):
            s = m[name]
            family = SummaryMetricFamily(name, name.split(":")[1].replace("_", " "), labels=list(labels))
            family.add_metric(list(labels.values()), count_value=s["count"], sum_value=s["sum"])
            yield family
        yield gauge("hf_paged:requests_in_flight", "HTTP requests being served.", self.server.in_flight)
