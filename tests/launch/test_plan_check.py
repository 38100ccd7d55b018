"""The server's self-check against the plan (a clock injected), and the TPOT histogram on /metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from shardserve.launch.server.plan_check import MIN_REQUESTS, FinishedRequest, PlanCheck, Prediction, percentile
from tests.launch.conftest import MODEL, http

PLAN = Prediction(ttft_ms=200.0, tpot_ms=20.0, percentile=50, input_len=1000, output_len=100, concurrency=16.0,
                  request_rate=None)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def finished(ttft_ms: float, tpot_ms: float, num: int, prompt: int = 1000, output: int = 100) -> list[FinishedRequest]:
    """num requests around the given latencies (+-10%), each with prompt and output tokens."""
    spread = [0.9 + 0.2 * i / max(1, num - 1) for i in range(num)]
    return [FinishedRequest(ttft_ms * s / 1e3, tpot_ms * s / 1e3, (ttft_ms + tpot_ms * (output - 1)) * s / 1e3,
                            prompt, output) for s in spread]


def run_window(requests: list[FinishedRequest], caplog, plan: Prediction = PLAN):
    clock = Clock()
    check = PlanCheck(plan, clock)
    for r in requests:
        check.record(r)
    clock.now += 30
    assert check.tick() is None  # the window is not over yet
    clock.now += 30
    with caplog.at_level(logging.INFO, logger="shardserve.launch.server.plan_check"):
        report = check.tick()
    return report, [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "shardserve.launch.server.plan_check"]


def test_fewer_than_eight_requests_in_a_minute_log_nothing(caplog):
    report, lines = run_window(finished(200, 20, MIN_REQUESTS - 1), caplog)
    assert report is None and lines == []


def test_a_workload_as_planned_logs_one_info_line(caplog):
    report, lines = run_window(finished(200, 20, 31), caplog)
    assert [level for level, _ in lines] == ["INFO"]
    text = lines[0][1]
    assert "31 requests" in text and "0.52 req/s" in text and "1000 prompt / 100 output tokens" in text
    assert "TTFT p50 200.0 ms" in text and "plan p50 200.0 ms" in text and "TPOT p50 20.0 ms" in text
    assert "p90" in text and "the plan is for 1000 prompt / 100 output tokens, 16 in flight" in text
    assert report.num_requests == 31 and report.warnings == ()


def test_a_tpot_twice_the_plan_warns_naming_tpot_and_both_numbers(caplog):
    report, lines = run_window(finished(200, 40, 13), caplog)
    assert [level for level, _ in lines] == ["INFO", "WARNING"]
    warning = lines[1][1]
    assert "TPOT" in warning and "40.0 ms" in warning and "20.0 ms" in warning and "100% above" in warning
    assert "TTFT" not in warning  # TTFT is as planned


def test_a_fast_ttft_beyond_the_tolerance_warns_too_and_requests_are_not_counted_twice(caplog):
    clock = Clock()
    check = PlanCheck(PLAN, clock)
    for r in finished(100, 20, 11):
        check.record(r)
    clock.now += 60
    with caplog.at_level(logging.WARNING, logger="shardserve.launch.server.plan_check"):
        assert check.tick().warnings[0].startswith("measured TTFT p50 100.0 ms is 50% below 200.0 ms, the plan's "
                                                   "estimate for 1000 prompt / 100 output tokens, 16 in flight")
    clock.now += 60
    assert check.tick() is None  # the next window has no requests of its own


def test_an_overloaded_plan_has_no_ttft_to_compare(caplog):
    """A plan whose rate outruns it (TTFT unbounded, null in the file): TPOT is still checked, TTFT never."""
    overloaded = dataclasses.replace(PLAN, ttft_ms=None, concurrency=None, request_rate=100.0)
    report, lines = run_window(finished(5000, 40, 13), caplog, overloaded)
    assert [level for level, _ in lines] == ["INFO", "WARNING"]
    assert "(plan p50 unbounded)" in lines[0][1] and lines[1][1].startswith("measured TPOT p50")
    assert [w.split(" p50")[0] for w in report.warnings] == ["measured TPOT"]


def test_the_plan_percentile_is_the_one_compared():
    requests = [FinishedRequest(0.2, 0.02, 2.0, 1000, 100)] * 10 + [FinishedRequest(0.2, 0.06, 6.0, 1000, 100)] * 2
    assert PlanCheck(PLAN, Clock()).report(requests, 60.0).warnings == ()  # p50: 20 ms as planned
    report = PlanCheck(dataclasses.replace(PLAN, percentile=90), Clock()).report(requests, 60.0)
    assert report.tpot_ms[90] == pytest.approx(60.0)
    assert report.warnings[0].startswith("measured TPOT p90 60.0 ms is 200% above 20.0 ms, the plan's estimate")
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 90) == 4


def test_run_ticks_on_the_event_loop_until_cancelled(caplog):
    check = PlanCheck(PLAN, window_seconds=0.1)  # the real clock, a short window

    async def serve_a_while():
        task = asyncio.create_task(check.run())
        for r in finished(200, 20, MIN_REQUESTS):
            check.record(r)
        await asyncio.sleep(0.35)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.INFO, logger="shardserve.launch.server.plan_check"):
        asyncio.run(serve_a_while())
    lines = [r.getMessage() for r in caplog.records if r.name == "shardserve.launch.server.plan_check"]
    assert lines[0].startswith("checking TTFT and TPOT against the plan's (p50 200.0 ms and 20.0 ms")
    assert sum(line.startswith("plan check, last 0 s: 8 requests") for line in lines) == 1  # once, then idle


def test_the_prediction_comes_from_the_plan_file():
    from shardserve.planner.plan_file import PlanFile
    from tests.planner.factories import plan_for

    record: PlanFile = plan_for("meta-llama/Llama-3.1-8B-Instruct", "1xH100-80GB").record()
    workload = dataclasses.replace(record.estimates.workload, input_len=512, output_len=64, concurrency=8.0,
                                   request_rate=None)
    record = dataclasses.replace(record, estimates=dataclasses.replace(record.estimates, ttft_ms=123.0, tpot_ms=9.5,
                                                                       workload=workload))
    prediction = Prediction.from_plan(record)
    p = prediction
    assert (p.ttft_ms, p.tpot_ms, p.input_len, p.output_len) == (123.0, 9.5, 512, 64)
    assert prediction.describe_workload() == "512 prompt / 64 output tokens, 8 in flight"


@pytest.mark.slow
def test_metrics_have_the_tpot_histogram_after_a_request(server, client):
    client.completions.create(model=MODEL, prompt="The function returns", max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    text = http(f"{server}/metrics")[1]
    assert "vllm:request_time_per_output_token_seconds_bucket" in text
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:request_time_per_output_token_seconds_count")]
    sums = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:request_time_per_output_token_seconds_sum")]
    assert sum(counts) >= 1 and sum(sums) > 0


def test_the_check_asks_the_plans_speed_model_for_the_traffic_seen(caplog):
    """Shorter prompts than planned: the plan's own model (from the plan file) predicts them, so traffic
    at that prediction passes and a 2x slower TPOT warns against it, not against the planned workload."""
    from shardserve.launch.server.plan_check import for_traffic
    from shardserve.planner import PlanOptions, load_model, make_plan, parse_declared

    model = load_model("meta-llama/Llama-3.1-8B-Instruct")
    plan = make_plan(model, parse_declared("H100-80GB"), PlanOptions(concurrency=16, input_len=4000,
                                                                     output_len=500)).record()
    expected = for_traffic(plan, model)
    clock = Clock()
    # 13 requests of 500 in / 100 out in 60 s, each about 3 s long: 0.65 in flight
    ttft, tpot = expected(500, 100, 1.0)
    assert ttft < plan.estimates.ttft_ms and tpot < plan.estimates.tpot_ms  # less work than planned
    for slow in (1.0, 2.0):
        check = PlanCheck(Prediction.from_plan(plan), clock, for_traffic=expected)
        for r in finished(ttft, tpot * slow, 13, prompt=500, output=100):
            check.record(r)
        clock.now += 60
        report = check.tick()
        assert [w.split(" ms")[0] for w in report.warnings] == ([] if slow == 1.0 else [
            f"measured TPOT p50 {report.tpot_ms[50]:.1f}"])
    assert "the plan's speed model for the traffic seen" in report.warnings[0]


REPLAYED = dataclasses.replace(PLAN, ttft_percentiles={50: 200.0, 90: 400.0, 99: 800.0},
                               tpot_percentiles={50: 20.0, 90: 22.0, 99: 24.0})


def spread_window(num: int, ttft_ms: tuple[float, float, float], tpot_ms: float = 20.0) -> list[FinishedRequest]:
    """num requests: TTFT at the first value for half of them, the second up to the p90, the third above it."""
    ttfts = [ttft_ms[0] if i < num // 2 else ttft_ms[1] if i < num * 9 // 10 else ttft_ms[2] for i in range(num)]
    return [FinishedRequest(t / 1e3, tpot_ms / 1e3, (t + tpot_ms * 99) / 1e3, 1000, 100) for t in ttfts]


def test_a_plan_from_a_trace_is_checked_at_each_of_its_percentiles(caplog):
    """A replayed trace's p50, p90 and p99: TTFT as planned at p50 but twice it at p90 warns at p90; the p99 is
    compared once the window holds 100 requests (below, a p99 is only the slowest request)."""
    report, lines = run_window(spread_window(20, (200.0, 800.0, 800.0)), caplog, REPLAYED)
    assert [w.split(" ms")[0] for w in report.warnings] == ["measured TTFT p90 800.0"]
    assert "400.0 ms, the plan's p90 from its replayed trace (1000 prompt / 100 output tokens, 16 in flight)" in \
        report.warnings[0]
    assert "(plan p50 200.0 ms p90 400.0 ms p99 800.0 ms)" in lines[0][1] and "TTFT p50 200.0 ms" in lines[0][1]
    assert 99 in report.ttft_ms
    report = PlanCheck(REPLAYED, Clock()).report(spread_window(100, (200.0, 400.0, 3000.0)), 60.0)
    assert [w.split(" ms")[0] for w in report.warnings] == ["measured TTFT p99 3000.0"]
    assert PlanCheck(REPLAYED, Clock()).report(spread_window(100, (200.0, 400.0, 800.0)), 60.0).warnings == ()


def test_a_plan_from_a_trace_is_checked_against_its_percentiles_not_the_speed_model():
    """The replay's percentiles are the plan's word on its traffic: the means' speed model is not asked."""
    asked = []
    check = PlanCheck(REPLAYED, Clock(), for_traffic=lambda i, o, n: asked.append(1) or (10.0, 1.0))
    assert check.report(spread_window(20, (200.0, 400.0, 400.0)), 60.0).warnings == () and not asked


