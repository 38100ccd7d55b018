"""`shardserve doctor`: check this machine against a plan, pass / warn / fail, each with the fix."""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from shardserve.planner.detect import detect_local
from shardserve.planner.hardware import GIB

MIN_SHM_BYTES = GIB  # NCCL and the mp executor keep buffers in /dev/shm
_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # pass | warn | fail | skip
    detail: str
    fix: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def run_checks(plan: dict | None = None, nvml=None, shm_path: str = "/dev/shm") -> list[Check]:
    hardware = detect_local(nvml)
    checks = [check_gpus(hardware, plan), check_nvlink(hardware, plan), check_shm(shm_path),
              check_interfaces(os.environ, interface_names()), check_versions()]
    checks.append(check_model(plan) if plan else
                  Check("model", "skip", "no plan given: pass --plan to check its model files"))
    checks.append(Check("nccl_transport", "skip",
                        "needs two or more GPUs and a plan with tensor parallel"
                        if hardware.total_gpus < 2 or hardware.is_cpu else
                        "not run by this version: the all-reduce probe comes with the "
                        "multi-node work"))
    checks.append(Check("ray_nodes", "skip", "no Ray cluster: node IPs, versions and model "
                        "files across nodes are checked on a cluster (RAY_ADDRESS)"))
    return checks


def check_gpus(hardware, plan: dict | None) -> Check:
    if hardware.is_cpu:
        if plan and plan["runtime"]["device"] == "cuda":
            return Check("gpus", "fail", "NVML sees no GPU but the plan needs "
                         f"{_plan_gpus(plan)} ({plan['hardware']['gpu']['name']})",
                         "run on the planned machine, or check the driver (nvidia-smi) and "
                         "CUDA_VISIBLE_DEVICES")
        return Check("gpus", "skip", "no GPU visible through NVML: GPU checks skipped")
    found = f"{hardware.total_gpus}x {hardware.gpu.name} ({hardware.gpu.memory_bytes / GIB:.1f} GiB)"
    if plan and plan["runtime"]["device"] == "cuda":
        need, want = _plan_gpus(plan), plan["hardware"]["gpu"]
        if hardware.total_gpus < need:
            return Check("gpus", "fail", f"found {found}; the plan needs {need}",
                         "add GPUs, or plan again here: shardserve plan -o plan.yaml")
        if hardware.gpu.memory_bytes < 0.98 * want["memory_bytes"]:
            return Check("gpus", "fail", f"found {found}; the plan assumed "
                         f"{want['memory_bytes'] / GIB:.1f} GiB per GPU",
                         "plan again on this machine")
    return Check("gpus", "pass", f"found {found}")


def check_nvlink(hardware, plan: dict | None) -> Check:
    if hardware.is_cpu or hardware.total_gpus < 2:
        return Check("nvlink", "skip", "fewer than two GPUs")
    tp = plan["parallel"]["tensor_parallel_size"] if plan else 1
    if hardware.interconnect == "nvlink":
        return Check("nvlink", "pass", "NVLink joins every GPU pair")
    notes = "; ".join(hardware.notes) or "no NVLink between the GPUs (PCIe)"
    if tp > 1:
        return Check("nvlink", "warn", f"{notes}, and the plan uses tensor parallel {tp}",
                     "over PCIe prefer pipeline parallel: shardserve plan chooses it when it "
                     "detects the GPUs here")
    return Check("nvlink", "pass", notes)


def check_shm(path: str, min_bytes: int = MIN_SHM_BYTES) -> Check:
    try:
        stats = os.statvfs(path)
    except OSError:
        return Check("shm", "fail", f"{path} is missing", "mount a tmpfs at /dev/shm")
    size = stats.f_frsize * stats.f_blocks
    if size < min_bytes:
        return Check("shm", "fail", f"{path} holds only {size / 2**20:.0f} MiB",
                     "in a container: docker run --ipc=host (or --shm-size=16g)")
    return Check("shm", "pass", f"{path} holds {size / GIB:.1f} GiB")


def interface_names() -> set[str]:
    return {name for _, name in socket.if_nameindex()}


def check_interfaces(env: os._Environ | dict, names: set[str]) -> Check:
    """NCCL/gloo interface variables must name interfaces this machine has."""
    wrong = []
    for var in _IFNAME_VARS:
        value = env.get(var)
        if not value:
            continue
        wanted = [v.lstrip("^=") for v in value.split(",") if v]
        exclude = value.startswith("^")
        # NCCL matches by prefix unless the value starts with '='
        if not exclude and not any(any(n.startswith(w) for n in names) for w in wanted):
            wrong.append(f"{var}={value}")
    if wrong:
        return Check("interfaces", "fail", f"{', '.join(wrong)} names no interface here "
                     f"(this machine has {', '.join(sorted(names))})",
                     "set it to the interface that routes to the other nodes")
    set_vars = [f"{v}={env[v]}" for v in _IFNAME_VARS if env.get(v)]
    return Check("interfaces", "pass", f"interfaces {', '.join(sorted(names))}"
                 + (f"; {', '.join(set_vars)}" if set_vars else ""))


def check_versions() -> Check:
    versions = {"python": platform.python_version()}
    for package in ("shardserve", "torch", "transformers", "ray"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return Check("versions", "pass", ", ".join(f"{k} {v}" for k, v in versions.items()))


def check_model(plan: dict) -> Check:
    path = plan["model"].get("path")
    if not path:
        return Check("model", "warn", f"{plan['model']['id']} is a catalog entry: there are no "
                     "weights to check", "plan from the model folder the launch will use")
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").is_file() or not files:
        return Check("model", "fail", f"{folder} lacks config.json or *.safetensors",
                     "copy the model folder to this machine at the same path")
    broken = [f.name for f in files if not _safetensors_complete(f)]
    if broken:
        return Check("model", "fail", f"truncated files in {folder}: {', '.join(broken)}",
                     "copy them again (a partial download?)")
    total = sum(f.stat().st_size for f in files)
    return Check("model", "pass", f"{folder}: {len(files)} safetensors files, "
                 f"{total / GIB:.2f} GiB, complete")


def _safetensors_complete(path: Path) -> bool:
    """The file is as long as its header says: 8 + header + the last tensor's end."""
    import json
    import struct
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            return False
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(size))
        except ValueError:
            return False
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    return path.stat().st_size >= 8 + size + end


def _plan_gpus(plan: dict) -> int:
    p = plan["parallel"]
    return p["tensor_parallel_size"] * p["pipeline_parallel_size"] * p["data_parallel_size"]
