"""The traffic a plan is for and the latency it must meet: plain records, read by planner and launch."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    prefix_len: int = 0          # leading prompt tokens every request shares (cached)
    concurrency: float | None = None   # whole deployment, closed loop
    request_rate: float | None = None  # whole deployment, requests/s, Poisson arrivals
    percentile: int = 50         # the percentile latencies are stated at

    def per_replica(self, dp: int) -> "Workload":
        return Workload(self.input_len, self.output_len, self.prefix_len,
                        None if self.concurrency is None else self.concurrency / dp,
                        None if self.request_rate is None else self.request_rate / dp, self.percentile)

    def with_rate(self, rate: float) -> "Workload":
        return Workload(self.input_len, self.output_len, self.prefix_len, None, rate, self.percentile)

    def describe(self) -> str:
        load = (f"{self.concurrency:g} concurrent" if self.concurrency is not None
                else f"{self.request_rate:g} req/s")
        prefix = f" ({self.prefix_len} shared prefix)" if self.prefix_len else ""
        return f"{self.input_len} in{prefix} / {self.output_len} out, {load}"


@dataclass(frozen=True)
class Targets:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def describe(self) -> str:
        """'TTFT <= 500 ms and TPOT <= 30 ms' (the targets set)."""
        parts = [f"{name} <= {value:g} ms" for name, value in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms))
                 if value is not None]
        return " and ".join(parts)

    def misses(self, ttft_ms: float, tpot_ms: float) -> list[str]:
        """What a speed misses, worded for a reader: 'TTFT 620 ms > 500 ms'. An overloaded speed's TTFT
        (inf: it grows without bound) is left to Estimates.overload to word."""
        out = []
        if self.ttft_ms is not None and ttft_ms > self.ttft_ms and math.isfinite(ttft_ms):
            out.append(f"TTFT {ttft_ms:,.0f} ms > {self.ttft_ms:g} ms")
        if self.tpot_ms is not None and tpot_ms > self.tpot_ms:
            out.append(f"TPOT {tpot_ms:.1f} ms > {self.tpot_ms:g} ms")
        return out

    def shortfall(self, ttft_ms: float, tpot_ms: float) -> float:
        """How far a speed is from the targets: the largest ratio of achieved to target (<= 1 meets)."""
        ratios = [1.0]
        if self.ttft_ms is not None:
            ratios.append(ttft_ms / self.ttft_ms)
        if self.tpot_ms is not None:
            ratios.append(tpot_ms / self.tpot_ms)
        return max(ratios)
