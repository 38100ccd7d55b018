"""Each part of bench/run_gpu.sh runs end to end on this CPU at tiny sizes (--small), so a lent GPU's
short calls are not lost to a broken script: records land in the results file as they are measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here starts a process

ROOT = Path(__file__).parents[2]
SMOKE = ["--small", "--device", "cpu", "--num-prompts", "4", "--shapes", "16/8",
         "--concurrency", "1", "2", "--input-len", "16", "--output-len", "8", "--batches", "1", "4"]


def run_part(part: int, workdir: Path, **env_vars: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    env.update(env_vars)
    args = [] if part == 1 else [*SMOKE, "--workdir", str(workdir), "--results", str(workdir / "results.json")]
    return subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), "--part", str(part), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_parts")


def records(workdir: Path) -> list[dict]:
    return json.loads((workdir / "results.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("part, benchmarks", [
    (2, ["decode_batch1"]),
    (3, ["offline_throughput"]),
    (4, ["decode_batch1", "offline_throughput"]),
    (5, ["serving", "serving"]),
    (6, ["kernels"] * 8),  # decode and prefill twice each, rotary + KV and SiLU-and-mul at two sizes
    (8, ["decode_steps"]),  # the plan's decode step beside the engine's, batch by batch
])
def test_each_part_appends_its_records(workdir, part, benchmarks):
    before = len(records(workdir)) if (workdir / "results.json").exists() else 0
    done = run_part(part, workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    new = records(workdir)[before:]
    assert [r["benchmark"] for r in new] == benchmarks
    for record in new:
        assert record["device"] and record["versions"]["torch"]
        assert "plan_estimate" in record or record["benchmark"] == "kernels"  # kernels alone: no plan figure
    measured = [r.get("shardserve_tok_s") or r.get("output_tok_s") or r.get("us")
                or min(row["measured_ms"] for row in r["rows"]) for r in new]
    assert all(value > 0 for value in measured), new
    if part == 3:  # the transformers peer ran beside us, or its failure is on the record
        settings = new[0]["settings"]
        assert new[0]["hf_tok_s"] or settings["hf_error"]
        assert new[0]["shardserve_async_scheduling_tok_s"] > 0  # the overlapped engine beside the plain one
        assert settings["shardserve_async_scheduling"]["async_scheduling"] is True


@pytest.mark.slow
def test_part_7_writes_a_calibration_file_to_out_and_where_plan_reads_it(workdir):
    from shardserve.planner.calibration import read_calibration

    out, cache = workdir / "out", workdir / "cache"
    out.mkdir()
    done = run_part(7, workdir, OUT=str(out), XDG_CACHE_HOME=str(cache))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = read_calibration(out / "calibration-cpu.json")  # $OUT on the device machine: it comes back
    assert data["gpu"] == "CPU" and "gemm.float32" in data["tables"]
    # and where `plan` reads it there, for part 8 while the machine stays warm
    assert read_calibration(cache / "shardserve" / "calibration" / "cpu.json") == data


@pytest.mark.slow
def test_part_1_runs_tests_gpu_and_says_why_they_skip_here():
    done = run_part(1, Path("."))
    assert done.returncode == 0, done.stdout[-3000:]
    assert "skipped" in done.stdout and "need a CUDA GPU" in done.stdout


def test_an_unknown_part_is_refused_with_the_list():
    done = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh")], capture_output=True, text=True)
    assert done.returncode == 2 and "Llama-3.1-8B shape: batch-1 decode" in done.stdout
    done = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), "--part", "9"], capture_output=True, text=True)
    assert done.returncode == 2 and "use 1 to 8" in done.stderr
    usage = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh")], capture_output=True, text=True).stdout
    assert "7  `shardserve calibrate`" in usage and "8  Llama-3.1-8B shape: the plan's decode step" in usage


@pytest.mark.slow
def test_quick_run_bounds_each_step_and_writes_every_record_to_out(workdir):
    """--quick, the first call on a lent GPU: a step past its share is stopped (here the tests, at 1 s) and the
    rest still run; the 8B shape's records (--load-format dummy: no checkpoint written) land in $OUT."""
    out = workdir / "quick-out"
    out.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "OUT": str(out), "QUICK_TESTS_S": "1"}
    done = subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), "--quick", "--small", "--device", "cpu",
                           "--num-prompts", "4", "--shapes", "16/8", "--workdir", str(workdir / "quick")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert "STOPPED after 1 s: " in done.stdout and "pytest" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    new = records(out)
    assert [r["benchmark"] for r in new] == ["decode_batch1", "offline_throughput", "offline_throughput_transformers"]
    assert all(r["load_format"] == "dummy" for r in new) and (out / "gpu_tests.log").exists()
    assert new[0]["shardserve_tok_s"] > 0 and new[1]["shardserve_async_scheduling_tok_s"] > 0 and new[2]["hf_tok_s"] > 0
    assert not list((workdir / "quick").glob("*/*.safetensors"))  # dummy: the engines drew their weights
