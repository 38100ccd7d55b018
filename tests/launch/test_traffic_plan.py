"""`plan --traffic sharegpt` (issue 42): a plan for ShareGPT's lengths, replayed as a trace is."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from shardserve.launch.cli import app
from shardserve.planner.traffic import load_lengths

MODEL = ("meta-llama/Llama-3.1-8B-Instruct", "--hardware", "H100-80GB")


def plan(*args: str):
    return CliRunner().invoke(app, ["plan", *MODEL, *args])


def test_sharegpt_at_a_rate_plans_on_its_lengths_with_percentiles():
    result = plan("--traffic", "sharegpt", "--request-rate", "8", "--format", "json")
    assert result.exit_code == 0, result.output
    est = json.loads(result.output)["estimates"]
    assert est["trace"]["num_requests"] == 1000 and not est["trace"]["offline"]
    assert est["trace"]["source"].startswith("sharegpt (1,000 requests Poisson 8 req/s")
    workload, lengths = est["workload"], load_lengths("sharegpt")
    assert workload["request_rate"] == 8.0
    assert abs(workload["input_len"] - lengths.mean("input_len")) < 0.1 * lengths.mean("input_len")
    assert abs(workload["output_len"] - lengths.mean("output_len")) < 0.1 * lengths.mean("output_len")
    ttft = est["percentiles"]["ttft_ms"]
    assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]


def test_concurrency_is_a_closed_loop_of_that_many_in_flight():
    """As vLLM's bench serve --max-concurrency 64: the 1,000 requests, 64 in flight, not a burst of 64."""
    result = plan("--traffic", "sharegpt", "--concurrency", "64", "--format", "json")
    assert result.exit_code == 0, result.output
    est = json.loads(result.output)["estimates"]
    assert est["trace"]["num_requests"] == 1000 and est["trace"]["concurrency"] == 64
    assert "64 in flight (a closed loop)" in est["trace"]["source"] and est["workload"]["concurrency"] == 64
    burst = json.loads(plan("--traffic", "sharegpt", "--format", "json").output)["estimates"]
    assert burst["trace"]["num_requests"] == 1000 and "concurrency" not in burst["trace"]
    # 64 at a time wait far less for their first token than 1,000 at once, and each decodes in a smaller batch
    assert est["percentiles"]["ttft_ms"]["p50"] < burst["percentiles"]["ttft_ms"]["p50"] / 10
    assert est["percentiles"]["tpot_ms"]["p50"] < burst["percentiles"]["tpot_ms"]["p50"]
    table = plan("--traffic", "sharegpt", "--concurrency", "64").output  # the table says which load it replayed
    assert "64 in flight, the next sent as one finishes" in " ".join(table.split()) and "(offline)" not in table


def test_refusals_name_what_to_change(tmp_path):
    result = plan("--traffic", "sharegpt", "--input-len", "100")
    assert result.exit_code == 1 and "--input-len with --traffic sharegpt" in " ".join(result.output.split())
    (tmp_path / "t.jsonl").write_text('{"arrival_s": 0, "input_len": 100, "output_len": 50}\n')
    result = plan("--traffic", "sharegpt", "--trace", str(tmp_path / "t.jsonl"))
    assert result.exit_code == 1 and "--trace with --traffic sharegpt" in " ".join(result.output.split())
    result = plan("--traffic", "lmsys")
    assert result.exit_code == 1 and "no such traffic (named: sharegpt)" in " ".join(result.output.split())


@pytest.mark.slow
def test_planning_for_named_traffic_imports_no_torch():
    code = ("import sys; from typer.testing import CliRunner; from shardserve.launch.cli import app; "
            f"r = CliRunner().invoke(app, ['plan', *{list(MODEL)!r}, '--traffic', 'sharegpt', '--concurrency', '50']); "
            "assert r.exit_code == 0, r.output; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
