"""`plan --plot FILE` (issue 42): the layouts' Pareto front with the plan marked, and with --trace the replayed
latency percentiles, as a PNG or an SVG; nothing half-written."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from shardserve.launch.cli import app


def plan(*args: str):
    return CliRunner().invoke(app, ["plan", "meta-llama/Llama-3.1-70B-Instruct", "--hardware", "8xH100-80GB", *args])


def test_a_png_and_an_svg(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i / 4, "input_len": 300 + i, "output_len": 50}) + "\n"
                             for i in range(40)))
    result = plan("--trace", str(trace), "--tpot-ms", "40", "--plot", str(tmp_path / "plan.png"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = plan("--plot", str(tmp_path / "plan.svg"))
    assert result.exit_code == 0, result.output
    svg = (tmp_path / "plan.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.png", "plan.svg", "t.jsonl"]  # no temporary left


def test_a_file_of_another_kind_is_refused(tmp_path):
    result = plan("--plot", str(tmp_path / "plan.pdf"))
    assert result.exit_code == 1 and "a .png or .svg file" in result.output
    assert not (tmp_path / "plan.pdf").exists()
