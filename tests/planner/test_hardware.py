"""Hardware: declared strings, YAML files, NVML detection (through a stand-in) and Ray nodes."""

import os

import pytest

from shardserve.planner import PlanError, parse_declared
from shardserve.planner.detect import detect_local, hardware_from_ray_nodes

from tests.planner.factories import FakeNvml


@pytest.mark.parametrize("text, nodes, per_node, name", [
    ("8xH100-80GB", 1, 8, "H100-80GB"),
    ("2x8xH100-80GB", 2, 8, "H100-80GB"),
    ("3xL4", 1, 3, "L4"),
    ("h100", 1, 1, "H100-80GB"),
    ("4xa100-40gb", 1, 4, "A100-40GB"),
    ("2xRTX4090", 1, 2, "RTX4090"),
])
def test_declared(text, nodes, per_node, name):
    hw = parse_declared(text)
    assert (hw.num_nodes, hw.gpus_per_node, hw.gpu.name, hw.source) == (nodes, per_node, name,
                                                                         "declared")


def test_catalog_covers_the_listed_gpus():
    for name in ["H100-80GB", "H100", "H100-PCIE", "H200", "B200", "A100-80GB", "A100-40GB",
                 "L40S", "L4", "A10G", "A10", "T4", "V100-16GB", "RTX3090", "RTX4090",
                 "RTXA5000", "RTXA6000"]:
        gpu = parse_declared(name).gpu
        assert gpu.memory_bytes > 10 * 2**30 and gpu.hbm_bytes_per_s > 0
    assert parse_declared("L40S").interconnect == "pcie"
    assert parse_declared("H100").interconnect == "nvlink"
    assert not parse_declared("T4").gpu.has_bf16


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(PlanError, match="unknown GPU 'Z9000'; known: H100-80GB, H100-PCIE"):
        parse_declared("4xZ9000")


@pytest.mark.parametrize("text", ["x8", "0xH100", "8x", "2x0xH100"])
def test_malformed_declared(text):
    with pytest.raises(PlanError):
        parse_declared(text)


def test_yaml_mixed_hardware(tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text("nodes:\n  - {gpu: H100-80GB, count: 8, ip: 10.1.0.1}\n"
                    "  - {gpu: a100-80gb, count: 4, ip: 10.1.0.2}\ninter_node_gbps: 25\n")
    hw = parse_declared(str(path))
    assert hw.total_gpus == 12 and hw.gpus_per_node == 4
    # every rank is planned for the weakest figures: H100's memory, A100's bandwidth
    assert hw.gpu.memory_bytes == 81559 * 2**20 and hw.gpu.hbm_bytes_per_s == 2039e9
    assert not hw.gpu.has_fp8
    assert hw.node_ips == ["10.1.0.1", "10.1.0.2"]
    assert hw.inter_node_bytes_per_s == 25e9


@pytest.mark.parametrize("body, message", [
    ("nodes: []\n", "non-empty 'nodes' list"),
    ("nodes:\n  - {gpu: H100}\n", r"nodes\[0\] needs 'gpu' and 'count'"),
    ("nodes:\n  - {gpu: H100, count: -1}\n", "positive integer"),
    ("nodes: [\n", "not valid YAML"),
])
def test_yaml_errors(tmp_path, body, message):
    path = tmp_path / "hw.yaml"
    path.write_text(body)
    with pytest.raises(PlanError, match=message):
        parse_declared(str(path))


def bus(i):
    return f"00000000:{i + 1:02X}:00.0"


def test_nvml_detects_h100s_behind_nvswitch():
    switch = {(g, link): "00000000:C0:00.0" for g in range(4) for link in range(4)}
    nvml = FakeNvml(["NVIDIA H100 80GB HBM3"] * 4, total=81559 * 2**20, links=switch)
    hw = detect_local(nvml)
    assert (hw.source, hw.total_gpus, hw.gpu.name, hw.interconnect) == \
        ("detected", 4, "H100-80GB", "nvlink")
    assert nvml.shutdown


def test_nvml_partial_nvlink_is_planned_as_pcie():
    bridge = {(0, 0): bus(1), (1, 0): bus(0), (2, 0): bus(3), (3, 0): bus(2)}  # pairs only
    hw = detect_local(FakeNvml(["NVIDIA RTX A6000"] * 4, total=49140 * 2**20, links=bridge))
    assert hw.interconnect == "pcie" and hw.gpu.name == "RTXA6000"
    assert any("NVLink joins only 2 of 6 GPU pairs" in n for n in hw.notes)


def test_nvml_pcie_cards_and_free_memory_warning():
    free = [40 * 2**30, 10 * 2**30]
    hw = detect_local(FakeNvml(["NVIDIA L40S"] * 2, total=46068 * 2**20, free=free))
    assert hw.interconnect == "pcie" and hw.nodes[0].free_memory_bytes == tuple(free)
    from shardserve.planner import PlanOptions, load_model, make_plan
    plan = make_plan(load_model("Qwen/Qwen2.5-7B-Instruct"), hw, PlanOptions())
    assert any(w.startswith("GPU 1 has 10.0 GiB free") for w in plan.warnings)


def test_nvml_unknown_gpu_uses_measured_memory():
    hw = detect_local(FakeNvml(["NVIDIA Hypothetical X"], total=32 * 2**30))
    assert hw.gpu.name == "NVIDIA Hypothetical X" and hw.gpu.memory_bytes == 32 * 2**30


def test_no_nvml_library_gives_a_cpu_plan():
    hw = detect_local(FakeNvml([], fail_init=True))
    assert hw.is_cpu and hw.total_gpus == 1
    assert hw.gpu.memory_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_real_nvml_where_available():
    hw = detect_local()  # on this CPU machine: no driver, so a CPU plan; on a GPU: the GPUs
    assert hw.total_gpus >= 1


def test_ray_nodes():
    nodes = [
        {"Alive": True, "NodeManagerAddress": "10.0.0.1",
         "Resources": {"CPU": 64.0, "GPU": 8.0, "accelerator_type:H100": 1.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.2",
         "Resources": {"CPU": 64.0, "GPU": 8.0, "accelerator_type:H100": 1.0}},
        {"Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"GPU": 8.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.4", "Resources": {"CPU": 8.0}},
    ]
    hw = hardware_from_ray_nodes(nodes)
    assert (hw.source, hw.num_nodes, hw.gpus_per_node, hw.gpu.name) == ("ray", 2, 8, "H100-80GB")
    assert hw.node_ips == ["10.0.0.1", "10.0.0.2"]


def test_ray_node_without_gpu_type_is_explained():
    with pytest.raises(PlanError, match="does not say which GPU"):
        hardware_from_ray_nodes([{"Alive": True, "NodeManagerAddress": "10.0.0.1",
                                  "Resources": {"GPU": 2.0}}])
