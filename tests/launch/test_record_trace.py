"""`launch --record-trace FILE` writes the traffic it serves as a trace (lengths, arrivals, prefix digests, never
text), which `plan --trace` replays: re-plan from yesterday's traffic (issue 42)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from shardserve.launch.cli import app
from tests.launch.conftest import MODEL, http, serving, start_server

pytestmark = pytest.mark.slow  # a server

SHARED = "You are a helpful assistant who answers in one short sentence about lists and loops. " * 2
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "served.jsonl"
    gen = serving("--profile", "demo", "--record-trace", str(path), "--speculative-config", NGRAM)
    url = next(gen)
    yield url, path
    for _ in gen:
        pass


def test_what_is_served_is_written_and_plans_again(recorded):
    url, path = recorded
    for i, max_tokens in enumerate((5, 9, 3)):
        status, text = http(f"{url}/v1/completions", {"model": MODEL, "prompt": SHARED + f"Question {i}?",
                                                      "max_tokens": max_tokens, "ignore_eos": True})
        assert status == 200, text
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["output_len"] for row in lines] == [5, 9, 3]
    assert lines[0]["arrival_s"] == 0 and lines[0]["arrival_s"] <= lines[1]["arrival_s"] <= lines[2]["arrival_s"]
    assert all(row["input_len"] == lines[0]["input_len"] for row in lines)  # (the questions tokenize alike)
    assert "prefix_id" not in lines[0]  # the first found nothing cached; the others found the shared blocks
    assert lines[1]["prefix_id"] == lines[2]["prefix_id"] and lines[1]["prefix_len"] >= 16
    assert "helpful" not in path.read_text()
    # speculative decoding's counts for each request that drafted (prompt lookup: its repeated prompt)
    counted = [row for row in lines if "num_drafts" in row]
    assert counted and all(row["num_draft_tokens"] >= row["num_drafts"] >= 1 for row in counted)
    result = CliRunner().invoke(app, ["plan", "shardserve-demo", "--hardware", "cpu", "--trace", str(path),
                                      "--format", "json", "--speculative-config", NGRAM])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["estimates"]["trace"]["num_requests"] == 3
    steps = sum(row["num_drafts"] for row in counted)  # the rate the served traffic ran at, not n-gram's default
    assert any(line.startswith("draft_acceptance_rate ") and f"measured in the trace ({steps:,} verify steps" in line
               for line in plan["rationale"])


def test_an_existing_file_is_not_overwritten(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text('{"arrival_s": 0, "input_len": 1, "output_len": 1}\n')
    with pytest.raises(RuntimeError, match="server exited with 1") as error:
        start_server("--profile", "demo", "--record-trace", str(path))
    assert "the file exists; remove it or name another" in str(error.value) and "Traceback" not in str(error.value)
    assert path.read_text().count("\n") == 1
