"""`shardserve doctor` on this machine's real /dev/shm, interfaces and files; NVML by stand-in."""

import dataclasses
import json
import shutil
import socket
import subprocess
import sys
import types
from importlib import metadata

import pytest

from shardserve.launch.cluster.doctor import (check_gpus, check_interfaces, check_model, check_shm,
                                      interface_names, run_checks)
from shardserve.launch.cluster.doctor_gpu import (OLDER_TORCH_INDEX, check_driver, check_nccl, check_torch_cuda, check_triton,
                                          driver_versions, gpu_build_checks, has_kernels_for, judge_capability,
                                          judge_driver, parse_cuda)
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


@pytest.mark.slow
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


@pytest.mark.slow
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


GPU_ROWS = ("torch_cuda", "cuda_devices", "driver", "triton", "nccl")


def test_cpu_machine_skips_the_gpu_build_rows_and_says_how_to_install_it():
    checks = run_checks(None)
    names = [c.name for c in checks]
    assert names[names.index("gpus") + 1:names.index("nvlink")] == list(GPU_ROWS)
    rows = {c.name: c for c in checks}
    for name in GPU_ROWS:
        assert rows[name].status == "skip" and rows[name].detail, name
    assert "CPU build" in rows["torch_cuda"].detail and "torch.version.cuda is None" in rows["torch_cuda"].detail
    assert "no NVIDIA driver" in rows["driver"].detail
    assert rows["triton"].detail.startswith(f"triton {metadata.version('triton')}: no CUDA GPU")
    assert "gloo" in rows["nccl"].detail
    for name in ("torch_cuda", "cuda_devices", "triton", "nccl"):
        assert "make install-gpu" in rows[name].fix, name


def test_cpu_build_with_gpus_in_nvml_fails():
    import torch
    checks = {c.name: c for c in gpu_build_checks(True, FakeNvml([], fail_init=True), torch)}
    assert checks["torch_cuda"].status == "fail" and "NVML sees GPUs" in checks["torch_cuda"].detail
    missing = check_torch_cuda(None, has_nvml_gpus=True)
    assert missing.status == "fail" and "not installed" in missing.detail


class DriverNvml(FakeNvml):
    def __init__(self, driver: str, cuda: int):
        super().__init__(["NVIDIA H100 80GB HBM3"])
        self.driver, self.cuda = driver, cuda

    def nvmlSystemGetDriverVersion(self):
        return self.driver.encode()

    def nvmlSystemGetCudaDriverVersion(self):
        return self.cuda


def cuda_torch(capability=(9, 0), arch_list=("sm_80", "sm_90", "sm_100", "sm_120"), cuda="13.0", gpus=1,
               nccl=(2, 29, 7)):
    """A stand-in for a CUDA build of torch seeing `gpus` GPUs (this machine has no GPU)."""
    def nccl_version():
        if nccl is None:
            raise RuntimeError("NCCL is not available")
        return nccl
    return types.SimpleNamespace(
        __version__=f"2.13.0+cu{cuda.replace('.', '')}", version=types.SimpleNamespace(cuda=cuda),
        cuda=types.SimpleNamespace(is_available=lambda: gpus > 0, device_count=lambda: gpus,
                                   get_device_capability=lambda i: capability,
                                   get_device_name=lambda i: "NVIDIA H100 80GB HBM3",
                                   get_arch_list=lambda: list(arch_list),
                                   nccl=types.SimpleNamespace(version=nccl_version)))


