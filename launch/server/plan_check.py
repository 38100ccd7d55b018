"""The server's self-check: once a minute under load, measured TTFT and TPOT against the plan's prediction.

The request path only appends a FinishedRequest to a deque; `tick()`, called on the event loop
(`run()`, a task the launcher starts and cancels), drains it once per window. A window with at
least MIN_REQUESTS finished requests is "under load": one INFO line gives the measured p50 and p90
TTFT and TPOT and the workload seen (mean prompt and output tokens, requests/s, mean requests in
flight by Little's law) beside the plan's estimates and the workload they were made for; a measured
latency at the plan's percentile more than TOLERANCE away from the estimate adds a WARNING line. A plan made from
a trace (`plan --trace`, `--traffic`) has the replay's p50, p90 and p99 of TTFT and TPOT: they are compared at each
percentile instead, where the window holds requests enough to measure it (a p99 needs 100). With speculative
decoding the window's tokens per target forward (its output tokens over those less the drafts accepted in it) are
compared with what the plan's draft_acceptance_rate gives, and a rate far from it is named for the next plan.
`rederived()` makes sure those estimates are the plan's layout's: a plan file edited by hand is planned again
with its layout pinned."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from shardserve.planner.errors import PlanError
from shardserve.planner.model_source import ModelInfo
from shardserve.planner.plan_file import PlanFile
from shardserve.planner.speculative import DEFAULT_ACCEPTANCE, SpeculativeConfig, acceptance_for, tokens_per_step

logger = logging.getLogger("shardserve.launch.server.plan_check")

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

    ttft_ms: float | None  # None: the plan's load outruns it (overloaded: TTFT unbounded)
    tpot_ms: float
    percentile: int  # the percentile the estimates are stated at
    input_len: int
    output_len: int
    concurrency: float | None
    request_rate: float | None
    # a replayed trace's latencies (estimates.percentiles), percentile -> ms; None: the plan has none
    ttft_percentiles: dict[int, float] | None = None
    tpot_percentiles: dict[int, float] | None = None
    num_speculative_tokens: int = 0  # speculative decoding's drafts a step; 0: none
    draft_acceptance_rate: float | None = None  # the rate the plan's speeds assume

    @staticmethod
    def from_plan(plan: PlanFile) -> Prediction:
        e, w = plan.estimates, plan.estimates.workload
        spread = e.percentiles
        spec = SpeculativeConfig.parse(plan.runtime.speculative_config)
        rate = plan.service.draft_acceptance_rate
        return Prediction(e.ttft_ms, e.tpot_ms, w.percentile, w.input_len, w.output_len, w.concurrency,
                          w.request_rate, _by_percentile(spread.ttft_ms) if spread else None,
                          _by_percentile(spread.tpot_ms) if spread and spread.tpot_ms else None,
                          spec.num_speculative_tokens if spec else 0,
                          None if spec is None else rate if rate is not None else DEFAULT_ACCEPTANCE.get(spec.method))

    @property
    def tokens_per_forward(self) -> float | None:
        """The tokens a decoding request gains per target forward in the plan; None without speculation."""
        if self.draft_acceptance_rate is None:
            return None
        return tokens_per_step(self.num_speculative_tokens, self.draft_acceptance_rate)

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
    tokens_per_forward: float | None = None  # speculative decoding: the window's; None without or unmeasured

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds


def percentile(values: list[float], p: int) -> float:
    """The nearest-rank percentile (p50 of [1, 2, 3, 4] is 2)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


# (mean prompt tokens, mean output tokens, requests in flight) -> the plan's (TTFT ms, TPOT ms) for that
# traffic on this deployment (planner/replay.py); None where only the plan's own estimates are known
ForTraffic = Callable[[int, int, float], tuple[float, float]]


