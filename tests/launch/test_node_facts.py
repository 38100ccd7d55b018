"""Node facts read off this machine, the differences that break a multi-node launch, and the
choice of the node IP against this machine's real interface table."""

import copy
import functools
import secrets
import subprocess

import pytest
from netns import SHARDSERVE, namespaces_unavailable

from shardserve.launch.cluster.ray_cluster import ClusterError, choose_node_ip, route_source
from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.launch.cluster.node_facts import (env_differences, interface_addresses, interface_problem,
                                          ip_problem, model_differences, node_facts,
                                          version_differences)
from shardserve.launch.cluster.ray_nodes import node_problems


@pytest.fixture(scope="module")
def here():
    return node_facts(str(DEMO_MODEL_DIR), ip="10.0.0.1")


def test_facts_of_this_machine(here):
    assert here["interfaces"]["lo"] == "127.0.0.1"
    assert here["versions"]["torch"] and here["versions"]["shardserve"]
    assert "config.json" in here["model"]["files"] and any(
        name.endswith(".safetensors") for name in here["model"]["files"])
    assert node_facts("/no/such/model")["model"]["files"] is None


def test_differences_name_what_to_fix(here):
    other = copy.deepcopy(here)
    assert not version_differences(here, other) and not model_differences(here, other)
    other["versions"]["torch"] = "2.5.1"
    assert version_differences(here, other) == [
        f"torch 2.5.1 there, {here['versions']['torch']} on 10.0.0.1"]
    weights = next(n for n in other["model"]["files"] if n.endswith(".safetensors"))
    other["model"]["files"][weights] -= 1000
    del other["model"]["files"]["config.json"]
    problems = model_differences(here, other)
    assert any("config.json is missing" in p for p in problems)
    assert any(weights in p and "(a partial copy?)" in p for p in problems)
    other["model"]["files"] = None
    assert model_differences(here, other) == [f"the model folder {DEMO_MODEL_DIR} is missing"]


def test_the_several_ips_pitfall(here):
    node = copy.deepcopy(here)
    node["ip"] = "127.0.0.1"
    assert ip_problem(node) is None
    node["ip"] = "172.31.255.254"  # an address Ray may have taken from another host's view
    assert "none of its interfaces has" in ip_problem(node)
    nodes = [{"ip": "172.31.255.254", "alive": True, "facts": node},
             {"ip": "10.9.9.9", "alive": True, "error": "GetTimeoutError"},
             {"ip": "10.9.9.8", "alive": False}]
    problems = node_problems(nodes, here)
    assert set(problems) == {"172.31.255.254", "10.9.9.9"}


def test_environment_and_interface_variables(here):
    node = copy.deepcopy(here)
    node["env"] = {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "ib7"}
    assert env_differences(here, node) == ["NCCL_IB_DISABLE=1 there, <unset> on the head"]
    assert "NCCL_SOCKET_IFNAME=ib7 names none of its interfaces" in interface_problem(node)
    node["env"]["NCCL_SOCKET_IFNAME"] = "^docker"
    assert interface_problem(node) is None


def test_node_ip_choice_on_this_machines_interfaces():
    table = interface_addresses()
    chosen = choose_node_ip(None, None)
    assert table[chosen.interface] == chosen.ip and not chosen.ip.startswith("127.")
    local = choose_node_ip("127.0.0.1", None)
    assert local.ip == "127.0.0.1" and local.interface == "lo"
    toward = choose_node_ip(chosen.ip, None)
    assert toward.ip == route_source(chosen.ip) == chosen.ip
    assert choose_node_ip(None, "127.0.0.1").reason == "given with --node-ip"
    with pytest.raises(ClusterError, match="is on no interface of this host"):
        choose_node_ip(None, "203.0.113.77")


@pytest.mark.slow
def test_host_with_two_networks_and_no_default_route(tmp_path):
    """A real host (a namespace) with two interfaces and no default route: `up` cannot guess and
    says so; `join` takes the interface on the head's network and fails fast when nothing listens."""
    why_not = namespaces_unavailable()
    if why_not:
        pytest.skip(f"cannot make a test host: {why_not}")
    netns = f"ssnd{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        for name, address in (("data0", "10.61.0.5/24"), ("ib0", "192.168.61.5/24")):
            for args in (["link", "add", name, "type", "veth", "peer", "name", f"{name}p"],
                         ["addr", "add", address, "dev", name], ["link", "set", f"{name}p", "up"],
                         ["link", "set", name, "up"]):
                subprocess.run(["ip", "-n", netns, *args], check=True)
        run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=60)
        env = ["env", f"SHARDSERVE_CLUSTER_DIR={tmp_path}"]
        up = run(["ip", "netns", "exec", netns, *env, *SHARDSERVE, "cluster", "up", "--head"])
        assert up.returncode == 1 and "Traceback" not in up.stderr
        assert "no default route and 2 candidate interfaces" in up.stderr
        assert "data0 10.61.0.5, ib0 192.168.61.5" in up.stderr and "--node-ip" in up.stderr
        join = run(["ip", "netns", "exec", netns, *env, *SHARDSERVE, "cluster", "join",
                    "192.168.61.9:6379", "--token-file", "/dev/null"])
        assert join.returncode == 1 and "Traceback" not in join.stderr
        assert "cannot reach the head at 192.168.61.9:6379" in join.stderr
        assert not (tmp_path / "node.json").exists()
    finally:
        subprocess.run(["ip", "netns", "del", netns])
