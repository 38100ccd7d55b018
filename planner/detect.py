"""Find the hardware: local GPUs through NVML, or the nodes of a running Ray cluster."""

from __future__ import annotations

import logging
from dataclasses import replace
from itertools import combinations

from shardserve.planner.catalog import find_gpu
from shardserve.planner.errors import PlanError
from shardserve.planner.hardware import GpuSpec, Hardware, Node, cpu_hardware


def detect_local(nvml=None) -> Hardware:
    """The GPUs NVML sees on this machine; a CPU plan's hardware when there are none.

    `nvml` is the pynvml module (nvidia-ml-py); tests pass a stand-in with the same API.
    """
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            return cpu_hardware()
        nvml = pynvml
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no usable GPU here
        return cpu_hardware()
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            return cpu_hardware()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        names = {_text(nvml.nvmlDeviceGetName(h)) for h in handles}
        memory = [nvml.nvmlDeviceGetMemoryInfo(h) for h in handles]
        links = _nvlink_pairs(nvml, handles)
    finally:
        nvml.nvmlShutdown()
    notes = []
    if len(names) > 1:
        notes.append(f"mixed GPU models on this node ({', '.join(sorted(names))}): "
                     "planning for the smallest")
    gpu = min((_gpu_from_nvml(n, min(m.total for m in memory)) for n in names),
              key=lambda g: g.memory_bytes)
    all_pairs = set(combinations(range(count), 2))
    if count == 1 or links == all_pairs:
        interconnect = "nvlink" if links else gpu.interconnect
    else:
        interconnect = "pcie"
        if links:
            notes.append(f"NVLink joins only {len(links)} of {len(all_pairs)} GPU pairs: "
                         "planning for PCIe between GPUs")
    if interconnect != gpu.interconnect:
        link = 450e9 if interconnect == "nvlink" else 32e9
        gpu = replace(gpu, interconnect=interconnect, link_bytes_per_s=link)
    node = Node(gpu, count, None, tuple(m.free for m in memory))
    return Hardware("detected", (node,), interconnect, notes=tuple(notes))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _gpu_from_nvml(name: str, total_bytes: int) -> GpuSpec:
    if find_gpu(name):
        return replace(GpuSpec.from_catalog(name), memory_bytes=total_bytes)
    # NOTE: an unknown model still plans from what NVML measured; speed uses modest figures.
    return GpuSpec(name, total_bytes, 500e9, 100e12, 100e12, False, "pcie", 32e9)


def _nvlink_pairs(nvml, handles) -> set[tuple[int, int]]:
    """GPU index pairs joined by an active NVLink, directly or through an NVSwitch."""
    bus_ids = [_text(nvml.nvmlDeviceGetPciInfo(h).busId).lower() for h in handles]
    pairs, on_switch = set(), set()
    for i, h in enumerate(handles):
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if nvml.nvmlDeviceGetNvLinkState(h, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId).lower()
            except Exception:  # NVMLError_NotSupported / InvalidArgument past the last link
                continue
            if remote in bus_ids:
                j = bus_ids.index(remote)
                if j != i:
                    pairs.add((min(i, j), max(i, j)))
            else:
                on_switch.add(i)  # the far end is an NVSwitch, not a GPU
    pairs |= set(combinations(sorted(on_switch), 2))
    return pairs


def detect_ray(address: str) -> Hardware:
    """Nodes, GPUs per node and node IPs of the Ray cluster at `address`."""
    try:
        import ray
    except ImportError:
        raise PlanError("--ray-address needs Ray on this machine: pip install 'ray[default]'") \
            from None
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except Exception as e:  # ConnectionError, RuntimeError: no cluster there
        raise PlanError(f"cannot join the Ray cluster at {address}: {e}") from None
    try:
        return hardware_from_ray_nodes(ray.nodes())
    finally:
        ray.shutdown()


def hardware_from_ray_nodes(nodes: list[dict]) -> Hardware:
    """Turn `ray.nodes()` into Hardware: the GPU model comes from accelerator_type:NAME."""
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        raise PlanError("the Ray cluster has no live nodes")
    gpu_nodes = [n for n in alive if n.get("Resources", {}).get("GPU", 0) >= 1]
    if not gpu_nodes:
        cpu = cpu_hardware(source="ray")
        return replace(cpu, nodes=tuple(replace(cpu.nodes[0], ip=n.get("NodeManagerAddress"))
                                        for n in alive))
    out = []
    for n in gpu_nodes:
        resources = n["Resources"]
        kinds = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
        if not kinds or not find_gpu(kinds[0]):
            raise PlanError(f"Ray node {n.get('NodeManagerAddress')} does not say which GPU it "
                            f"has ({kinds[0] if kinds else 'no accelerator_type'}): declare the "
                            "hardware instead, e.g. --hardware 2x8xH100-80GB")
        out.append(Node(GpuSpec.from_catalog(kinds[0]), int(resources["GPU"]),
                        n.get("NodeManagerAddress")))
    interconnect = "pcie" if any(n.gpu.interconnect == "pcie" for n in out) else "nvlink"
    return Hardware("ray", tuple(out), interconnect)