class PlanCheck:
    def __init__(self, prediction: Prediction, clock: Callable[[], float] = time.monotonic,
                 window_seconds: float = WINDOW_SECONDS, for_traffic: ForTraffic | None = None,
                 accepted_tokens: Callable[[], int] | None = None):
        """`accepted_tokens`: the drafts the engines accepted since they started (speculative decoding's counter),
        read at each window's end."""
        self.prediction, self.clock, self.window_seconds = prediction, clock, window_seconds
        self.for_traffic, self.accepted_tokens, self._accepted_mark = for_traffic, accepted_tokens, 0
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
        accepted = self._accepted_in_window()
        if len(finished) < MIN_REQUESTS:
            return None
        report = self.report(finished, seconds, accepted)
        logger.info("%s", self.describe(report))
        for warning in report.warnings:
            logger.warning("%s", warning)
        return report

    def _accepted_in_window(self) -> int | None:
        """The drafts accepted since the last window's end; None without the counter, or when it went back (an
        engine restarted)."""
        if self.accepted_tokens is None:
            return None
        now, before = self.accepted_tokens(), self._accepted_mark
        self._accepted_mark = now
        return now - before if now >= before else None

    def report(self, finished: list[FinishedRequest], seconds: float, accepted: int | None = None) -> WindowReport:
        """`accepted`: the drafts the engines accepted in the window (speculative decoding)."""
        p = self.prediction
        points = sorted({50, 90, p.percentile, *(p.ttft_percentiles or {})})
        ttft = [r.ttft_s * 1e3 for r in finished]
        tpot = [r.tpot_s * 1e3 for r in finished if r.tpot_s is not None]
        ttft_ms = {q: percentile(ttft, q) for q in points}
        tpot_ms = {q: percentile(tpot, q) for q in points} if tpot else {}
        report = WindowReport(len(finished), seconds, ttft_ms, tpot_ms,
                              sum(r.num_prompt_tokens for r in finished) / len(finished),
                              sum(r.num_output_tokens for r in finished) / len(finished),
                              sum(r.e2e_s for r in finished) / seconds, ())
        generated = sum(r.num_output_tokens for r in finished)
        if accepted is not None and p.tokens_per_forward is not None and generated > accepted:
            report = replace(report, tokens_per_forward=generated / (generated - accepted))
        warnings = [self._off(name, q, measured.get(q), predicted, report)
                    for name, q, measured, predicted in self._comparisons(report)] + [self._drafts_off(report)]
        return replace(report, warnings=tuple(w for w in warnings if w))

    def _drafts_off(self, report: WindowReport) -> str | None:
        """A warning when the window's tokens per forward are more than TOLERANCE from the plan's."""
        measured, planned, k = report.tokens_per_forward, self.prediction.tokens_per_forward, self.prediction.num_speculative_tokens
        if measured is None or planned is None or abs(measured - planned) <= TOLERANCE * planned:
            return None
        rate = acceptance_for(min(measured, k + 1.0), k)
        return (f"measured {measured:.2f} tokens per forward with speculative decoding (draft acceptance "
                f"{rate:.2f}) against the plan's {planned:.2f} (draft_acceptance_rate "
                f"{self.prediction.draft_acceptance_rate:g}): plan again with --draft-acceptance-rate {rate:.2f}")

    def _comparisons(self, report: WindowReport) -> list[tuple[str, int, dict[int, float], float | None]]:
        """(latency, percentile, measured, planned at that percentile): the plan's replayed percentiles each
        where the window has requests enough for it (1 in 100 above a p99), else the plan's percentile against
        `expected`."""
        p = self.prediction
        if p.ttft_percentiles is None:
            ttft, tpot = self.expected(report)
            return [("TTFT", p.percentile, report.ttft_ms, ttft), ("TPOT", p.percentile, report.tpot_ms, tpot)]
        return [(name, q, measured, planned) for name, measured, spread in (
                    ("TTFT", report.ttft_ms, p.ttft_percentiles), ("TPOT", report.tpot_ms, p.tpot_percentiles or {}))
                for q, planned in spread.items() if report.num_requests >= math.ceil(100 / (100 - q))]

    def expected(self, report: WindowReport) -> tuple[float | None, float]:
        """The plan's TTFT and TPOT for the traffic seen (its own estimates without a speed model)."""
        if self.for_traffic is None:
            return self.prediction.ttft_ms, self.prediction.tpot_ms
        return self.for_traffic(max(1, round(report.mean_prompt_tokens)), max(1, round(report.mean_output_tokens)),
                                max(1.0, report.mean_in_flight))

    def _off(self, name: str, q: int, measured: float | None, predicted: float | None,
             report: WindowReport) -> str | None:
        if measured is None or predicted is None or predicted <= 0 or abs(measured - predicted) <= TOLERANCE * predicted:
            return None
        direction = "above" if measured > predicted else "below"
        basis = (f"the plan's p{q} from its replayed trace ({self.prediction.describe_workload()})"
                 if self.prediction.ttft_percentiles is not None
                 else "the plan's speed model for the traffic seen" if self.for_traffic is not None
                 else f"the plan's estimate for {self.prediction.describe_workload()}")
        return (f"measured {name} p{q} {measured:.1f} ms is {abs(measured / predicted - 1):.0%} {direction} "
                f"{predicted:.1f} ms, {basis} (more than {TOLERANCE:.0%}); workload seen: {_workload(report)} "
                "(`shardserve calibrate` on this GPU, then plan again)")

    def describe(self, report: WindowReport) -> str:
        p = self.prediction
        tpot = (" ".join(f"p{q} {v:.1f} ms" for q, v in report.tpot_ms.items()) if report.tpot_ms
                else "none (no request had 2 output tokens)")
        ttft_now, tpot_now = self.expected(report)
        here = (f"; for this traffic the plan's model says TTFT {_ms(ttft_now)}, TPOT {tpot_now:.1f} ms"
                if self.for_traffic is not None and p.ttft_percentiles is None else "")
        ttft_plan = _spread(p.ttft_percentiles) if p.ttft_percentiles else f"p{p.percentile} {_ms(p.ttft_ms)}"
        tpot_plan = _spread(p.tpot_percentiles) if p.tpot_percentiles else f"p{p.percentile} {p.tpot_ms:.1f} ms"
        drafts = ("" if report.tokens_per_forward is None or p.tokens_per_forward is None else
                  f"; {report.tokens_per_forward:.2f} tokens per forward (plan {p.tokens_per_forward:.2f})")
        return (f"plan check, last {report.seconds:.0f} s: {report.num_requests} requests, {_workload(report)}; "
                f"TTFT {' '.join(f'p{q} {v:.1f} ms' for q, v in report.ttft_ms.items())} (plan {ttft_plan}), "
                f"TPOT {tpot} (plan {tpot_plan}){drafts}; the plan is for {p.describe_workload()}{here}")

    async def run(self) -> None:
        """Tick at each window's end until cancelled (the launcher cancels it on shutdown)."""
        p = self.prediction
        logger.info("checking TTFT and TPOT against the plan's (p%d %s and %.1f ms for %s) every %.0f s with "
                    "%d requests or more", p.percentile, _ms(p.ttft_ms), p.tpot_ms, p.describe_workload(),
                    self.window_seconds, MIN_REQUESTS)
        while True:
            await asyncio.sleep(max(0.05, self._window_start + self.window_seconds - self.clock()))
            self.tick()


