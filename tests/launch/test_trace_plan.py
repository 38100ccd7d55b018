"""`plan --trace FILE` (issue 42): the layout is searched on the trace's means, then the trace is replayed through
the engine's scheduler on the chosen layout: the estimates are its percentiles and the rate it is served at."""

from __future__ import annotations

import json
import random

from typer.testing import CliRunner

from shardserve.launch.cli import app

MODEL = ("meta-llama/Llama-3.1-8B-Instruct", "--hardware", "H100-80GB")


def plan(*args: str):
    return CliRunner().invoke(app, ["plan", *MODEL, *args])


def poisson_trace(path, num: int = 300, rate: float = 10.0, shared: int = 0) -> str:
    rng, clock, lines = random.Random(1), 0.0, []
    for i in range(num):
        clock += rng.expovariate(rate)
        row = {"arrival_s": round(clock, 4), "input_len": rng.randint(50, 900), "output_len": rng.randint(20, 400)}
        if shared:
            row.update(prefix_id="system", prefix_len=shared)
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_trace_gives_percentiles_and_the_rate_it_is_served_at(tmp_path):
    result = plan("--trace", poisson_trace(tmp_path / "t.jsonl"), "--format", "json")
    assert result.exit_code == 0, result.output
    est = json.loads(result.output)["estimates"]
    assert est["trace"]["num_requests"] == 300 and not est["trace"]["offline"] and est["trace"]["replay_seconds"] < 30
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        spread = est["percentiles"][name]
        assert 0 < spread["p50"] <= spread["p90"] <= spread["p99"], (name, spread)
    assert round(est["ttft_ms"], 3) == est["percentiles"]["ttft_ms"]["p50"]  # (the plan's percentile: 50)
    assert est["output_tokens_per_s"] == est["trace"]["output_tokens_per_s"]
    workload = est["workload"]
    assert 400 < workload["input_len"] < 550 and 9 < workload["request_rate"] < 11  # the trace's means


def test_a_shared_prefix_lowers_ttft(tmp_path):
    plain = json.loads(plan("--trace", poisson_trace(tmp_path / "a.jsonl"), "--format", "json").output)
    shared = json.loads(plan("--trace", poisson_trace(tmp_path / "b.jsonl", shared=48), "--format", "json").output)
    assert shared["estimates"]["percentiles"]["ttft_ms"]["p50"] < plain["estimates"]["percentiles"]["ttft_ms"]["p50"]


def test_the_table_shows_the_replay(tmp_path):
    result = plan("--trace", poisson_trace(tmp_path / "t.jsonl", num=50))
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and "The trace replayed through the engine's scheduler: 50 requests" in text


def test_refusals_name_what_to_change(tmp_path):
    trace = poisson_trace(tmp_path / "t.jsonl", num=20)
    result = plan("--trace", trace, "--input-len", "100")
    assert result.exit_code == 1 and "--input-len with --trace" in result.output
    (tmp_path / "long.jsonl").write_text('{"arrival_s": 0, "input_len": 100, "output_len": 50}\n'
                                         '{"arrival_s": 1, "input_len": 3000, "output_len": 200}\n')
    result = plan("--trace", str(tmp_path / "long.jsonl"), "--max-model-len", "2048")  # the means fit; one does not
    assert result.exit_code == 1 and "--max-model-len 3200 or more" in " ".join(result.output.split())
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0, "input_len": 10}\n')
    result = plan("--trace", str(tmp_path / "bad.jsonl"))
    assert result.exit_code == 1 and "bad.jsonl, line 1: output_len: missing" in " ".join(result.output.split())
