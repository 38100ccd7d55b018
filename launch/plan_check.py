"""The server's self-check: once a minute under load, measured TTFT and TPOT against the plan's prediction.

The request path only appends a FinishedRequest to a deque; `tick()`, called on the event loop
(`run()`, a task the launcher starts and cancels), drains it once per window. A window with at
least MIN_REQUESTS finished requests is "under load": one INFO line gives the measured p50 and p90
TTFT and TPOT and the workload seen (mean prompt and output tokens, requests/s, mean requests in
flight by Little's law) beside the plan's estimates and the workload they were made for; a measured
latency at the plan's percentile more than TOLERANCE away from the estimate adds a WARNING line."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from shardserve.planner.plan_file import PlanFile

logger = logging.getLogger("shardserve.launch.plan_check")

WINDOW_SECONDS = 60.0
MIN_REQUESTS = 8
TOLERANCE = 0.25


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What the server measured of one finished request (a prompt; with n samples, per sample)."""

    ttft_s: float
    tpot_s: float | None  # None with fewer than 2 output tokens
    e2e_s: float
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class Prediction:
    """The plan's estimates and the workload they were made for."""

    ttft_ms: float
    tpot_ms: float
    percentile: int  # the percentile the estimates are stated at
    input_len: int
    output_len: int
    concurrency: float | None
    request_rate: float | None

    @staticmethod
    def from_plan(plan: PlanFile) -> Prediction:
        e, w = plan.estimates, plan.estimates.workload
        return Prediction(e.ttft_ms, e.tpot_ms, w.percentile, w.input_len, w.output_len, w.concurrency,
                          w.request_rate)

    def describe_workload(self) -> str:
        load = (f"{self.concurrency:g} in flight" if self.concurrency is not None
                else f"{self.request_rate:g} req/s" if self.request_rate is not None else "full batches")
        return f"{self.input_len} prompt / {self.output_len} output tokens, {load}"


@dataclass(frozen=True)
class WindowReport:
    """One window's measurements (milliseconds) and what differs from the plan."""

    num_requests: int
    seconds: float
    ttft_ms: dict[int, float]  # percentile -> ms
    tpot_ms: dict[int, float]  # empty when no request had 2 tokens or more
    mean_prompt_tokens: float
    mean_output_tokens: float
    mean_in_flight: float
    warnings: tuple[str, ...]

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds


def percentile(values: list[float], p: int) -> float:
    """The nearest-rank percentile (p50 of [1, 2, 3, 4] is 2)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


class PlanCheck:
    def __init__(self, prediction: Prediction, clock: Callable[[], float] = time.monotonic,
                 window_seconds: float = WINDOW_SECONDS):
        self.prediction, self.clock, self.window_seconds = prediction, clock, window_seconds
        self._finished: deque[FinishedRequest] = deque()
        self._window_start = clock()

    def record(self, request: FinishedRequest) -> None:
        """On the request path: an append, nothing more."""
        self._finished.append(request)

    def tick(self) -> WindowReport | None:
        """Once the window is over: its report (logged), or None when fewer than MIN_REQUESTS
        finished in it; then a new window starts."""
        now = self.clock()
        seconds = now - self._window_start
        if seconds < self.window_seconds:
            return None
        finished = [self._finished.popleft() for _ in range(len(self._finished))]
        self._window_start = now
        if len(finished) < MIN_REQUESTS:
            return None
        report = self.report(finished, seconds)
        logger.info("%s", self.describe(report))
        for warning in report.warnings:
            logger.warning("%s", warning)
        return report

    def report(self, finished: list[FinishedRequest], seconds: float) -> WindowReport:
        p = self.prediction
        points = sorted({50, 90, p.percentile})
        ttft = [r.ttft_s * 1e3 for r in finished]
        tpot = [r.tpot_s * 1e3 for r in finished if r.tpot_s is not None]
        ttft_ms = {q: percentile(ttft, q) for q in points}
        tpot_ms = {q: percentile(tpot, q) for q in points} if tpot else {}
        report = WindowReport(len(finished), seconds, ttft_ms, tpot_ms,
                              sum(r.num_prompt_tokens for r in finished) / len(finished),
                              sum(r.num_output_tokens for r in finished) / len(finished),
                              sum(r.e2e_s for r in finished) / seconds, ())
        warnings = [self._off(name, measured.get(p.percentile), predicted, report)
                    for name, measured, predicted in (("TTFT", ttft_ms, p.ttft_ms), ("TPOT", tpot_ms, p.tpot_ms))]
        return replace(report, warnings=tuple(w for w in warnings if w))

    def _off(self, name: str, measured: float | None, predicted: float, report: WindowReport) -> str | None:
        if measured is None or predicted <= 0 or abs(measured - predicted) <= TOLERANCE * predicted:
            return None
        q = self.prediction.percentile
        direction = "above" if measured > predicted else "below"
        return (f"measured {name} p{q} {measured:.1f} ms is {abs(measured / predicted - 1):.0%} {direction} the "
                f"plan's {predicted:.1f} ms (more than {TOLERANCE:.0%}); workload seen: "
                f"{_workload(report)}, planned for {self.prediction.describe_workload()} (where they match, "
                f"`shardserve calibrate` here and plan again)")

    def describe(self, report: WindowReport) -> str:
        p = self.prediction
        tpot = (" ".join(f"p{q} {v:.1f} ms" for q, v in report.tpot_ms.items()) if report.tpot_ms
                else "none (no request had 2 output tokens)")
        return (f"plan check, last {report.seconds:.0f} s: {report.num_requests} requests, {_workload(report)}; "
                f"TTFT {' '.join(f'p{q} {v:.1f} ms' for q, v in report.ttft_ms.items())} (plan p{p.percentile} "
                f"{p.ttft_ms:.1f} ms), TPOT {tpot} (plan p{p.percentile} {p.tpot_ms:.1f} ms); the plan is for "
                f"{p.describe_workload()}")

    async def run(self) -> None:
        """Tick at each window's end until cancelled (the launcher cancels it on shutdown)."""
        p = self.prediction
        logger.info("checking TTFT and TPOT against the plan's (p%d %.1f ms and %.1f ms for %s) every %.0f s with "
                    "%d requests or more", p.percentile, p.ttft_ms, p.tpot_ms, p.describe_workload(),
                    self.window_seconds, MIN_REQUESTS)
        while True:
            await asyncio.sleep(max(0.05, self._window_start + self.window_seconds - self.clock()))
            self.tick()


def _workload(report: WindowReport) -> str:
    return (f"{report.mean_prompt_tokens:.0f} prompt / {report.mean_output_tokens:.0f} output tokens, "
            f"{report.requests_per_s:.2f} req/s, {report.mean_in_flight:.1f} in flight")
