"""Two hosts (network namespaces joined by veth): `cluster up` and `join` with each host's own IP,
`status`, a launch with one pipeline stage on each host matching the single-process output, a
model missing on one node refused before loading, and a worker's `cluster down` ending the
server; afterwards no process and no namespace is left."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time

import pytest

from netns import SHARDSERVE, delete_hosts, make_hosts, namespace_exists, namespaces_unavailable
from shardserve.launch.cluster.ray_cluster import read_record, session_pids
from shardserve.launch.demo import DEMO_MODEL_DIR

pytestmark = pytest.mark.slow
PROMPT, MAX_TOKENS = "The Python interpreter", 12
_why_not = namespaces_unavailable()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if _why_not:
        pytest.skip(f"cannot make test hosts: {_why_not}")
    root = tmp_path_factory.mktemp("hosts")
    hidden = root / "model-hidden-on-b"  # a model folder host b does not see (tmpfs over it)
    shutil.copytree(DEMO_MODEL_DIR, hidden)
    a, b = make_hosts(root)
    sessions: list[int] = []
    try:
        yield a, b, hidden, sessions
    finally:
        for host in (b, a):
            record = read_record(host.state_dir)
            if record:
                sessions.append(record.session_id)
            host.shardserve("cluster", "down", timeout=60)
        delete_hosts((a, b))
    # nothing of ours is left: no Ray process of either node, no namespace
    assert all(not session_pids(s) for s in sessions), "a Ray process outlived `cluster down`"
    assert not namespace_exists(a.netns) and not namespace_exists(b.netns)


@pytest.fixture(scope="module")
def cluster(hosts):
    a, b, hidden, sessions = hosts
    up = a.shardserve("cluster", "up", "--head", "--port", "0", "--num-cpus", "1")
    assert up.returncode == 0, up.stdout + up.stderr
    record = read_record(a.state_dir)
    sessions.append(record.session_id)
    token = a.state_dir / "auth_token"
    join = b.run(["sh", "-c", f'mount -t tmpfs tmpfs "{hidden}" && exec "$@"', "sh",
                  *SHARDSERVE, "cluster", "join", record.address, "--token-file", str(token),
                  "--num-cpus", "1"])
    assert join.returncode == 0, join.stdout + join.stderr
    sessions.append(read_record(b.state_dir).session_id)
    return a, b, hidden, record.address, up.stdout + up.stderr, join.stdout


def test_up_and_join_choose_the_interface_that_routes_to_the_head(cluster):
    a, b, _, address, up_out, join_out = cluster
    assert address.startswith(f"{a.ip}:")
    assert f"node IP {a.ip} on {a.interface}" in " ".join(up_out.split())
    assert "not encrypted" in up_out
    joined = " ".join(join_out.split())
    assert f"node IP {b.ip} on {b.interface} ({b.interface} routes to the head {a.ip})" in joined
    assert f"NCCL_SOCKET_IFNAME={b.interface}" in joined
    for host in (a, b):  # the token is the owner's alone
        assert (host.state_dir / "auth_token").stat().st_mode & 0o777 == 0o600


def test_status_lists_both_hosts(cluster):
    a, b, *_ = cluster
    status = b.shardserve("cluster", "status", "--format", "json")  # from the worker host too
    assert status.returncode == 0, status.stdout + status.stderr
    nodes = {n["ip"]: n for n in json.loads(status.stdout)["nodes"]}
    assert set(nodes) == {a.ip, b.ip}
    assert nodes[a.ip]["head"] and not nodes[b.ip]["head"]
    assert all(n["alive"] and n["cpus"] == 1 and n["gpus"] == 0 for n in nodes.values())
    assert nodes[a.ip]["versions"] == nodes[b.ip]["versions"]
    assert nodes[a.ip]["versions"]["ray"]


def test_doctor_checks_every_node(cluster, tmp_path):
    a, b, hidden, *_ = cluster
    ok = a.shardserve("doctor", "--ray-address", "auto", "--format", "json")
    checks = {c["name"]: c for c in json.loads(ok.stdout)["checks"]}
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert checks["ray_nodes"]["status"] == "pass" and b.ip in checks["ray_nodes"]["detail"]
    assert checks["node_parity"]["status"] == "pass" and checks["node_env"]["status"] == "pass"
    plan = tmp_path / "plan.yaml"
    made = a.shardserve("plan", "--model", str(hidden), "--hardware", "cpu", "-o", str(plan))
    assert made.returncode == 0, made.stderr
    bad = a.shardserve("doctor", "--plan", str(plan), "--format", "json")  # the host's cluster
    parity = {c["name"]: c for c in json.loads(bad.stdout)["checks"]}["node_parity"]
    assert bad.returncode == 1 and parity["status"] == "fail"
    assert f"{b.ip}: the model folder {hidden} is empty" in parity["detail"]


def test_all_reduce_with_a_rank_on_each_host(cluster):
    """The doctor's cross-node probe, with gloo on these CPU hosts: one rank placed on each node,
    the store on the launching host, the sum checked (NCCL's log is read on GPU clusters)."""
    a, b, *_ = cluster
    code = ("import json\n"
            "from shardserve.launch.cluster.nccl_probe import run_cluster_probe\n"
            "ips, log = run_cluster_probe(None, backend='gloo')  # RAY_ADDRESS\n"
            "print(json.dumps(ips))\n")
    result = a.run([sys.executable, "-c", code],
                   RAY_ADDRESS=read_record(a.state_dir).address,
                   RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(a.state_dir / "auth_token"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(json.loads(result.stdout.splitlines()[-1])) == sorted([a.ip, b.ip])


def test_without_the_token_the_cluster_refuses(cluster, tmp_path):
    _, b, _, address, *_ = cluster
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    result = b.run([*SHARDSERVE, "cluster", "status", "--address", address],
                   RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(wrong), timeout=240)
    assert result.returncode == 1
    assert "cannot join the Ray cluster" in result.stderr and "Traceback" not in result.stderr


def test_model_missing_on_a_node_is_refused_before_loading(cluster, tmp_path):
    a, b, hidden, address, *_ = cluster
    result = a.shardserve("launch", "--model", str(hidden), "--ray-address", address,
                          "--pipeline-parallel-size", "2", "--distributed-executor-backend",
                          "ray", "--port", "8000")
    assert result.returncode == 1
    assert f"node {b.ip}: the model folder {hidden} is empty" in result.stderr
    assert "Traceback" not in result.stderr and "rank 0" not in result.stderr


def test_pipeline_stage_on_each_host_then_a_lost_node(cluster, tmp_path):
    from shardserve.runtime import LLM, SamplingParams

    a, b, _, address, *_ = cluster
    log = tmp_path / "launch.log"
    # the launching shell's GLOO_SOCKET_IFNAME must not override each node's own
    server = a.popen([*SHARDSERVE, "launch", "--ray-address", "auto",  # the cluster a joined
                      "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray",
                      "--port", "8000", "--env", "SS_MARK=two-hosts"], log,
                     GLOO_SOCKET_IFNAME="lo")
    url, watcher = "http://127.0.0.1:8000", None
    try:
        deadline = time.monotonic() + 240
        while a.http(f"{url}/health", timeout=5)[0] != 200:
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(1)
        placed = dict(re.findall(r"rank \d \(tp 0/1, pp \d/2, layers \d+-\d+\) runs on (\S+) \((.*)\)",
                                 log.read_text()))
        assert set(placed) == {a.ip, b.ip}, log.read_text()  # one stage on each host
        # the store listened on the cluster interface (not 0.0.0.0), b's rank reached it, then it closed
        assert re.search(rf"the rendezvous store on {re.escape(a.ip)}:\d+ is closed", log.read_text())
        for host in (a, b):  # each node's interface, and the chosen variable everywhere
            assert placed[host.ip] == (f"GLOO_SOCKET_IFNAME={host.interface} "
                                       f"NCCL_SOCKET_IFNAME={host.interface} SS_MARK=two-hosts")
        code, body = a.http(f"{url}/v1/completions", {
            "model": "shardserve-demo", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "temperature": 0})
        assert code == 200, body
        with LLM(str(DEMO_MODEL_DIR), device="cpu", kv_cache_memory_bytes=2**24, max_model_len=1024) as llm:
            expected = llm.generate([PROMPT], SamplingParams(temperature=0.0,
                                                             max_tokens=MAX_TOKENS))[0]
        assert json.loads(body)["choices"][0]["text"] == expected.outputs[0].text

        health = tmp_path / "health.txt"
        watcher = a.watch(f"{url}/health", health)
        while not health.exists() or "200" not in health.read_text():
            time.sleep(0.1)
        down = b.shardserve("cluster", "down")
        assert down.returncode == 0, down.stderr
        lost = time.monotonic()
        server.wait(timeout=60)
        assert time.monotonic() - lost < 30, "the lost node was noticed too late"
        assert server.returncode == 1, log.read_text()
        assert "503" in health.read_text().split(), "/health never answered 503"
        assert "engine died" in log.read_text()
    finally:
        for process in (server, watcher):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    status = a.shardserve("cluster", "status", "--format", "json")
    nodes = {n["ip"]: n for n in json.loads(status.stdout)["nodes"]}
    assert status.returncode == 1 and not nodes[b.ip]["alive"] and nodes[a.ip]["alive"]
