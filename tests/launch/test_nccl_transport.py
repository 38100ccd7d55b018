"""The doctor's NCCL transport check on real NCCL INFO logs (nccl_logs/README.md says where each
comes from); the probe itself needs GPUs and runs in tests/gpu."""

from pathlib import Path

import pytest

from shardserve.launch.cluster.doctor import check_nccl_transport
from shardserve.launch.cluster.nccl_probe import judge, parse_nccl_log
from shardserve.planner.detect import detect_local

from tests.planner.factories import FakeNvml, plan_for

LOGS = Path(__file__).parent / "nccl_logs"


def report(name: str):
    return parse_nccl_log((LOGS / name).read_text())


@pytest.mark.parametrize("name, kinds, gdrdma, status", [
    ("ib_gdrdma.log", {"ib"}, True, "pass"),
    ("p2p_and_ib.log", {"ib", "p2p"}, True, "pass"),
    ("ib_no_gdr.log", {"ib"}, False, "warn"),
    ("socket_two_nodes.log", {"socket", "shm"}, False, "warn"),
    ("p2p_ipc.log", {"p2p", "socket"}, False, "warn"),
])
def test_channels_between_nodes(name, kinds, gdrdma, status):
    found = report(name)
    assert found.kinds == kinds and found.gdrdma == gdrdma
    assert judge(found, crosses_nodes=True)[0] == status


def test_socket_fallback_without_ib_device():
    found = report("no_ib_socket.log")
    assert found.no_ib_device and found.networks == {"socket"} and not found.channels
    status, detail, fix = judge(found, crosses_nodes=True)
    assert status == "warn" and "no InfiniBand device found" in detail and "NCCL_IB_HCA" in fix


def test_inside_a_node_shared_memory_instead_of_p2p_warns():
    shm_lines = [line for line in (LOGS / "socket_two_nodes.log").read_text().splitlines()
                 if "SHM/" in line]
    status, detail, fix = judge(parse_nccl_log("\n".join(shm_lines)), crosses_nodes=False)
    assert status == "warn" and "NCCL_P2P_DISABLE" in fix
    p2p_lines = [line for line in (LOGS / "p2p_ipc.log").read_text().splitlines() if "P2P/" in line]
    assert judge(parse_nccl_log("\n".join(p2p_lines)), crosses_nodes=False)[0] == "pass"
    assert judge(parse_nccl_log("no nccl here"), crosses_nodes=False)[0] == "fail"


def test_doctor_runs_the_probe_over_the_plans_tensor_parallel_ranks():
    plan = plan_for("meta-llama/Llama-3.1-70B-Instruct", "8xH100-80GB").record()
    eight = detect_local(FakeNvml(["NVIDIA H100 80GB HBM3"] * 8, total=81559 * 2**20))
    sizes = []

    def probe(world_size):
        sizes.append(world_size)
        return "\n".join(line for line in (LOGS / "p2p_and_ib.log").read_text().splitlines()
                         if "P2P/" in line)

    check = check_nccl_transport(eight, plan, probe)
    assert sizes == [plan.parallel.tensor_parallel_size]
    assert check.status == "pass" and "p2p x4" in check.detail

    def failing(world_size):
        raise RuntimeError("NCCL error: unhandled system error")

    broken = check_nccl_transport(eight, plan, failing)
    assert broken.status == "fail" and "unhandled system error" in broken.detail
    assert check_nccl_transport(detect_local(FakeNvml([], fail_init=True)), plan).status == "skip"


def test_doctor_judges_the_transport_between_gpu_nodes():
    from shardserve.launch.cluster.doctor import check_nccl_between_nodes
    nodes = [{"ip": "10.0.0.1", "alive": True, "gpus": 8}, {"ip": "10.0.0.2", "alive": True, "gpus": 8}]
    calls = []

    def probe(address):
        calls.append(address)
        return ["10.0.0.1", "10.0.0.2"], (LOGS / "socket_two_nodes.log").read_text()

    check = check_nccl_between_nodes("10.0.0.1:6379", nodes, probe)
    assert calls == ["10.0.0.1:6379"]
    assert check.status == "warn" and "TCP sockets" in check.detail
    assert check.detail.startswith("all-reduce across 10.0.0.1, 10.0.0.2")
    one_gpu_node = [nodes[0], {**nodes[1], "gpus": 0}]
    assert check_nccl_between_nodes("x", one_gpu_node, probe).status == "skip"
