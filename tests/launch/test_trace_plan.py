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


def test_the_replay_decides_among_the_searchs_best_layouts(tmp_path):
    """Eight GPUs and a model that needs two or more: the layouts keeping them all busy are each replayed, the plan
    says which with their numbers and why its own won, and how long planning took."""
    result = CliRunner().invoke(app, ["plan", "meta-llama/Llama-3.1-70B-Instruct", "--hardware", "8xH100-80GB",
                                      "--trace", poisson_trace(tmp_path / "t.jsonl", num=200), "--format", "json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    trace = record["estimates"]["trace"]
    assert 1 < trace["num_layouts_replayed"] <= 4 and 0 < trace["replay_seconds"] <= trace["plan_seconds"] < 60
    replayed, why = record["rationale"][-2:]
    assert replayed.startswith(f"the trace replayed on the search's best {trace['num_layouts_replayed']} layouts (")
    par = record["parallel"]
    chosen = f"tp {par['tensor_parallel_size']} x pp {par['pipeline_parallel_size']} x dp {par['data_parallel_size']}"
    assert replayed.count("output tok/s") == trace["num_layouts_replayed"] and chosen in replayed
    assert why.startswith(f"{chosen} won: with as many GPUs busy, the most output tok/s in the replay")


def test_a_plan_written_before_the_trace_said_its_layouts_and_seconds_reads(tmp_path):
    from shardserve.planner.plan_file import PlanFile

    result = plan("--trace", poisson_trace(tmp_path / "t.jsonl", num=30), "--format", "json")
    data = json.loads(result.output)
    for key in ("num_layouts_replayed", "plan_seconds"):
        del data["estimates"]["trace"][key]
    trace = PlanFile.from_dict(data, "old.yaml").estimates.trace
    assert trace is not None and trace.num_layouts_replayed == 1 and trace.plan_seconds is None


def test_a_long_trace_is_replayed_on_fewer_layouts(tmp_path, monkeypatch):
    """As many layouts as replay MAX_REPLAYED_REQUESTS requests in all (here 300: one of a 200-request trace)."""
    from shardserve.launch import trace_plan

    monkeypatch.setattr(trace_plan, "MAX_REPLAYED_REQUESTS", 300)
    result = CliRunner().invoke(app, ["plan", "meta-llama/Llama-3.1-70B-Instruct", "--hardware", "8xH100-80GB",
                                      "--trace", poisson_trace(tmp_path / "t.jsonl", num=200), "--format", "json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert record["estimates"]["trace"]["num_layouts_replayed"] == 1
    replayed, why = record["rationale"][-2:]
    assert "(of 4: as many as replay 300 requests in all)" in replayed
    assert why == "the search's choice: the trace is too long to replay another layout beside it"
