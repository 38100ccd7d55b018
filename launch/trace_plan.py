"""`plan --trace FILE` and `plan --traffic NAME`: a plan for recorded traffic. The layout search runs on the trace's
mean lengths and load (the steady-state model ranks layouts); its best few layouts (planner/plan.py's contenders)
then serve the trace itself, each replayed through the engine's own scheduler and block manager with the planner's
step times (runtime/core/replay.py), and the chooser takes one again on what the replays measured. The plan's
estimates become what its replay measured: percentiles of TTFT, TPOT, inter-token latency and end-to-end time, and
the output tokens/s the trace is served at; its rationale says which layouts were replayed and why its own won."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

from shardserve.planner.errors import PlanError
from shardserve.planner.model_source import ModelInfo
from shardserve.planner.plan import Plan, replayed_choice
from shardserve.planner.plan_file import EstimatesSection, PercentilesSection, PlanFile, Spread, TraceSection
from shardserve.planner.search import PREFERENCE_MARGIN
from shardserve.planner.serving import Replica
from shardserve.planner.speed import Estimates
from shardserve.planner.trace import Trace, at_percentile, spread
from shardserve.planner.workload import Targets

TRAFFIC_FLAGS = ("input_len", "output_len", "prefix_len", "concurrency", "request_rate")
# NOTE: a replay costs about a millisecond a request on one core (the scheduler's own work for each token), so the
# layouts replayed are as many as fit this many requests in all (4 of 1,000-request traffic, 2 of a 5,000-request
# trace, at least the plan's own): planning stays seconds long, and gives the same plan on any machine.
MAX_REPLAYED_REQUESTS = 10_000


def workload_flags(trace: Trace, flags: dict) -> dict:
    """The flags with the trace's traffic as the search's workload: its mean lengths, and its load (a closed loop:
    its concurrency; an offline trace: every request in flight at once; else its rate). A traffic flag given too is
    refused: which would count is unclear."""
    given = [name for name in TRAFFIC_FLAGS if flags.get(name) is not None]
    if given:
        raise PlanError(f"--{given[0].replace('_', '-')} with --trace: the trace is the traffic; give one of them")
    traffic: dict[str, float] = {"input_len": round(trace.mean("input_len")),
                                 "output_len": round(trace.mean("output_len")),
                                 "prefix_len": round(trace.mean("prefix_len"))}
    if trace.concurrency is not None:
        traffic["concurrency"] = float(min(trace.concurrency, len(trace.requests)))
    elif trace.is_offline or trace.span_s == 0:
        traffic["concurrency"] = float(len(trace.requests))
    else:
        traffic["request_rate"] = len(trace.requests) / trace.span_s
    return {**flags, **traffic}


def acceptance_flags(trace: Trace, flags: dict, base: dict) -> tuple[dict, str | None]:
    """With speculative_config set (by the flags or the profile `base`) and no draft_acceptance_rate, the flags with
    the rate the trace's speculative decoding ran at (launch --record-trace writes each request's counts), and the
    rationale line that says so; the flags as they are otherwise."""
    measured = trace.measured_acceptance()
    values = {**base, **flags}
    if measured is None or values.get("draft_acceptance_rate") is not None or not values.get("speculative_config"):
        return flags, None
    rate, steps = measured
    return {**flags, "draft_acceptance_rate": round(rate, 3)}, (
        f"draft_acceptance_rate {rate:.3f}: measured in the trace ({steps:,} verify steps; give "
        "--draft-acceptance-rate to plan at another)")


def traffic_flags(name: str, flags: dict) -> tuple[Trace, dict]:
    """`plan --traffic NAME`: its trace (planner/traffic.py) and the flags with its traffic as the search's workload.
    1,000 requests: at --request-rate R, arriving at R req/s (Poisson); with --concurrency N, N in flight, the next
    sent as one finishes (a closed loop, as vLLM's `bench serve --max-concurrency N`); neither: all at once. The
    lengths are the traffic's: a length flag given too is refused."""
    from shardserve.planner.traffic import DEFAULT_NUM_REQUESTS, named_trace

    given = [key for key in ("input_len", "output_len", "prefix_len") if flags.get(key) is not None]
    if given:
        raise PlanError(f"--{given[0].replace('_', '-')} with --traffic {name}: the traffic has its own lengths; "
                        "give one of them")
    rate, concurrency = flags.get("request_rate"), flags.get("concurrency")
    if rate is not None and concurrency is not None:
        raise PlanError("--request-rate with --concurrency: give one of them")
    in_flight = None if concurrency is None else max(1, round(concurrency))
    trace = named_trace(name, DEFAULT_NUM_REQUESTS, rate, concurrency=in_flight)
    rest = {key: value for key, value in flags.items() if key not in ("request_rate", "concurrency")}
    searched = workload_flags(trace, rest)
    return trace, searched if rate is None else {**searched, "request_rate": rate}


@dataclass(frozen=True)
class Replayed:
    """A trace replayed on one layout: each request's latencies in ms (TTFT and end-to-end with its way through the
    server, replica.request_ms, as the plan's own estimates have them), the output tokens and their span."""

    ttft_ms: list[float]
    tpot_ms: list[float]  # the requests of 2 output tokens or more
    itl_ms: list[float]  # every gap between two tokens of a request
    e2e_ms: list[float]
    num_tokens: int
    span_s: float  # from the first arrival to the last token
    seconds: float  # how long the replay took

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_tokens / self.span_s


def replayed(record: PlanFile, model: ModelInfo, trace: Trace, replica: Replica | None = None) -> Replayed:
    """The trace replayed on the plan's layout, each step timed by `replica` (default: the plan's own)."""
    from shardserve.planner.replay import replica_of, settings_of
    from shardserve.runtime.core.replay import EngineShape, replay
    from shardserve.runtime.core.scheduler_config import SchedulerConfig

    problem = _too_long(record, trace)
    if problem:
        raise PlanError(problem)
    rt, mem, par = record.runtime, record.memory, record.parallel
    settings = settings_of(record)
    shape = EngineShape(SchedulerConfig(rt.max_num_seqs, rt.max_num_batched_tokens, speculative=settings.speculative),
                        mem.num_blocks, mem.block_size, rt.enable_prefix_caching is not False, rt.max_model_len,
                        par.data_parallel_size, model.spec.kv_groups.windows, settings.draft_acceptance_rate or 0.0)
    began = time.perf_counter()
    replica = replica or replica_of(record, model)
    served = replay(trace.requests, replica, shape, trace.concurrency)
    return Replayed([s.ttft_s * 1000 + replica.request_ms for s in served],
                    [s.tpot_s * 1000 for s in served if s.tpot_s is not None],
                    [(b - a) * 1000 for s in served for a, b in zip(s.token_times, s.token_times[1:])],
                    [s.e2e_s * 1000 + replica.request_ms for s in served],
                    sum(len(s.token_times) for s in served),
                    max(s.token_times[-1] for s in served) - min(s.arrival_s for s in served),
                    time.perf_counter() - began)


def _too_long(record: PlanFile, trace: Trace) -> str | None:
    """Why the layout cannot serve the trace: a request longer than its max_model_len."""
    longest = max(trace.requests, key=lambda r: r.input_len + r.output_len)
    total, max_model_len = longest.input_len + longest.output_len, record.runtime.max_model_len
    if total <= max_model_len:
        return None
    return (f"the trace {trace.source}: a request of {longest.input_len} + {longest.output_len} tokens is longer "
            f"than max_model_len {max_model_len}: plan with --max-model-len {total} or more")


def with_replay(record: PlanFile, model: ModelInfo, trace: Trace, replica: Replica | None = None) -> PlanFile:
    """The plan with its estimates from the trace, replayed on its own layout, each step timed by `replica`
    (default: the plan's own; bench/accuracy.py passes one that schedules as another engine does)."""
    return with_numbers(record, trace, replayed(record, model, trace, replica))


def with_numbers(record: PlanFile, trace: Trace, rep: Replayed, num_layouts: int = 1,
                 seconds: float | None = None, plan_seconds: float | None = None) -> PlanFile:
    """The plan with the estimates its replay measured (`seconds`: every replay's, default this one's), and the
    targets they miss at the plan's percentile as warnings."""
    est, par = record.estimates, record.parallel
    num_gpus = par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size
    section = TraceSection(trace.source, len(rep.ttft_ms), trace.is_offline, rep.output_tokens_per_s,
                           round(rep.seconds if seconds is None else seconds, 3), trace.concurrency, num_layouts,
                           None if plan_seconds is None else round(plan_seconds, 3))
    estimates = dataclasses.replace(
        est, **_measured(rep, est, num_gpus),
        percentiles=PercentilesSection(_spread(rep.ttft_ms), _spread(rep.tpot_ms) if rep.tpot_ms else None,
                                       _spread(rep.itl_ms) if rep.itl_ms else None, _spread(rep.e2e_ms)),
        trace=section)
    return dataclasses.replace(record, estimates=estimates, warnings=record.warnings + _misses(record, estimates))


@dataclass(frozen=True)
class _Run:
    """One contender: its plan, the record it writes, its replay and the estimates the replay makes of it."""

    plan: Plan
    record: PlanFile
    replayed: Replayed
    estimates: Estimates


def replayed_plan(plan: Plan, model: ModelInfo, trace: Trace, began: float) -> PlanFile:
    """The trace replayed on the search's best layouts, the one the chooser takes on the replayed numbers (else the
    search's own, when none meets the targets at the plan's percentile) with its replay's estimates; `began`: when
    planning began (perf_counter), for the plan's seconds."""
    every = plan.contenders()
    contenders = every[:max(1, MAX_REPLAYED_REQUESTS // len(trace.requests))]
    runs = _replay_contenders(contenders, model, trace)
    won = replayed_choice([r.plan for r in runs], [r.estimates for r in runs])
    run = next((r for r in runs if r.plan is won), runs[0])
    budget = (f" (of {len(every)}: as many as replay {MAX_REPLAYED_REQUESTS:,} requests in all)"
              if len(contenders) < len(every) else "")
    record = dataclasses.replace(run.record, rationale=run.record.rationale +
                                 _why(runs, run, won is not None, len(contenders), plan.search.targets, budget))
    return with_numbers(record, trace, run.replayed, len(runs), sum(r.replayed.seconds for r in runs),
                        time.perf_counter() - began)


def _replay_contenders(contenders: list[Plan], model: ModelInfo, trace: Trace) -> list[_Run]:
    """Each contender replayed, in the chooser's order. NOTE: with targets the chooser takes the fewest GPUs first, so
    once a layout meets them in its replay, the later ones on more GPUs cannot win and are not replayed; a later one
    whose max_model_len (auto: its own) is too short for the trace is left out, the search's own refused."""
    runs: list[_Run] = []
    targets = contenders[0].search.targets
    for contender in contenders:
        gpus = contender.chosen.layout.num_gpus
        if targets.is_set and any(r.estimates.meets(targets) and r.plan.chosen.layout.num_gpus < gpus for r in runs):
            break
        record = contender.record()
        if runs and _too_long(record, trace):
            continue
        rep = replayed(record, model, trace)
        runs.append(_Run(contender, record, rep, _estimates(contender, rep)))
    return runs


def _estimates(contender: Plan, rep: Replayed) -> Estimates:
    """The contender's estimates as its replay measured them: latencies at the plan's percentile, the output
    tokens/s the trace was served at."""
    est = contender.chosen.estimates
    assert est is not None  # a feasible candidate's
    return dataclasses.replace(est, **_measured(rep, est, contender.chosen.layout.num_gpus))


def _measured(rep: Replayed, est: Estimates | EstimatesSection, num_gpus: int) -> dict[str, Any]:
    """What a replay measured, as estimates: TTFT and TPOT at the plan's percentile (TPOT as estimated when no
    request had two tokens), the output tokens/s it served the trace at (no more than the API process streams),
    per GPU and per user."""
    percentile = est.workload.percentile
    tpot = _at(rep.tpot_ms, percentile) if rep.tpot_ms else est.tpot_ms
    per_s = min(rep.output_tokens_per_s, (est.api_max_request_rate or math.inf) * est.workload.output_len)
    return {"ttft_ms": _at(rep.ttft_ms, percentile), "tpot_ms": tpot, "output_tokens_per_s": per_s,
            "output_tokens_per_s_per_gpu": per_s / num_gpus, "output_tokens_per_s_per_user": 1000 / tpot}


def _why(runs: list[_Run], run: _Run, is_met: bool, num_contenders: int, targets: Targets,
         budget: str) -> tuple[str, ...]:
    """Which layouts the trace was replayed on, with their numbers, and why the plan's won (`budget`: what bounded
    the number replayed, if the request budget did)."""
    p = run.estimates.workload.percentile
    numbers = "; ".join(f"{_layout(r.plan)}: TTFT p{p} {r.estimates.ttft_ms:,.0f} ms, TPOT p{p} "
                        f"{r.estimates.tpot_ms:.1f} ms, {r.estimates.output_tokens_per_s:,.0f} output tok/s "
                        f"({r.estimates.output_tokens_per_s_per_gpu:,.0f} per GPU)" for r in runs)
    replayed_on = (f"the trace replayed on the search's best {len(runs)} layouts{budget} ({numbers})"
                   if len(runs) > 1 else f"the trace replayed on {numbers}{budget}")
    skipped = num_contenders - len(runs)
    if targets.is_set and not is_met:
        why = (f"none meets {targets.describe()} at p{p} in its replay: the search's choice ({_layout(run.plan)}, "
               "on its means) is kept")
    elif targets.is_set:
        why = (f"{_layout(run.plan)} won: the fewest GPUs ({run.plan.chosen.layout.num_gpus}) meeting "
               f"{targets.describe()} at p{p} in the replay, then the most output tok/s per GPU")
        why += f"; {skipped} more on more GPUs not replayed (they cannot win)" if skipped else ""
    elif len(runs) > 1:
        why = (f"{_layout(run.plan)} won: with as many GPUs busy, the most output tok/s in the replay, or of those "
               f"within {1 - PREFERENCE_MARGIN:.0%} of it the layout the rules prefer")
    elif budget:
        why = "the search's choice: the trace is too long to replay another layout beside it"
    else:
        why = "no other layout the search could choose in its place (as many GPUs, as many per replica)"
    return replayed_on, why


def _layout(plan: Plan) -> str:
    layout = plan.chosen.layout
    shape = f"tp {layout.tensor_parallel_size} x pp {layout.pipeline_parallel_size} x dp {layout.data_parallel_size}"
    return shape + (" (expert parallel)" if plan.chosen.expert_parallel else "")


def _spread(values: list[float]) -> Spread:
    return Spread(*(round(v, 3) for v in spread(values)))


def _at(values: list[float], percentile: int) -> float:
    return at_percentile(sorted(values), percentile)


def _misses(record: PlanFile, est) -> tuple[str, ...]:
    """The service targets the replayed trace misses at their percentile (the search met them on its means)."""
    targets = Targets(record.service.ttft_ms, record.service.tpot_ms)
    p = est.workload.percentile
    return tuple(f"the trace replayed at p{p}: {miss}" for miss in targets.misses(est.ttft_ms, est.tpot_ms))
