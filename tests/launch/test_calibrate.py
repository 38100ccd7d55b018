"""`shardserve calibrate` on this CPU at tiny sizes: the file it writes is the planner's format, its
numbers grow with the work, and a malformed calibration file is refused naming the key."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardserve.planner.calibration import (CalibrationError, calibration_dir, calibration_path, read_calibration,
                                            write_calibration)

GOOD = {"gpu": "CPU", "source": "shardserve calibrate test",
        "tables": {"gemm.float32": {"axes": [["m", [1, 2]], ["n", [8]], ["k", [8]]], "ms": [0.1, None]},
                   "allreduce": {"axes": [["num_gpus", [2]], ["bytes", [1024]]], "ms": [0.5]}},
        "host": {"step_ms": 0.3, "per_request_ms": 0.01}}


def cells(table: dict):
    """(coordinates by axis name, ms) for every cell of a table, in C order."""
    names = [name for name, _ in table["axes"]]
    for values, ms in zip(itertools.product(*(v for _, v in table["axes"])), table["ms"]):
        yield dict(zip(names, values)), ms


def test_the_calibration_folder_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibration_path("H100-80GB") == tmp_path / "shardserve" / "calibration" / "h100-80gb.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert calibration_dir() == Path.home() / ".cache" / "shardserve" / "calibration"


def test_a_written_file_reads_back(tmp_path):
    path = write_calibration(GOOD, tmp_path / "deep" / "cpu.json")
    assert read_calibration(path) == GOOD
    assert [p.name for p in path.parent.iterdir()] == ["cpu.json"]  # no temporary file left behind


@pytest.mark.parametrize("edit, named", [
    (lambda d: d.pop("gpu"), "gpu: expected a non-empty string"),
    (lambda d: d.update(tables={}), "tables: expected a mapping"),
    (lambda d: d["tables"].update({"gemm.int3": d["tables"]["gemm.float32"]}), "tables.gemm.int3: unknown table"),
    (lambda d: d["tables"]["gemm.float32"]["axes"].reverse(), "tables.gemm.float32.axes: expected [[name, values]"),
    (lambda d: d["tables"]["gemm.float32"]["axes"][0].__setitem__(1, [2, 1]),
     "tables.gemm.float32.axes.m: expected positive integers in ascending order"),
    (lambda d: d["tables"]["gemm.float32"].update(ms=[0.1]), "tables.gemm.float32.ms: expected 2 values"),
    (lambda d: d["tables"]["allreduce"].update(ms=[-1]), "tables.allreduce.ms[0]: expected milliseconds > 0"),
    (lambda d: d["host"].pop("per_request_ms"), "host: expected a mapping with step_ms and per_request_ms"),
    (lambda d: d["host"].update(step_ms="fast"), "host.step_ms: expected milliseconds >= 0"),
    (lambda d: d.update(gpus="CPU"), "gpus: unknown key"),
])
def test_a_malformed_file_is_refused_naming_the_key(tmp_path, edit, named):
    data = json.loads(json.dumps(GOOD))
    edit(data)
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CalibrationError, match=f"^{path}: ") as e:
        read_calibration(path)
    assert named in str(e.value)
    path.write_text("{not json")
    with pytest.raises(CalibrationError, match="not JSON"):
        read_calibration(path)


def test_operators_take_longer_with_more_work():
    from shardserve.runtime.timing import op_timing as ops
    from shardserve.runtime.attention.torch_backend import TorchAttentionBackend

    timer = ops.Timer(torch.device("cpu"))
    gemm = ops.gemm_table(ops.Grid.of(m=(1, 256), n=(32, 512), k=(32, 512)), torch.float32, timer)
    by_work = {c["m"] * c["n"] * c["k"]: ms for c, ms in cells(gemm.to_dict())}
    assert by_work[256 * 512 * 512] > 10 * by_work[32 * 32]
    decode = ops.attention_table(ops.Grid.of(
        head_dim=(64,), num_kv_heads=(2,), batch=(8,), context=(64, 2048)), ops.decode_shape, torch.float32,
        torch.float32, TorchAttentionBackend(), timer, use_graph=False)
    assert decode.ms[1] > decode.ms[0] > 0


def test_a_gemm_reads_a_weight_the_cache_does_not_hold():
    from shardserve.runtime.timing import op_timing as ops

    assert ops.cold_copies(1 << 20, 32 << 20) == 64  # twice a 32 MiB cache in 1 MiB weights
    assert ops.cold_copies(512 << 20, 50 << 20) == 1  # a weight bigger than the cache reads cold alone
    assert ops.cold_copies(1, 32 << 20) == ops.MAX_COPIES
    assert [ops._cache_size(t) for t in ("32768K\n", "1M", "512")] == [32 << 20, 1 << 20, 512]
    assert ops.last_level_cache_bytes(torch.device("cpu")) > 0
    used: list[int] = []
    rotating = ops.Rotating([lambda i=i: used.append(i) for i in range(3)])
    for _ in range(7):
        rotating()
    assert rotating.cycle == 3 and used == [0, 1, 2, 0, 1, 2, 0]  # each copy once per turn, in order
    # the table's call for a cell goes round the copies of its weight
    call = ops._matmul([ops._linear(8, 4, torch.float32, torch.device("cpu"), False) for _ in range(2)], 1,
                       torch.float32)
    first, second, third = call(), call(), call()
    assert not torch.equal(first, second) and torch.equal(first, third)
    # and attention goes round pools of its own, as each layer of a model reads its own KV
    from shardserve.runtime.attention.torch_backend import TorchAttentionBackend
    attend = ops.attention_call(ops.decode_shape(64, 2, 2, 40), torch.float32, torch.float32, TorchAttentionBackend(),
                                torch.device("cpu"), copies=3)
    with torch.inference_mode():
        outputs = [attend() for _ in range(4)]
    assert attend.cycle == 3 and not torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[3])


def test_host_time_is_fitted_as_a_line():
    from shardserve.runtime.timing.host_timing import fit_host

    fit = fit_host([(1, 0.31), (8, 0.38), (32, 0.63)])
    assert fit.step_ms == pytest.approx(0.3, abs=0.01) and fit.per_request_ms == pytest.approx(0.01, abs=0.001)
    assert fit_host([(1, 0.5), (8, 0.4)]).per_request_ms == 0.0  # noise never makes a step cheaper with more requests


def test_bad_options_are_refused_by_name():
    from typer.testing import CliRunner

    from shardserve.launch.cli import app
    for args, said in ((["--device", "tpu"], "--device tpu: one of auto, cpu, cuda"),
                       (["--sizes", "huge"], "--sizes huge: one of small, full"),
                       (["--device", "cuda"], "--device cuda: torch sees no CUDA device")):
        done = CliRunner().invoke(app, ["calibrate", *args])
        assert done.exit_code == 1 and said in " ".join(done.output.split()), done.output


@pytest.mark.slow
def test_calibrate_on_cpu_writes_the_file_plan_reads(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "shardserve.launch", "calibrate", "--tensor-parallel-size", "2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    path = tmp_path / "shardserve" / "calibration" / "cpu.json"
    assert f"calibration of CPU written to {path}" in " ".join(done.stdout.split())
    data = read_calibration(path)
    assert data["gpu"] == "CPU" and data["source"].startswith("shardserve calibrate ")
    assert f"torch {torch.__version__}" in data["source"]
    tables = data["tables"]
    assert sorted(tables) == ["allreduce", "decode_attention.float32", "gemm.float32", "prefill_attention.float32"]
    assert [name for name, _ in tables["decode_attention.float32"]["axes"]] == [
        "head_dim", "num_kv_heads", "batch", "context"]
    assert tables["allreduce"]["axes"][0] == ["num_gpus", [2]]
    for table in tables.values():
        assert all(ms is not None and ms > 0 for ms in table["ms"])
    gemm = sorted((c["m"] * c["n"] * c["k"], ms) for c, ms in cells(tables["gemm.float32"]))
    half = len(gemm) // 2
    assert statistics.mean(ms for _, ms in gemm[half:]) > statistics.mean(ms for _, ms in gemm[:half])
    assert gemm[-1][1] > gemm[0][1]
    decode = list(cells(tables["decode_attention.float32"]))
    longest, shortest = (statistics.median(ms for c, ms in decode if c["context"] == n) for n in (1024, 128))
    assert longest >= 0.8 * shortest  # a longer context is not faster
    assert data["host"]["step_ms"] > 0 and data["host"]["per_request_ms"] >= 0 and data["host"]["eager_layer_ms"] >= 0
    assert "eager decoder layer: " in done.stdout
    # a real server of the micro model answered: its time outside the engine's steps
    assert 0 < data["host"]["request_ms"] < 1000 and "request: " in done.stdout
    # and its API process's CPU time: a request costs it more than one streamed token does
    assert data["host"]["api_request_ms"] > data["host"]["api_token_ms"] > 0 and "the API process: " in done.stdout


@pytest.mark.slow
def test_a_server_that_does_not_come_up_is_one_line_naming_it():
    from shardserve.launch.request_timing import measure_server
    from shardserve.planner import PlanError

    with pytest.raises(PlanError, match=r"^calibrate: the server that times a request's way \(`shardserve launch` "
                                        r"of a micro model on tpu\) did not come up: .*tpu"):
        measure_server("tpu")
