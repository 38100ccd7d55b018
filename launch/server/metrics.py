"""Prometheus metrics for the server, in a registry of its own so two servers never collide.

NOTE: the series carry vLLM's names, types, labels (model_name, engine = the replica) and buckets, so
vLLM's Grafana dashboards, autoscaling rules and routers read a shardserve server as they read vLLM.
vLLM's two names for the time between tokens (inter_token_latency_seconds and its older
time_per_output_token_seconds) are both fed by the same observation. shardserve_requests_total counts
every request by outcome, which vLLM has no series for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from shardserve.runtime.core.engine import EngineStats
    from shardserve.runtime.outputs import PromptDelta
    from shardserve.runtime.sampling_params import SamplingParams

LABELS = ["model_name", "engine"]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit: vLLM's buckets for token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class EngineCollector:
    """The replicas' scheduler numbers, read from their latest stats at each scrape."""

    def __init__(self, model: str, stats: Callable[[], list[EngineStats]]):
        self.model, self.stats = model, stats

    def collect(self):
        families = [  # (family, the EngineStats field it reads)
            (GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                               labels=LABELS), "num_running"),
            (GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                               labels=LABELS), "num_waiting"),
            (GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                               labels=LABELS), "kv_cache_usage"),
            (CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
                                 labels=LABELS), "num_preemptions"),
            (CounterMetricFamily("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.",
                                 labels=LABELS), "num_prefix_query_tokens"),
            (CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached.",
                                 labels=LABELS), "num_prefix_hit_tokens"),
            (CounterMetricFamily("vllm:external_prefix_cache_queries", "CPU tier of the prefix cache: prompt "
                                 "tokens looked up there past the GPU pool's hits.", labels=LABELS),
             "num_offload_query_tokens"),
            (CounterMetricFamily("vllm:external_prefix_cache_hits", "CPU tier of the prefix cache: prompt tokens "
                                 "loaded from it instead of computed.", labels=LABELS), "num_offload_hit_tokens"),
        ]
        steps = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine "
                                      "step.", labels=LABELS)
        for engine, s in enumerate(self.stats()):
            for family, field in families:
                family.add_metric([self.model, str(engine)], getattr(s, field))
            buckets = [(floatToGoString(bound), count) for bound, count in s.iteration_tokens.cumulative()]
            steps.add_metric([self.model, str(engine)], buckets, s.iteration_tokens.total)
        yield from (family for family, _ in families)
        yield steps
        yield from spec_decode_families(self.model, self.stats())


