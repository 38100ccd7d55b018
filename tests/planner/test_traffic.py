"""Named traffic (issue 42): a trace drawn from ShareGPT's shipped lengths, for teams without a trace."""

from __future__ import annotations

import json

import pytest

from shardserve.planner import PlanError
from shardserve.planner.traffic import TRAFFIC_DIR, load_lengths, named_trace, traffic_names


def test_the_shipped_lengths_are_what_their_header_says():
    lengths = load_lengths("sharegpt")
    header = json.loads((TRAFFIC_DIR / "sharegpt.json").read_text())
    assert header["count"] == len(lengths.pairs) > 10_000 and "sharegpt" in traffic_names()
    for column, field in ((0, "input_len"), (1, "output_len")):
        values = [pair[column] for pair in lengths.pairs]
        assert round(sum(values) / len(values), 2) == header[field]["mean"]
        assert min(values) >= 4
    assert max(i for i, _ in lengths.pairs) <= 1024 and max(i + o for i, o in lengths.pairs) <= 2048
    # the figures for ShareGPT in Llama-3 tokens
    assert 210 < lengths.mean("input_len") < 230 and 190 < lengths.mean("output_len") < 205


def test_every_pair_once_has_the_header_means_and_a_sample_comes_near():
    lengths = load_lengths("sharegpt")
    whole = named_trace("sharegpt", len(lengths.pairs))
    assert round(whole.mean("input_len"), 2) == lengths.mean("input_len")
    assert round(whole.mean("output_len"), 2) == lengths.mean("output_len")
    sample = named_trace("sharegpt")
    assert len(sample.requests) == 1000 and sample.is_offline
    for field in ("input_len", "output_len"):
        assert sample.mean(field) == pytest.approx(lengths.mean(field), rel=0.1)


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    trace = named_trace("sharegpt", 2000, request_rate=8.0)
    assert trace.requests[0].arrival_s == 0 and not trace.is_offline
    assert len(trace.requests) / trace.span_s == pytest.approx(8.0, rel=0.05)
    assert trace == named_trace("sharegpt", 2000, request_rate=8.0) != named_trace("sharegpt", 2000, 8.0, seed=1)
    more = named_trace("sharegpt", 20_000)  # more than the pairs: drawn again
    assert len(more.requests) == 20_000


def test_an_unknown_name_or_no_requests_is_refused():
    with pytest.raises(PlanError, match="no such traffic .named: .*sharegpt"):
        named_trace("lmsys")
    with pytest.raises(PlanError, match="at least 1"):
        named_trace("sharegpt", 0)


def test_a_concurrency_makes_a_closed_loop_of_that_many():
    """--concurrency N as vLLM's bench serve --max-concurrency N sends its list: N in flight, not a burst of N."""
    trace = named_trace("sharegpt", 1000, concurrency=64)
    assert len(trace.requests) == 1000 and trace.concurrency == 64
    assert trace.source == "sharegpt (1,000 requests 64 in flight (a closed loop), seed 0)"
    assert named_trace("sharegpt").concurrency is None
    with pytest.raises(PlanError, match="give one of them"):
        named_trace("sharegpt", 10, request_rate=1.0, concurrency=4)
    with pytest.raises(PlanError, match="at least 1 request in flight"):
        named_trace("sharegpt", 10, concurrency=0)
