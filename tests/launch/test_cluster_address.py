"""`--ray-address auto` is the cluster this host joined through `cluster up/join` (its record), said on
stderr; without a live record it is refused, naming any Ray found running here and what to pass, never
attached to another Ray instance. `cluster up --port` in Ray's own ports, or in use, is refused before Ray
starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
from typer.testing import CliRunner

from shardserve.launch.cluster import ray_cluster as cluster
from shardserve.launch.cli import app
from shardserve.launch.cluster.ray_cluster import ClusterError, NodeRecord, read_record, resolve_address, session_pids
from shardserve.launch.cluster.ray_ports import RAY_SERVICE_PORTS, RAY_WORKER_PORTS, free_head_port, local_ray_instances

SHARDSERVE = [sys.executable, "-m", "shardserve.launch"]


def write_record(folder, session_id: int, address: str = "10.1.2.3:6379") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = NodeRecord("head", address, "10.1.2.3", "eth0", session_id, [], str(folder / "ray"))
    (folder / "node.json").write_text(json.dumps(asdict(record)))


def test_auto_is_the_cluster_this_host_joined_and_says_so(tmp_path, capsys):
    write_record(tmp_path, os.getsid(0))  # a session that runs: this test's own
    assert resolve_address("auto", tmp_path) == "10.1.2.3:6379"
    said = capsys.readouterr().err
    assert "the cluster at 10.1.2.3:6379" in said and str(tmp_path / "node.json") in said
    assert "`shardserve cluster up`" in said
    assert resolve_address("10.9.9.9:1234", tmp_path) == "10.9.9.9:1234"  # an address is Ray's to read


@pytest.mark.slow
def test_a_record_whose_node_no_longer_runs_is_refused(tmp_path):
    ended = subprocess.Popen(["true"], start_new_session=True)
    ended.wait()
    assert not session_pids(ended.pid)
    write_record(tmp_path, ended.pid)
    with pytest.raises(ClusterError, match="no longer runs: `shardserve cluster down`"):
        resolve_address("auto", tmp_path)


@pytest.mark.slow
def test_without_a_record_a_running_ray_is_named_not_joined(tmp_path):
    # a process with the command line of a Ray process (Ray's own 'auto' would attach to it)
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--gcs-address=203.0.113.7:6379"])
    try:
        deadline = time.monotonic() + 10
        while "203.0.113.7:6379" not in local_ray_instances() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ClusterError) as e:
            resolve_address("auto", tmp_path)
    finally:
        fake.kill()
        fake.wait()
    message = str(e.value)
    assert f"203.0.113.7:6379 (process {fake.pid})" in message and "this host joined no cluster" in message
    assert "pass --ray-address " in message


def test_without_a_record_or_a_ray_auto_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "local_ray_instances", dict)
    with pytest.raises(ClusterError, match=r"no Ray runs here: `shardserve cluster up --head`.* --ray-address HOST:PORT"):
        resolve_address("auto", tmp_path)


@pytest.mark.slow
def test_plan_with_auto_and_no_record_is_one_red_line(tmp_path):
    done = subprocess.run([*SHARDSERVE, "plan", "--model", "shardserve-demo", "--ray-address", "auto"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SHARDSERVE_CLUSTER_DIR": str(tmp_path)})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: --ray-address auto: this host joined no cluster")


@pytest.mark.parametrize("port, named", [
    (RAY_WORKER_PORTS.start, "inside Ray's worker-port range 10002-19999"),
    (12345, "inside Ray's worker-port range 10002-19999"),
    (RAY_WORKER_PORTS.stop - 1, "inside Ray's worker-port range"),
    *[(port, f"the default port of {what}") for port, what in RAY_SERVICE_PORTS.items()],
])
def test_a_head_port_among_rays_own_is_refused_before_ray_starts(tmp_path, port, named):
    state = tmp_path / "state"
    result = CliRunner().invoke(app, ["cluster", "up", "--head", "--port", str(port), "--state-dir", str(state)])
    assert result.exit_code == 1 and named in result.output and "--port 0 for any free port" in result.output
    assert not state.exists()  # nothing started, nothing recorded


@pytest.mark.slow
def test_a_head_port_in_use_is_refused_with_a_free_choice(tmp_path):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([*SHARDSERVE, "cluster", "up", "--head", "--port", str(port), "--state-dir",
                               str(tmp_path / "state")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert f"--port {port} is in use on this host" in done.stderr
    choice = int(done.stderr.split("e.g. --port ")[1].split()[0])
    assert choice != port and choice not in RAY_WORKER_PORTS and choice not in RAY_SERVICE_PORTS
    assert not (tmp_path / "state").exists()


def test_the_suggested_port_is_free_and_clear_of_rays():
    port = free_head_port()
    assert port is not None and port not in RAY_WORKER_PORTS and port not in RAY_SERVICE_PORTS


@pytest.mark.slow
def test_auto_with_a_real_cluster_and_beside_it(tmp_path):
    """One real head: `auto` with its record plans on it and says which; with no record the same Ray is
    named and refused."""
    env = {**os.environ, "SHARDSERVE_CLUSTER_DIR": str(tmp_path / "ours")}
    up = subprocess.run([*SHARDSERVE, "cluster", "up", "--head", "--port", "0", "--num-cpus", "1"], env=env,
                        capture_output=True, text=True, timeout=240)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        address = read_record(tmp_path / "ours").address
        plan = [*SHARDSERVE, "plan", "--model", "shardserve-demo", "--ray-address", "auto", "--format", "json"]
        ours = subprocess.run(plan, env=env, capture_output=True, text=True, timeout=120)
        assert ours.returncode == 0, ours.stderr
        assert f"--ray-address auto: the cluster at {address}" in ours.stderr
        assert json.loads(ours.stdout)["hardware"]["source"] == "ray"
        beside = subprocess.run(plan, env={**env, "SHARDSERVE_CLUSTER_DIR": str(tmp_path / "none")},
                                capture_output=True, text=True, timeout=120)
        assert beside.returncode == 1 and f"Ray runs here: {address} (process " in beside.stderr
    finally:
        subprocess.run([*SHARDSERVE, "cluster", "down"], env=env, capture_output=True, timeout=120)