def _by_percentile(spread) -> dict[int, float]:
    """A plan's Spread as percentile -> ms."""
    return {50: spread.p50, 90: spread.p90, 99: spread.p99}


def _spread(values: dict[int, float]) -> str:
    return " ".join(f"p{q} {v:.1f} ms" for q, v in values.items())


def _workload(report: WindowReport) -> str:
    return (f"{report.mean_prompt_tokens:.0f} prompt / {report.mean_output_tokens:.0f} output tokens, "
            f"{report.requests_per_s:.2f} req/s, {report.mean_in_flight:.1f} in flight")


def rederived(plan: PlanFile, source: str, settings: dict, model: ModelInfo) -> PlanFile:
    """The plan as launch will run it (`settings`: the plan's, profile and flags merged): the plan itself when
    its predictions were made for those settings and its hardware (its inputs digest), else planned again
    with the layout pinned as written (sizes and layer split), said in one log line. NOTE: a layout edited
    by hand otherwise keeps the memory and speed predicted for another, and the self-check measures
    against those."""
    from shardserve.planner import PlanOptions, make_plan
    from shardserve.planner.plan_file import inputs_digest
    from shardserve.planner.replay import hardware_of
    from shardserve.planner.settings import PLAN, for_layer

    if plan.inputs_digest is None:
        logger.info("%s was written before plans recorded what their predictions were made for: they are "
                    "used as written (`shardserve plan` again to have them checked)", source)
        return plan
    if inputs_digest(settings, plan.hardware, plan.model.id) == plan.inputs_digest:
        return plan
    split = settings.get("layer_split")
    settings = _traffic_within(plan, settings, source)
    try:
        fresh = make_plan(model, hardware_of(plan), PlanOptions(**for_layer(settings, PLAN)),
                          layer_split=tuple(split) if split is not None else None).record()
    except PlanError as e:
        raise type(e)(f"{source}: its layout and settings as launch runs them do not plan: {e}") from None
    fresh = replace(fresh, model=plan.model, hardware=plan.hardware)
    fresh = replace(fresh, inputs_digest=fresh.digest())
    old, new = plan.estimates, fresh.estimates
    logger.info("%s: planned again with the layout as written (%s, layer_split %s), its settings or layout "
                "differing from those its predictions were made for: TTFT p%d %s -> %s, TPOT %.1f -> "
                "%.1f ms, KV cache %d -> %d tokens; the self-check uses these", source, _layout(fresh),
                list(fresh.parallel.layer_split), new.workload.percentile, _ms(old.ttft_ms), _ms(new.ttft_ms), old.tpot_ms,
                new.tpot_ms, plan.memory.kv_cache_tokens, fresh.memory.kv_cache_tokens)
    return fresh


