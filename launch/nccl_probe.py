"""Which transport NCCL really uses: a small all-reduce over the plan's ranks with NCCL_DEBUG=INFO,
and a reader for the channel lines NCCL logs (`... via P2P/CUMEM`, `via NET/IB/0/GDRDMA`)."""

from __future__ import annotations

import collections
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

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


def _probe_rank(rank: int, world_size: int, port: int, log_dir: str) -> None:
    """One rank of the probe (a spawned process): join, all-reduce 1 MiB, leave."""
    os.environ["NCCL_DEBUG"] = "INFO"
    os.environ["NCCL_DEBUG_FILE"] = os.path.join(log_dir, "nccl.%h.%p.log")
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    tensor = torch.ones(1 << 18, device="cuda")
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    if tensor[0].item() != world_size:
        raise RuntimeError(f"all-reduce gave {tensor[0].item()}, expected {world_size}")
    dist.destroy_process_group()


def run_local_probe(world_size: int) -> str:
    """All-reduce over `world_size` GPUs of this machine; NCCL's log text."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="shardserve-nccl-") as log_dir:
        context = mp.start_processes(_probe_rank, args=(world_size, port, log_dir),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + PROBE_TIMEOUT_SECONDS
        while not context.join(timeout=1.0):  # raises if a rank failed
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"the all-reduce did not finish in {PROBE_TIMEOUT_SECONDS} s")
        return "\n".join(p.read_text(errors="replace") for p in Path(log_dir).glob("nccl.*"))
