"""`plan --trace FILE`: a plan for recorded traffic. The layout search runs on the trace's mean lengths and rate (the
steady-state model ranks layouts); the chosen layout then serves the trace itself, replayed through the engine's
own scheduler and block manager with the planner's step times (runtime/core/replay.py), and its estimates become
what the replay measured: percentiles of TTFT, TPOT, inter-token latency and end-to-end time, and the output
tokens/s the trace is served at."""

from __future__ import annotations

import dataclasses
import time

from shardserve.planner.errors import PlanError
from shardserve.planner.model_source import ModelInfo
from shardserve.planner.plan_file import PercentilesSection, PlanFile, Spread, TraceSection
from shardserve.planner.serving import Replica
from shardserve.planner.trace import Trace, at_percentile, spread
from shardserve.planner.workload import Targets

TRAFFIC_FLAGS = ("input_len", "output_len", "prefix_len", "concurrency", "request_rate")


def workload_flags(trace: Trace, flags: dict) -> dict:
    """The flags with the trace's traffic as the search's workload: its mean lengths, and its rate (an offline
    trace: every request in flight at once). A traffic flag given too is refused: which would count is unclear."""
    given = [name for name in TRAFFIC_FLAGS if flags.get(name) is not None]
    if given:
        raise PlanError(f"--{given[0].replace('_', '-')} with --trace: the trace is the traffic; give one of them")
    traffic: dict[str, float] = {"input_len": round(trace.mean("input_len")),
                                 "output_len": round(trace.mean("output_len")),
                                 "prefix_len": round(trace.mean("prefix_len"))}
    if trace.is_offline or trace.span_s == 0:
        traffic["concurrency"] = float(len(trace.requests))
    else:
        traffic["request_rate"] = len(trace.requests) / trace.span_s
    return {**flags, **traffic}


def traffic_flags(name: str, flags: dict) -> tuple[Trace, dict]:
    """`plan --traffic NAME`: its trace (planner/traffic.py) and the flags with its traffic as the search's workload.
    --request-rate R: 1,000 requests arriving at R req/s (Poisson); --concurrency N: a burst of N requests; neither:
    a burst of 1,000. The lengths are the traffic's: a length flag given too is refused."""
    from shardserve.planner.traffic import DEFAULT_NUM_REQUESTS, named_trace

    given = [key for key in ("input_len", "output_len", "prefix_len") if flags.get(key) is not None]
    if given:
        raise PlanError(f"--{given[0].replace('_', '-')} with --traffic {name}: the traffic has its own lengths; "
                        "give one of them")
    rate, concurrency = flags.get("request_rate"), flags.get("concurrency")
    if rate is not None and concurrency is not None:
        raise PlanError("--request-rate with --concurrency: give one of them")
    num = DEFAULT_NUM_REQUESTS if concurrency is None else max(1, round(concurrency))
    trace = named_trace(name, num, rate)
    rest = {key: value for key, value in flags.items() if key not in ("request_rate", "concurrency")}
    searched = workload_flags(trace, rest)
    return trace, searched if rate is None else {**searched, "request_rate": rate}


def with_replay(record: PlanFile, model: ModelInfo, trace: Trace, replica: Replica | None = None) -> PlanFile:
    """The plan with its estimates from the trace, replayed on its chosen layout, each step timed by `replica`
    (default: the plan's own; bench/accuracy.py passes one that schedules as another engine does). TTFT and
    end-to-end time include the request's way through the server (replica.request_ms), as the plan's own do."""
    from shardserve.planner.replay import replica_of
    from shardserve.runtime.core.replay import EngineShape, replay
    from shardserve.runtime.core.scheduler_config import SchedulerConfig

    rt, mem, par = record.runtime, record.memory, record.parallel
    longest = max(trace.requests, key=lambda r: r.input_len + r.output_len)
    if longest.input_len + longest.output_len > rt.max_model_len:
        raise PlanError(f"the trace {trace.source}: a request of {longest.input_len} + {longest.output_len} tokens is "
                        f"longer than max_model_len {rt.max_model_len}: plan with --max-model-len "
                        f"{longest.input_len + longest.output_len} or more")
    shape = EngineShape(SchedulerConfig(rt.max_num_seqs, rt.max_num_batched_tokens), mem.num_blocks, mem.block_size,
                        rt.enable_prefix_caching is not False, rt.max_model_len, par.data_parallel_size)
    began = time.perf_counter()
    replica = replica or replica_of(record, model)
    served = replay(trace.requests, replica, shape)
    seconds = time.perf_counter() - began
    est = record.estimates
    percentile = est.workload.percentile
    ttft = [s.ttft_s * 1000 + replica.request_ms for s in served]
    e2e = [s.e2e_s * 1000 + replica.request_ms for s in served]
    tpot = [s.tpot_s * 1000 for s in served if s.tpot_s is not None]
    itl = [(b - a) * 1000 for s in served for a, b in zip(s.token_times, s.token_times[1:])]
    tokens = sum(len(s.token_times) for s in served)
    span = max(s.token_times[-1] for s in served) - trace.requests[0].arrival_s
    num_gpus = par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size
    tpot_at = _at(tpot, percentile) if tpot else est.tpot_ms
    estimates = dataclasses.replace(
        est, ttft_ms=_at(ttft, percentile), tpot_ms=tpot_at, output_tokens_per_s=tokens / span,
        output_tokens_per_s_per_gpu=tokens / span / num_gpus, output_tokens_per_s_per_user=1000 / tpot_at,
        percentiles=PercentilesSection(_spread(ttft), _spread(tpot) if tpot else None,
                                       _spread(itl) if itl else None, _spread(e2e)),
        trace=TraceSection(trace.source, len(served), trace.is_offline, tokens / span, round(seconds, 3)))
    return dataclasses.replace(record, estimates=estimates, warnings=record.warnings + _misses(record, estimates))


def _spread(values: list[float]) -> Spread:
    return Spread(*(round(v, 3) for v in spread(values)))


def _at(values: list[float], percentile: int) -> float:
    return at_percentile(sorted(values), percentile)


def _misses(record: PlanFile, est) -> tuple[str, ...]:
    """The service targets the replayed trace misses at their percentile (the search met them on its means)."""
    targets = Targets(record.service.ttft_ms, record.service.tpot_ms)
    p = est.workload.percentile
    return tuple(f"the trace replayed at p{p}: {miss}" for miss in targets.misses(est.ttft_ms, est.tpot_ms))
