"""Traces as teams record them (issue 42): JSON lines or CSV, one request a line; a bad line names the file, the
line and the field."""

from __future__ import annotations

import json

import pytest

from shardserve.planner import PlanError
from shardserve.planner.trace import TraceRequest, read_trace, spread


def write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_json_lines_and_csv_read_alike(tmp_path):
    rows = [{"arrival_s": 0.5, "input_len": 100, "output_len": 20, "prefix_id": "sys", "prefix_len": 64},
            {"arrival_s": 0.0, "input_len": 7, "output_len": 3}]
    from_json = read_trace(write(tmp_path / "t.jsonl", rows))
    (tmp_path / "t.csv").write_text("arrival_s,input_len,output_len,prefix_id,prefix_len\n0.5,100,20,sys,64\n0,7,3,,\n")
    from_csv = read_trace(tmp_path / "t.csv")
    assert from_json.requests == from_csv.requests == (TraceRequest(0.0, 7, 3), TraceRequest(0.5, 100, 20, "sys", 64))
    assert not from_json.is_offline and from_json.span_s == 0.5 and from_json.mean("input_len") == 53.5


@pytest.mark.parametrize("row, named", [
    ({"arrival_s": 0, "input_len": 0, "output_len": 1}, "line 2: input_len: 0 must be a whole number of tokens"),
    ({"arrival_s": "soon", "input_len": 1, "output_len": 1}, "line 2: arrival_s: 'soon' is not a number"),
    ({"arrival_s": -1, "input_len": 1, "output_len": 1}, "line 2: arrival_s: -1 must be a finite number"),
    ({"arrival_s": 0, "input_len": 1}, "line 2: output_len: missing"),
    ({"arrival_s": 0, "input_len": 1, "output_len": 2.5}, "line 2: output_len: 2.5 must be a whole number"),
    ({"arrival_s": 0, "input_len": 1, "output_len": 1, "prompt": "hi"}, "line 2: prompt: not a trace column"),
    ({"arrival_s": 0, "input_len": 8, "output_len": 1, "prefix_len": 4}, "line 2: prefix_len without prefix_id"),
    ({"arrival_s": 0, "input_len": 8, "output_len": 1, "prefix_id": "a", "prefix_len": 9},
     "line 2: prefix_len 9 is more than input_len 8"),
])
def test_a_bad_line_names_the_file_the_line_and_the_field(tmp_path, row, named):
    path = write(tmp_path / "t.jsonl", [{"arrival_s": 0, "input_len": 1, "output_len": 1}, row])
    with pytest.raises(PlanError) as error:
        read_trace(path)
    assert str(error.value).startswith(f"{path}, {named}"), str(error.value)


def test_an_empty_or_missing_trace_is_refused(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(PlanError, match="no requests in it"):
        read_trace(tmp_path / "e.jsonl")
    with pytest.raises(PlanError, match="no such file"):
        read_trace(tmp_path / "none.jsonl")


def test_spread_is_linear_between_ranks():
    assert spread(list(range(101))) == (50, 90, 99)
    assert spread([5.0]) == (5.0, 5.0, 5.0)
