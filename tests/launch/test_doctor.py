"""`shardserve doctor` on this machine's real /dev/shm, interfaces and files; NVML by stand-in."""

import dataclasses
import json
import shutil
import socket
import subprocess
import sys

from shardserve.launch.doctor import (check_gpus, check_interfaces, check_model, check_shm,
                                      interface_names, run_checks)
from shardserve.launch.launcher import read_plan_file
from shardserve.planner.detect import detect_local

from tests.planner.factories import FakeNvml, plan_for


def test_shm_on_this_machine():
    assert check_shm("/dev/shm").status == "pass"
    small = check_shm("/dev/shm", min_bytes=1 << 50)
    assert small.status == "fail" and "--ipc=host" in small.fix
    assert check_shm("/no/such/shm").status == "fail"


def test_interface_variables_against_the_real_table():
    names = interface_names()
    assert names == {name for _, name in socket.if_nameindex()} and "lo" in names
    assert check_interfaces({"NCCL_SOCKET_IFNAME": "lo"}, names).status == "pass"
    assert check_interfaces({"GLOO_SOCKET_IFNAME": "^docker,veth"}, names).status == "pass"
    bad = check_interfaces({"NCCL_SOCKET_IFNAME": "ib9"}, names)
    assert bad.status == "fail" and "NCCL_SOCKET_IFNAME=ib9 names none of its interfaces" in bad.detail


def test_gpu_count_and_memory_against_the_plan():
    plan = plan_for("meta-llama/Llama-3.1-70B-Instruct", "8xH100-80GB").record()
    two = detect_local(FakeNvml(["NVIDIA H100 80GB HBM3"] * 2, total=81559 * 2**20))
    check = check_gpus(two, plan)
    assert check.status == "fail" and "the plan needs 8" in check.detail
    eight = detect_local(FakeNvml(["NVIDIA H100 80GB HBM3"] * 8, total=81559 * 2**20))
    assert check_gpus(eight, plan).status == "pass"
    none = detect_local(FakeNvml([], fail_init=True))
    assert check_gpus(none, plan).status == "fail"
    assert check_gpus(none, None).status == "skip"


def test_model_files_complete_and_truncated(tmp_path):
    r = subprocess.run([sys.executable, "-m", "shardserve.launch", "plan", "--profile", "demo",
                        "-o", str(tmp_path / "plan.yaml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    plan = read_plan_file(str(tmp_path / "plan.yaml"))
    assert check_model(plan).status == "pass"
    copy = tmp_path / "model"
    shutil.copytree(plan.model.path, copy)
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1000])
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, path=str(copy)))
    broken = check_model(plan)
    assert broken.status == "fail" and weights.name in broken.detail


def test_cpu_machine_says_what_it_skipped():
    checks = {c.name: c for c in run_checks(None)}
    assert checks["shm"].status == "pass" and checks["versions"].status == "pass"
    assert {checks[n].status for n in ("nccl_transport", "ray_nodes", "model")} == {"skip"}


def test_cli_json_and_exit_code(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "shardserve.launch", "doctor", "--format",
                         "json"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0
    assert {c["status"] for c in json.loads(ok.stdout)["checks"]} <= {"pass", "skip", "warn"}
    plan = tmp_path / "gpu.yaml"
    subprocess.run([sys.executable, "-m", "shardserve.launch", "plan", "-m",
                    "meta-llama/Llama-3.1-8B", "--hardware", "2xH100", "-o", str(plan)],
                   check=True, capture_output=True)
    bad = subprocess.run([sys.executable, "-m", "shardserve.launch", "doctor", "--plan",
                          str(plan)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "fail" in bad.stdout