def test_the_percentiles_come_from_the_plan_file(tmp_path):
    from shardserve.planner.plan_file import PercentilesSection, Spread
    from tests.planner.factories import plan_for

    record = plan_for("meta-llama/Llama-3.1-8B-Instruct", "1xH100-80GB").record()
    assert Prediction.from_plan(record).ttft_percentiles is None  # a plan without a trace: its estimates alone
    spread = PercentilesSection(Spread(100.0, 150.0, 300.0), Spread(10.0, 12.0, 20.0), None, Spread(1.0, 2.0, 3.0))
    replayed = dataclasses.replace(record, estimates=dataclasses.replace(record.estimates, percentiles=spread))
    p = Prediction.from_plan(replayed)
    assert p.ttft_percentiles == {50: 100.0, 90: 150.0, 99: 300.0} and p.tpot_percentiles == {50: 10.0, 90: 12.0,
                                                                                               99: 20.0}


def test_speculation_far_from_the_plans_acceptance_is_named_with_the_rate_to_plan_with(caplog):
    """The window's tokens per forward (its output tokens over those less the drafts accepted in it) against the
    plan's 1 + a + ... + a^k; the engines' counter is read at each window's end."""
    from tests.planner.factories import plan_for

    record = plan_for("meta-llama/Llama-3.1-8B-Instruct", "1xH100-80GB", concurrency=4.0,
                      speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').record()
    plan = Prediction.from_plan(record)
    assert (plan.num_speculative_tokens, plan.draft_acceptance_rate) == (3, 0.7)
    clock, counter = Clock(), [0]
    check = PlanCheck(dataclasses.replace(plan, ttft_ms=200.0, tpot_ms=20.0), clock, accepted_tokens=lambda: counter[0])
    counter[0], clock.now = 500, clock.now + 60  # a quiet window (too few requests to report) still moves the mark
    assert check.tick() is None
    for r in finished(200, 20, 10):  # 1,000 tokens, 250 of them accepted drafts: 4/3 tokens per forward
        check.record(r)
    counter[0] += 250
    clock.now += 60
    with caplog.at_level(logging.INFO, logger="shardserve.launch.server.plan_check"):
        report = check.tick()
    assert report.tokens_per_forward == pytest.approx(1000 / 750)
    (warning,) = [w for w in report.warnings if "tokens per forward" in w]
    assert "1.33 tokens per forward" in warning and "plan's 2.53" in warning
    assert "--draft-acceptance-rate 0.25" in warning  # 1 + a + a^2 + a^3 = 4/3
    assert "1.33 tokens per forward (plan 2.53)" in caplog.text
    # as planned: no warning; an engine restarted (its counter went back): nothing measured
    for r in finished(200, 20, 10):
        check.record(r)
    counter[0] += 605
    clock.now += 60
    report = check.tick()
    assert not [w for w in report.warnings if "tokens per forward" in w]
    counter[0] = 3
    for r in finished(200, 20, 10):
        check.record(r)
    clock.now += 60
    assert check.tick().tokens_per_forward is None
