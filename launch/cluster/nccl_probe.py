"""Which transport NCCL really uses: a small all-reduce over the plan's ranks with NCCL_DEBUG=INFO,
and a reader for the channel lines NCCL logs (`... via P2P/CUMEM`, `via NET/IB/0/GDRDMA`)."""

from __future__ import annotations

import collections
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.runtime.distributed.process_group import Rendezvous

PROBE_TIMEOUT_SECONDS = 120
# `Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/2/GDRDMA`: the transport is the text after via
_CHANNEL = re.compile(r"NCCL INFO Channel \d+(?:/\d+)? : \d+\[\w+\] -> \d+\[\w+\]"
                      r"(?: \[(?:send|receive)\])? via (\S+)")
_NETWORK = re.compile(r"NCCL INFO Using network (\w+)")


@dataclass
class TransportReport:
    """Channel counts by transport kind: p2p (NVLink or PCIe peer access), shm, ib, socket."""

    channels: collections.Counter = field(default_factory=collections.Counter)
    gdrdma: bool = False  # GPUDirect RDMA on some IB channel
    no_ib_device: bool = False  # NCCL said `NET/IB : No device found`
    networks: set[str] = field(default_factory=set)  # `Using network Socket|IB`, lowercased

    @property
    def kinds(self) -> set[str]:
        return set(self.channels)


def transport_kind(via: str) -> str:
    head = via.split("/")[0]
    if head == "NET":
        return "ib" if via.split("/")[1].startswith("IB") else "socket"
    return {"P2P": "p2p", "SHM": "shm", "NVLS": "p2p", "COLLNET": "ib"}.get(head, head.lower())


def parse_nccl_log(text: str) -> TransportReport:
    report = TransportReport()
    for line in text.splitlines():
        match = _CHANNEL.search(line)
        if match:
            via = match.group(1)
            report.channels[transport_kind(via)] += 1
            report.gdrdma |= via.endswith("GDRDMA")
        elif "NET/IB : No device found" in line:
            report.no_ib_device = True
        elif (network := _NETWORK.search(line)):
            report.networks.add("socket" if network.group(1) == "Socket" else "ib")
    return report


def judge(report: TransportReport, crosses_nodes: bool) -> tuple[str, str, str | None]:
    """(status, detail, fix) for what NCCL chose."""
    seen = ", ".join(f"{k} x{n}" for k, n in sorted(report.channels.items())) or \
        f"network {', '.join(sorted(report.networks))}"
    if not report.channels and not report.networks:
        return ("fail", "NCCL logged no channel (did the all-reduce run?)",
                "run it by hand with NCCL_DEBUG=INFO and read the first WARN line")
    if crosses_nodes and "socket" in report.kinds | report.networks:
        why = "no InfiniBand device found" if report.no_ib_device else "InfiniBand not used"
        return ("warn", f"between nodes NCCL uses TCP sockets ({why}; channels: {seen})",
                "if the nodes have InfiniBand/RoCE: load the IB drivers, check `ibv_devinfo`, "
                "set NCCL_IB_HCA; otherwise expect pipeline parallel across nodes, not tensor")
    if crosses_nodes and "ib" in report.kinds and not report.gdrdma:
        return ("warn", f"InfiniBand without GPUDirect RDMA (channels: {seen})",
                "load nvidia-peermem (modprobe nvidia_peermem) so NICs read GPU memory directly")
    if not crosses_nodes and "shm" in report.kinds and "p2p" not in report.kinds:
        return ("warn", f"GPUs talk through host shared memory, not P2P/NVLink (channels: {seen})",
                "check NCCL_P2P_DISABLE is unset, and that ACS/IOMMU allow peer access "
                "(nvidia-smi topo -p2p r)")
    return "pass", f"NCCL channels: {seen}" + (" (GPUDirect RDMA)" if report.gdrdma else ""), None


def all_reduce_rank(rank: int, world_size: int, rendezvous: Rendezvous, backend: str,
                    log_dir: str) -> None:
    """One rank of the probe: join the caller's store, all-reduce 1 MiB, check it, leave.
    NCCL writes its INFO log into log_dir."""
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_FILE"] = os.path.join(log_dir, "nccl.%h.%p.log")
    import torch
    import torch.distributed as dist

    from shardserve.runtime.distributed.process_group import join_rendezvous

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    store = join_rendezvous(rendezvous, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        tensor = torch.ones(1 << 18, device=device)
        dist.all_reduce(tensor)
        if tensor[0].item() != world_size:
            raise RuntimeError(f"all-reduce gave {tensor[0].item()}, expected {world_size}")
    finally:
        dist.destroy_process_group()


def _local_rank(rank: int, world_size: int, rendezvous: Rendezvous, log_dir: str) -> None:
    import torch
    torch.cuda.set_device(rank)
    all_reduce_rank(rank, world_size, rendezvous, "nccl", log_dir)


def _node_rank(rank: int, world_size: int, rendezvous: Rendezvous, backend: str) -> str:
    """A rank on a cluster node (a Ray task): its node's NCCL log text."""
    with tempfile.TemporaryDirectory(prefix="shardserve-nccl-") as log_dir:
        all_reduce_rank(rank, world_size, rendezvous, backend, log_dir)
        return _read_logs(log_dir)


def _read_logs(log_dir: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in Path(log_dir).glob("nccl.*"))


def run_local_probe(world_size: int) -> str:
    """All-reduce over `world_size` GPUs of this machine; NCCL's log text."""
    import torch.multiprocessing as mp

    from shardserve.runtime.distributed.process_group import start_rendezvous

    store, rendezvous = start_rendezvous("127.0.0.1", world_size)
    with tempfile.TemporaryDirectory(prefix="shardserve-nccl-") as log_dir:
        context = mp.start_processes(_local_rank, args=(world_size, rendezvous, log_dir),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + PROBE_TIMEOUT_SECONDS
        while not context.join(timeout=1.0):  # raises if a rank failed
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"the all-reduce did not finish in {PROBE_TIMEOUT_SECONDS} s")
        return _read_logs(log_dir)


def run_cluster_probe(address: str | None, backend: str = "nccl") -> tuple[list[str], str]:
    """One rank on each live node (with a GPU for NCCL), an all-reduce across them: (node IPs,
    NCCL's log text from every node). The store lives here; gloo runs it on CPU clusters."""
    from shardserve.launch.cluster.ray_nodes import connect
    from shardserve.runtime.distributed.process_group import start_rendezvous

    ray = connect(address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    needs_gpu = backend == "nccl"
    nodes = [n for n in ray.nodes() if n["Alive"] and (not needs_gpu or n["Resources"].get("GPU"))]
    if len(nodes) < 2:
        raise ValueError(f"{len(nodes)} live node(s){' with GPUs' if needs_gpu else ''}: "
                         "nothing crosses nodes")
    store, rendezvous = start_rendezvous(ray.util.get_node_ip_address(), len(nodes))
    task = ray.remote(_node_rank)
    refs = [task.options(num_cpus=0, num_gpus=1 if needs_gpu else 0,
                         scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(rank, len(nodes), rendezvous, backend)
            for rank, n in enumerate(nodes)]
    logs = ray.get(refs, timeout=PROBE_TIMEOUT_SECONDS)
    return [n["NodeManagerAddress"] for n in nodes], "\n".join(logs)
