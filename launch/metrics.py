"""Prometheus metrics for the server, in a registry of its own so two servers never collide."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
                    120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.5, 1.0, 2.5)


class EngineCollector:
    """Reads each replica's scheduler state at scrape time."""

    def __init__(self, model: str, stats: Callable[[], list[dict]]):
        self.model, self.stats = model, stats

    def collect(self):
        running = GaugeMetricFamily("shardserve_num_requests_running",
                                    "Requests in the running batch.", labels=["model", "replica"])
        waiting = GaugeMetricFamily("shardserve_num_requests_waiting",
                                    "Requests waiting to be scheduled.",
                                    labels=["model", "replica"])
        kv = GaugeMetricFamily("shardserve_kv_cache_usage_ratio",
                               "Fraction of KV cache blocks in use.", labels=["model", "replica"])
        preempt = CounterMetricFamily("shardserve_num_preemptions",
                                      "Requests preempted for lack of KV blocks.",
                                      labels=["model", "replica"])
        hits = CounterMetricFamily("shardserve_prefix_cache_hit_tokens",
                                   "Prompt tokens served from the prefix cache.", labels=["model", "replica"])
        queries = CounterMetricFamily("shardserve_prefix_cache_query_tokens",
                                      "Prompt tokens looked up in the prefix cache.", labels=["model", "replica"])
        for replica, s in enumerate(self.stats()):
            labels = [self.model, str(replica)]
            running.add_metric(labels, s["num_running"])
            waiting.add_metric(labels, s["num_waiting"])
            kv.add_metric(labels, s["kv_cache_usage"])
            preempt.add_metric(labels, s["num_preemptions"])
            hits.add_metric(labels, s["num_prefix_hit_tokens"])
            queries.add_metric(labels, s["num_prefix_query_tokens"])
        yield from (running, waiting, kv, preempt, hits, queries)


class ServerMetrics:
    def __init__(self, model: str, stats: Callable[[], list[dict]]):
        self.registry = CollectorRegistry()
        self.model = model
        labels = ["model", "replica"]
        self.requests = Counter("shardserve_requests", "Finished requests by outcome.",
                                ["model", "outcome"], registry=self.registry)
        self.prompt_tokens = Counter("shardserve_prompt_tokens", "Prompt tokens processed.",
                                     labels, registry=self.registry)
        self.generation_tokens = Counter("shardserve_generation_tokens", "Tokens generated.",
                                         labels, registry=self.registry)
        self.ttft = Histogram("shardserve_time_to_first_token_seconds",
                              "Time to first token.", labels, buckets=_LATENCY_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("shardserve_inter_token_latency_seconds",
                             "Time between output tokens.", labels, buckets=_LATENCY_BUCKETS,
                             registry=self.registry)
        self.tpot = Histogram("shardserve_time_per_output_token_seconds",
                              "Per request: (e2e - TTFT) / (output tokens - 1), with 2 tokens or more "
                              "(per sample when n > 1).", labels, buckets=_TPOT_BUCKETS,
                              registry=self.registry)
        self.e2e = Histogram("shardserve_e2e_request_latency_seconds",
                             "Request latency, arrival to last token.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("shardserve_request_queue_time_seconds",
                                    "Time a sample waited before its first step.", labels,
                                    buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prefill_time = Histogram("shardserve_request_prefill_time_seconds",
                                      "Time from a sample's first step to its first token.", labels,
                                      buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(EngineCollector(model, stats))

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.model, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
