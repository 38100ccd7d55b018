"""A cumulative count of tokens per engine step, kept by the engine and read by /metrics as a histogram."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

# NOTE: vLLM's buckets for vllm:iteration_tokens_total, so its dashboards' quantiles read the same
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """Counts per bucket (the last one past every bound: +Inf), not cumulative, and their sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # len(bounds) + 1
    total: float

    def cumulative(self) -> list[tuple[float, int]]:
        """Prometheus' buckets: (upper bound, observations at or below it), infinity last."""
        buckets, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            running += count
            buckets.append((bound, running))
        return buckets


class StepHistogram:
    def __init__(self, bounds: tuple[float, ...] = ITERATION_TOKEN_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # a bound is inclusive (le)
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.total)