class ServerMetrics:
    def __init__(self, model: str, stats: Callable[[], list[EngineStats]], max_model_len: int):
        self.registry = CollectorRegistry()
        self.model = model
        self.requests = Counter("shardserve_requests", "Finished API requests by outcome (success, aborted, "
                                "rejected, unavailable, error).", ["model_name", "outcome"], registry=self.registry)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*LABELS, "finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         LABELS, registry=self.registry)
        counts = one_two_five(max_model_len)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               LABELS, buckets=counts, registry=self.registry)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", LABELS,
                                                   buckets=counts, registry=self.registry)
        self.max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                                    "parameter.", LABELS, buckets=counts, registry=self.registry)
        self.n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", LABELS,
                           buckets=N_BUCKETS, registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=TTFT_BUCKETS, registry=self.registry)
        self.token_gaps = [Histogram(name, "Histogram of the time between output tokens in seconds.", LABELS,
                                     buckets=TOKEN_GAP_BUCKETS, registry=self.registry)
                           for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")]
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds", "Per request: (e2e - TTFT) / (output "
                              "tokens - 1), with 2 tokens or more (per sample when n > 1).", LABELS,
                              buckets=TOKEN_GAP_BUCKETS, registry=self.registry)
        self.phases = {phase: Histogram(f"vllm:{name}", f"Histogram of {what} in seconds.", LABELS,
                                        buckets=REQUEST_BUCKETS, registry=self.registry)
                       for phase, name, what in (
            ("e2e", "e2e_request_latency_seconds", "e2e request latency"),
            ("queue", "request_queue_time_seconds", "time a sample waited before its first step"),
            ("prefill", "request_prefill_time_seconds", "time from a sample's first step to its first token"),
            ("inference", "request_inference_time_seconds", "time from a sample's first step to its last token"),
            ("decode", "request_decode_time_seconds", "time from a request's first token to its last"))}
        self.routed = Counter("shardserve_routed_prompts", "Prompts given to each replica, by why it was chosen: "
                              "prefix (it held the longest cached prefix), session (the conversation's replica) "
                              "or least_loaded.", [*LABELS, "reason"], registry=self.registry)
        self.registry.register(EngineCollector(model, stats))

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.model, outcome).inc()

    def pooled(self, engine: int, num_prompt_tokens: int, e2e_s: float) -> None:
        """A pooled prompt (/v1/embeddings): its prompt tokens and latency, as any request's."""
        labels = (self.model, str(engine))
        self.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        self.request_prompt_tokens.labels(*labels).observe(num_prompt_tokens)
        self.phases["e2e"].labels(*labels).observe(e2e_s)
        self.success.labels(*labels, "stop").inc()

    def prompt_timer(self, engine: int, num_prompt_tokens: int, params: SamplingParams) -> PromptTimer:
        return PromptTimer(self, (self.model, str(engine)), num_prompt_tokens, params)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PromptTimer:
    """One prompt's times and counts as its deltas arrive, observed into the metrics."""

    def __init__(self, metrics: ServerMetrics, labels: tuple[str, str], num_prompt_tokens: int,
                 params: SamplingParams):
        self.metrics, self.labels = metrics, labels
        self.num_prompt_tokens, self.n = num_prompt_tokens, params.n
        self.start = self.last = self.first = time.monotonic()
        self.num_tokens = 0
        self.prefill_s: float | None = None  # the first sample's, once its first token is out
        self.finish_reasons: list[str] = []
        metrics.n.labels(*labels).observe(params.n)
        if params.max_tokens is not None:
            metrics.max_tokens.labels(*labels).observe(params.max_tokens)

    def delta(self, delta: PromptDelta) -> None:
        m, labels, now = self.metrics, self.labels, time.monotonic()
        for sample in delta.samples:
            if sample.times is not None:
                m.phases["queue"].labels(*labels).observe(sample.times.queue_s)
                m.phases["prefill"].labels(*labels).observe(sample.times.prefill_s)
                self.prefill_s = sample.times.prefill_s if self.prefill_s is None else self.prefill_s
            if sample.finish_reason is not None:
                self.finish_reasons.append(sample.finish_reason)
        num_new = sum(len(sample.new_token_ids) for sample in delta.samples)
        if not num_new:
            return
        if self.num_tokens == 0:
            m.ttft.labels(*labels).observe(now - self.start)
            self.first = now
        else:
            for histogram in m.token_gaps:
                histogram.labels(*labels).observe(now - self.last)
        m.generation_tokens.labels(*labels).inc(num_new)
        self.num_tokens, self.last = self.num_tokens + num_new, now

    def finish(self) -> tuple[float, float | None, float, float]:
        """The prompt has finished: (TTFT, TPOT or None, e2e, output tokens per sample) after observing them.
        TPOT = (e2e - TTFT) / (output tokens - 1) with 2 tokens or more."""
        m, labels = self.metrics, self.labels
        e2e, ttft, per_sample = time.monotonic() - self.start, self.first - self.start, self.num_tokens / self.n
        m.prompt_tokens.labels(*labels).inc(self.num_prompt_tokens)
        m.request_prompt_tokens.labels(*labels).observe(self.num_prompt_tokens)
        m.request_generation_tokens.labels(*labels).observe(per_sample)
        m.phases["e2e"].labels(*labels).observe(e2e)
        m.phases["decode"].labels(*labels).observe(self.last - self.first)
        if self.prefill_s is not None:
            m.phases["inference"].labels(*labels).observe(self.prefill_s + self.last - self.first)
        for reason in self.finish_reasons:
            m.success.labels(*labels, reason).inc()
        tpot = (e2e - ttft) / (per_sample - 1) if per_sample >= 2 else None
        if tpot is not None:
            m.tpot.labels(*labels).observe(tpot)
        return ttft, tpot, e2e, per_sample

    def aborted(self) -> None:
        """The prompt was aborted (its client left): its prompt tokens count once its prefill ran, and its
        unfinished samples as vLLM's request_success{finished_reason="abort"}."""
        m, labels = self.metrics, self.labels
        if self.num_tokens:
            m.prompt_tokens.labels(*labels).inc(self.num_prompt_tokens)
        num_unfinished = self.n - len(self.finish_reasons)
        for reason in self.finish_reasons:
            m.success.labels(*labels, reason).inc()
        if num_unfinished > 0:
            m.success.labels(*labels, "abort").inc(num_unfinished)


def spec_decode_families(model: str, stats: list[EngineStats]):
    """vLLM's speculative-decoding counters, for engines that speculate (none without --speculative-config)."""
    engines = [(str(engine), s.spec_decode) for engine, s in enumerate(stats) if s.spec_decode is not None]
    if not engines:
        return
    for name, help_text, field in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "num_accepted_tokens")):
        family = CounterMetricFamily(name, help_text, labels=LABELS)
        for engine, spec in engines:
            family.add_metric([model, engine], getattr(spec, field))
        yield family
    per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
                                       "position.", labels=[*LABELS, "position"])
    for engine, spec in engines:
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric([model, engine, str(position)], count)
    yield per_position