def _traffic_within(plan: PlanFile, settings: dict, source: str) -> dict:
    """The plan's own traffic lengths where they fit the max_model_len launch runs with (a flag may lower it);
    else the planner's defaults for that length, as `plan --max-model-len N` would choose them, said in one
    log line. Lengths a flag gives are kept, and refused by the planner when they do not fit."""
    service, max_model_len = plan.service, settings.get("max_model_len")
    is_plans = (settings.get("input_len"), settings.get("output_len")) == (service.input_len, service.output_len)
    if not is_plans or not isinstance(max_model_len, int) or service.input_len + service.output_len <= max_model_len:
        return settings
    logger.info("%s: its traffic of %d prompt + %d output tokens is beyond max_model_len %d: planned for the "
                "default lengths within it", source, service.input_len, service.output_len, max_model_len)
    return {k: v for k, v in settings.items() if k not in ("input_len", "output_len")}


def _ms(value: float | None) -> str:
    """A plan's TTFT for a log line: '183.0 ms', or 'unbounded' (overloaded)."""
    return "unbounded" if value is None else f"{value:.1f} ms"


def _layout(plan: PlanFile) -> str:
    p = plan.parallel
    return f"tp={p.tensor_parallel_size} pp={p.pipeline_parallel_size} dp={p.data_parallel_size}"


def for_traffic(plan: PlanFile, model: ModelInfo) -> ForTraffic:
    """The plan's speed model (planner/replay.py) as the check asks it: the traffic seen, as a closed loop
    of that many requests in flight, at the plan's percentile (lengths kept within max_model_len)."""
    from shardserve.planner.replay import predict
    from shardserve.planner.workload import Workload

    percentile = plan.estimates.workload.percentile

    def expected(input_len: int, output_len: int, in_flight: float) -> tuple[float, float]:
        length = min(input_len + output_len, plan.runtime.max_model_len)
        input_len = max(1, min(input_len, length - 1))
        e = predict(plan, model, Workload(input_len, max(1, length - input_len), 0, in_flight, None, percentile))
        return e.ttft_ms, e.tpot_ms
    return expected