def test_driver_versions_from_nvml():
    assert driver_versions(DriverNvml("580.95.05", 13000)) == ("580.95.05", (13, 0))
    assert driver_versions(DriverNvml("550.54.15", 12040)) == ("550.54.15", (12, 4))
    assert driver_versions(FakeNvml([], fail_init=True)) is None
    old = check_driver(cuda_torch(), DriverNvml("550.54.15", 12040))
    assert old.status == "fail" and "580.65.06" in old.fix and old.fix.endswith("TORCH_INDEX=" + OLDER_TORCH_INDEX[12])
    assert check_driver(cuda_torch(), DriverNvml("580.95.05", 13000)).status == "pass"
    cpu = check_driver(types.SimpleNamespace(version=types.SimpleNamespace(cuda=None)), DriverNvml("580.95.05", 13000))
    assert cpu.status == "skip" and "580.95.05" in cpu.detail


def test_judge_driver_against_torch_cuda():
    assert judge_driver("580.95.05", (13, 0), (13, 0))[0] == "pass"
    assert judge_driver("590.10", (13, 2), (12, 6))[0] == "pass"  # a newer driver runs older CUDA builds
    status, detail, fix = judge_driver("580.65.06", (13, 0), (13, 2))
    assert status == "warn" and "minor-version compatibility" in detail and "580.65.06" in fix
    status, detail, fix = judge_driver("535.161.08", (12, 2), (13, 0))
    assert status == "fail" and "driver 535.161.08 supports CUDA 12.2, torch is built for CUDA 13.0" in detail
    assert "580.65.06 or later" in fix and "whl/cu126" in fix
    status, _, fix = judge_driver("520.61.05", (11, 8), (12, 6))
    assert status == "fail" and fix == "upgrade the NVIDIA driver to 525.60.13 or later"  # no torch 2.13 for CUDA 11
    assert parse_cuda("13.0") == (13, 0) and parse_cuda("12.6.3") == (12, 6)


def test_judge_capability_against_torch_arch_list():
    arch = ["sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    status, detail, _ = judge_capability((9, 0), arch)
    assert status == "pass" and detail.startswith("sm_90 (the Triton kernels' tuned target")
    assert judge_capability((8, 9), arch)[0] == "pass"  # sm_86's cubin runs on sm_89
    assert judge_capability((7, 5), ["sm_75", "sm_80"])[0] == "warn"
    status, detail, fix = judge_capability((7, 0), arch)
    assert status == "fail" and "sm_70" in detail and "cu126" in fix
    assert not has_kernels_for((9, 0), ["sm_80", "sm_86"])  # no cubin across majors
    assert has_kernels_for((12, 1), ["sm_90", "compute_120"])  # PTX JIT-compiles forward
    assert not has_kernels_for((8, 6), ["sm_90a"])
    assert judge_capability((9, 0), [])[0] == "pass"  # an unknown list is not held against the GPU


def test_gpu_rows_for_a_cuda_build(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rows = {c.name: c for c in gpu_build_checks(True, DriverNvml("580.95.05", 13000), cuda_torch(gpus=2),
                                                triton_probe=lambda torch: "ran")}
    assert {n: rows[n].status for n in GPU_ROWS} == dict.fromkeys(GPU_ROWS, "pass")
    assert rows["cuda_devices"].detail.startswith("2x NVIDIA H100 80GB HBM3: sm_90")
    assert rows["nccl"].detail == "NCCL 2.29.7 (torch's own)"
    unseen = {c.name: c for c in gpu_build_checks(True, DriverNvml("535.161.08", 12020), cuda_torch(gpus=0))}
    assert unseen["cuda_devices"].status == "fail" and unseen["driver"].status == "fail"
    assert unseen["triton"].status == "skip" and unseen["nccl"].status == "skip"
    assert check_nccl(cuda_torch(nccl=None)).status == "fail"


def test_triton_probe_failure_is_a_fail_with_the_fix(monkeypatch):
    def broken(torch):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.\nmore")
    assert check_triton(cuda_torch(), broken).status == "warn"  # tests/conftest.py sets TRITON_INTERPRET=1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    check = check_triton(cuda_torch(), broken)
    assert check.status == "fail" and check.detail.endswith("Failed to find C compiler. Please specify via CC "
                                                            "environment variable.")
    assert "gcc" in check.fix
