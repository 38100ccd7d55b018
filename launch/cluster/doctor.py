"""`shardserve doctor`: check this machine against a plan, pass / warn / fail, each with the fix."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from shardserve.launch.cluster.check import Check
from shardserve.launch.cluster.node_facts import IFNAME_VARS, interface_problem, versions
from shardserve.planner import PlanError
from shardserve.planner.detect import detect_local
from shardserve.planner.hardware import GIB
from shardserve.planner.plan_file import PlanFile

MIN_SHM_BYTES = GIB  # NCCL and the mp executor keep buffers in /dev/shm


def run_checks(plan: PlanFile | None = None, nvml=None, shm_path: str = "/dev/shm",
               cluster_address: str | None = None) -> list[Check]:
    from shardserve.launch.cluster.doctor_gpu import gpu_build_checks
    hardware = detect_local(nvml)
    checks = [check_gpus(hardware, plan), *gpu_build_checks(not hardware.is_cpu, nvml),
              check_nvlink(hardware, plan), check_shm(shm_path),
              check_interfaces(os.environ, interface_names()), check_versions()]
    checks.append(check_model(plan) if plan else
                  Check("model", "skip", "no plan given: pass --plan to check its model files"))
    checks.append(check_nccl_transport(hardware, plan))
    checks += check_cluster(cluster_address, plan)
    return checks


def check_nccl_transport(hardware, plan: PlanFile | None, probe=None) -> Check:
    """All-reduce over this machine's share of the plan's tensor-parallel ranks, NCCL_DEBUG=INFO,
    and judge the transport NCCL reports. `probe(world_size) -> log text` runs it."""
    tp = plan.parallel.tensor_parallel_size if plan else 2
    if hardware.is_cpu or hardware.total_gpus < 2 or tp < 2:
        return Check("nccl_transport", "skip", "needs two or more GPUs here and a plan with "
                     "tensor parallel (on CPU, gloo carries the collectives)")
    from shardserve.launch.cluster.nccl_probe import judge, parse_nccl_log, run_local_probe
    world = min(tp, hardware.nodes[0].num_gpus)
    try:
        log = (probe or run_local_probe)(world)
    except Exception as e:  # noqa: BLE001 - any failure of the probe is the finding
        return Check("nccl_transport", "fail", f"an all-reduce over {world} GPUs failed: {e}",
                     "rerun with NCCL_DEBUG=INFO and read the first NCCL WARN line")
    status, detail, fix = judge(parse_nccl_log(log), crosses_nodes=False)
    return Check("nccl_transport", status, f"all-reduce over {world} GPUs: {detail}", fix)


def check_cluster(address: str | None, plan: PlanFile | None) -> list[Check]:
    """Each Ray node: alive, its IP on one of its interfaces, versions, NCCL/gloo variables and
    the plan's model files as on this host."""
    if not address:
        return [Check("ray_nodes", "skip", "no Ray cluster (pass --ray-address or set "
                      "RAY_ADDRESS): node IPs, versions and model files across nodes unchecked")]
    from shardserve.launch.cluster.node_facts import env_differences, node_facts
    from shardserve.launch.cluster.ray_nodes import list_nodes, node_problems
    model = plan.model.path if plan else None
    try:
        nodes = list_nodes(model, address)
    except PlanError as e:
        return [Check("ray_nodes", "fail", str(e), "start the cluster: shardserve cluster up")]
    dead = [n["ip"] for n in nodes if not n["alive"]]
    checks = [Check("ray_nodes", "fail" if dead else "pass",
                    f"{len(nodes)} nodes ({', '.join(n['ip'] for n in nodes)})"
                    + (f"; dead: {', '.join(dead)}" if dead else ""),
                    "restart the lost nodes (shardserve cluster join) or remove them" if dead
                    else None)]
    problems = node_problems(nodes, node_facts(model))
    checks.append(Check("node_parity", "fail" if problems else "pass",
                        "; ".join(f"{ip}: {', '.join(p)}" for ip, p in problems.items())
                        or "every node has this host's versions"
                        + (" and the model's files" if model else "")
                        + ", and its Ray IP on its own interfaces",
                        "install the same versions everywhere, copy the model folder to the "
                        "same path, and start nodes with `shardserve cluster join` (it picks "
                        "the IP that routes to the head)" if problems else None))
    checks.append(check_nccl_between_nodes(address, nodes))
    head = next((n["facts"] for n in nodes if n["head"] and "facts" in n), None)
    differ = {n["ip"]: d for n in nodes if "facts" in n and head
              and (d := env_differences(head, n["facts"]))}
    checks.append(Check("node_env", "warn" if differ else "pass",
                        "; ".join(f"{ip}: {', '.join(d)}" for ip, d in differ.items())
                        or "NCCL_*/GLOO_* variables agree across nodes",
                        "set the same NCCL/gloo variables on every node before `cluster join`"
                        if differ else None))
    return checks


