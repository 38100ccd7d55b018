"""Hardware descriptions: GPU specs from the catalog, and declared layouts like 2x8xH100-80GB."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from shardserve.planner.catalog import find_gpu, gpu_catalog
from shardserve.planner.errors import PlanError
from shardserve.planner.yaml_file import read_yaml

GIB = 1 << 30
# Between nodes: 400 Gb/s InfiniBand or RoCE unless the hardware file says otherwise.
DEFAULT_INTER_NODE_GBPS = 50.0


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float  # 0 when the device has no bf16 tensor cores
    fp16_flops: float
    has_fp8: bool
    interconnect: str  # nvlink | pcie | none
    link_bytes_per_s: float
    is_cpu: bool = False

    @property
    def unit(self) -> str:
        """What one rank runs on, as messages name it: 'GPU', or 'CPU rank' in a CPU plan."""
        return "CPU rank" if self.is_cpu else "GPU"

    @property
    def has_bf16(self) -> bool:
        return self.bf16_flops > 0

    @staticmethod
    def from_catalog(name: str) -> "GpuSpec":
        found = find_gpu(name)
        if found is None:
            raise PlanError(f"unknown GPU {name!r}; known: {', '.join(gpu_catalog())} "
                            "(or describe it in a hardware YAML file)")
        canonical, e = found
        return GpuSpec(canonical, e["memory_mib"] << 20, e["hbm_gbps"] * 1e9,
                       e["bf16_tflops"] * 1e12, e["fp16_tflops"] * 1e12, bool(e["fp8"]),
                       e["interconnect"], e["link_gbps"] * 1e9)

    @staticmethod
    def cpu(memory_bytes: int) -> "GpuSpec":
        # NOTE: a CPU rank is planned like a device holding its share of host memory; its
        # bandwidth and FLOP/s are a typical server's, so CPU speed estimates are rough.
        return GpuSpec("CPU", memory_bytes, 20e9, 1e12, 1e12, False, "none", 10e9, is_cpu=True)


@dataclass(frozen=True)
class Node:
    gpu: GpuSpec
    num_gpus: int
    ip: str | None = None
    free_memory_bytes: tuple[int, ...] | None = None  # per GPU, when detected


@dataclass(frozen=True)
class Hardware:
    source: str  # detected | declared | ray
    nodes: tuple[Node, ...]
    interconnect: str  # nvlink | pcie | none: between the GPUs of a node
    inter_node_bytes_per_s: float = DEFAULT_INTER_NODE_GBPS * 1e9
    notes: tuple[str, ...] = ()  # what detection found worth telling

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def gpus_per_node(self) -> int:
        return min(n.num_gpus for n in self.nodes)

    @property
    def total_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    @property
    def gpu(self) -> GpuSpec:
        """The GPU every rank is planned for: when nodes differ, the weakest of each figure."""
        gpus = list({n.gpu: None for n in self.nodes})
        if len(gpus) == 1:
            return gpus[0]
        return GpuSpec("+".join(g.name for g in gpus), min(g.memory_bytes for g in gpus),
                       min(g.hbm_bytes_per_s for g in gpus), min(g.bf16_flops for g in gpus),
                       min(g.fp16_flops for g in gpus), all(g.has_fp8 for g in gpus),
                       self.interconnect, min(g.link_bytes_per_s for g in gpus),
                       any(g.is_cpu for g in gpus))

    @property
    def is_cpu(self) -> bool:
        return self.gpu.is_cpu

    @property
    def node_ips(self) -> list[str]:
        return [n.ip for n in self.nodes if n.ip]

    def describe(self) -> str:
        kinds = {(n.num_gpus, n.gpu.name) for n in self.nodes}
        if len(kinds) == 1:
            count, name = kinds.pop()
            prefix = f"{self.num_nodes}x" if self.num_nodes > 1 else ""
            return f"{prefix}{count}x{name}"
        return " + ".join(f"{n.num_gpus}x{n.gpu.name}" for n in self.nodes)


_DECLARED = re.compile(r"^(?:(\d+)\s*x\s*)?(?:(\d+)\s*x\s*)?([A-Za-z][\w.\- ]*)$")


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_hardware(num_ranks: int = 1, source: str = "detected") -> Hardware:
    gpu = GpuSpec.cpu(host_memory_bytes() // num_ranks)
    return Hardware(source, (Node(gpu, num_ranks),), "none")


def parse_declared(text: str) -> Hardware:
    """'8xH100-80GB', '2x8xH100', '3xL4', 'H200', 'cpu', '2xcpu', or a YAML file's path."""
    path = Path(text).expanduser()
    if text.endswith((".yaml", ".yml")) or path.is_file():
        return load_hardware_file(path)
    m = _DECLARED.match(text.strip())
    if not m:
        raise PlanError(f"cannot read --hardware {text!r}: write [NODESx]GPUSxNAME such as "
                        "8xH100-80GB, 2x8xH100-80GB or 3xL4, 'cpu', or a YAML file")
    a, b, name = m.groups()
    nodes, count = (int(a), int(b)) if b else (1, int(a or 1))
    if nodes < 1 or count < 1:
        raise PlanError(f"--hardware {text!r}: node and GPU counts must be at least 1")
    if name.strip().lower() == "cpu":
        if nodes > 1:
            raise PlanError("CPU hardware is one node: write 'cpu' or 'NxCPU' for N ranks")
        return cpu_hardware(count, source="declared")
    gpu = GpuSpec.from_catalog(name)
    return Hardware("declared", tuple(Node(gpu, count) for _ in range(nodes)), gpu.interconnect)


def load_hardware_file(path: Path) -> Hardware:
    """A YAML file for mixed or custom hardware:

        nodes:
          - {gpu: H100-80GB, count: 8, ip: 10.0.0.1}
          - {gpu: A100-80GB, count: 8}
        interconnect: nvlink        # optional: override the catalog's
        inter_node_gbps: 50         # optional: GB/s between nodes
    """
    data, _ = read_yaml(path, "hardware file")
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not data["nodes"]:
        raise PlanError(f"hardware file {path}: needs a non-empty 'nodes' list "
                        "of {gpu: NAME, count: N}")
    nodes = []
    for i, entry in enumerate(data["nodes"]):
        if not isinstance(entry, dict) or "gpu" not in entry or "count" not in entry:
            raise PlanError(f"hardware file {path}: nodes[{i}] needs 'gpu' and 'count'")
        gpu = GpuSpec.from_catalog(str(entry["gpu"]))
        if "memory_gib" in entry:
            gpu = replace(gpu, memory_bytes=int(float(entry["memory_gib"]) * GIB))
        if not isinstance(entry["count"], int) or entry["count"] < 1:
            raise PlanError(f"hardware file {path}: nodes[{i}].count must be a positive integer")
        nodes.append(Node(gpu, entry["count"], entry.get("ip")))
    weakest = "pcie" if any(n.gpu.interconnect == "pcie" for n in nodes) else "nvlink"
    interconnect = data.get("interconnect") or weakest
    if interconnect not in ("nvlink", "pcie"):
        raise PlanError(f"hardware file {path}: interconnect must be nvlink or pcie")
    gbps = float(data.get("inter_node_gbps", DEFAULT_INTER_NODE_GBPS))
    return Hardware("declared", tuple(nodes), interconnect, gbps * 1e9)