def check_nccl_between_nodes(address: str, nodes: list[dict], probe=None) -> Check:
    """An all-reduce with one rank on each GPU node: the transport NCCL takes between nodes.
    `probe(address) -> (node IPs, log text)` runs it."""
    gpu_nodes = [n["ip"] for n in nodes if n["alive"] and n["gpus"]]
    if len(gpu_nodes) < 2:
        return Check("nccl_between_nodes", "skip", f"{len(gpu_nodes)} live node(s) with GPUs: "
                     "no NCCL traffic crosses nodes")
    from shardserve.launch.cluster.nccl_probe import judge, parse_nccl_log, run_cluster_probe
    try:
        ips, log = (probe or run_cluster_probe)(address)
    except Exception as e:  # noqa: BLE001 - any failure of the probe is the finding
        return Check("nccl_between_nodes", "fail", f"an all-reduce across {len(gpu_nodes)} "
                     f"nodes failed: {e}", "check NCCL_SOCKET_IFNAME on each node (shardserve "
                     "cluster join sets it) and that the nodes reach each other on any port")
    status, detail, fix = judge(parse_nccl_log(log), crosses_nodes=True)
    return Check("nccl_between_nodes", status, f"all-reduce across {', '.join(ips)}: {detail}",
                 fix)


def check_gpus(hardware, plan: PlanFile | None) -> Check:
    if hardware.is_cpu:
        if plan and plan.runtime.device == "cuda":
            return Check("gpus", "fail", "NVML sees no GPU but the plan needs "
                         f"{plan.parallel.num_gpus} ({plan.hardware.gpu.name})",
                         "run on the planned machine, or check the driver (nvidia-smi) and "
                         "CUDA_VISIBLE_DEVICES")
        return Check("gpus", "skip", "no GPU visible through NVML: GPU checks skipped")
    found = f"{hardware.total_gpus}x {hardware.gpu.name} ({hardware.gpu.memory_bytes / GIB:.1f} GiB)"
    if plan and plan.runtime.device == "cuda":
        need, want = plan.parallel.num_gpus, plan.hardware.gpu
        if hardware.total_gpus < need:
            return Check("gpus", "fail", f"found {found}; the plan needs {need}",
                         "add GPUs, or plan again here: shardserve plan -o plan.yaml")
        if hardware.gpu.memory_bytes < 0.98 * want.memory_bytes:
            return Check("gpus", "fail", f"found {found}; the plan assumed "
                         f"{want.memory_bytes / GIB:.1f} GiB per GPU",
                         "plan again on this machine")
    return Check("gpus", "pass", f"found {found}")


def check_nvlink(hardware, plan: PlanFile | None) -> Check:
    if hardware.is_cpu or hardware.total_gpus < 2:
        return Check("nvlink", "skip", "fewer than two GPUs")
    tp = plan.parallel.tensor_parallel_size if plan else 1
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
    problem = interface_problem({"interfaces": dict.fromkeys(names), "env": env})
    if problem:
        return Check("interfaces", "fail", problem,
                     "set it to the interface that routes to the other nodes")
    set_vars = [f"{v}={env[v]}" for v in IFNAME_VARS if env.get(v)]
    return Check("interfaces", "pass", f"interfaces {', '.join(sorted(names))}"
                 + (f"; {', '.join(set_vars)}" if set_vars else ""))


def check_versions() -> Check:
    return Check("versions", "pass", ", ".join(f"{k} {v}" for k, v in versions().items()))


def check_model(plan: PlanFile) -> Check:
    path = plan.model.path
    if not path:
        return Check("model", "warn", f"{plan.model.id} is a catalog entry: there are no "
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
