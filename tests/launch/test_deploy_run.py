"""`deploy`'s files run, not only parsed: the LeaderWorkerSet's leader and worker commands and the
sbatch script, exactly as emitted for a plan of two CPU ranks, run on two test hosts (network
namespaces, netns.py) and serve a completion with a pipeline stage on each host. A lost worker pod
ends the leader (/health 503, exit 1); a cancelled Slurm job stops whole.

What stands in for the cluster (every pod and node is a booted host: its own network, process
table and /proc, the machine's files):
  LWS    each pod is a host running its container's command from lws.yaml, with the manifest's env
         (POD_IP: the host's IP; the ray-token Secret: a token made here), the variables LWS sets
         (LWS_LEADER_ADDRESS: the leader pod's DNS name, resolved by the hosts' /etc/hosts;
         LWS_GROUP_SIZE, LWS_WORKER_INDEX) and its mounts: the plan ConfigMap's mountPath -> a
         folder of the pod holding the ConfigMap's files (the path in the command rewritten to it),
         the model-cache hostPath -> itself (hostPath mounts it at the same path), /dev/shm -> the
         machine's, /tmp -> the machine's (Ray's folders there have random names), the pod's
         ~/.shardserve/cluster -> its host's state folder. Deleting a pod: SIGKILL to all in it.
  Slurm  `scontrol show hostnames` and `srun` are the scripts below, on PATH; the batch script runs
         on the first node with the SLURM_* variables sbatch sets from its #SBATCH lines, output in
         %x-%j.out; each node has its own TMPDIR (a folder bind-mounted per host); the second node's
         process table is nested in the first's, where srun runs. scancel: SIGTERM to every process
         of the job (what proctrack/cgroup signals), which must all end within KillWait.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from shardserve.launch.cluster.ray_cluster import read_record
from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.launch.plan_view import write_plan
from tests.launch.deploy_cases import cpu_cluster_plan
from tests.launch.netns import (SHARDSERVE, Host, delete_hosts, make_hosts, name_hosts, namespace_exists,
                                namespaces_unavailable)

pytestmark = pytest.mark.slow
PROMPT, MAX_TOKENS = "The Python interpreter", 12
NAME = "demo"  # the objects' and the job's name
LEADER, WORKER = f"{NAME}-0.{NAME}.default", f"{NAME}-0-1.{NAME}.default"  # the LWS pods' DNS names
NODES = ("node1", "node2")  # the Slurm job's nodes
KILL_WAIT_SECONDS = 30  # Slurm's default KillWait
SERVE_TIMEOUT = 240
_why_not = namespaces_unavailable()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if _why_not:
        pytest.skip(f"cannot make test hosts: {_why_not}")
    a, b = make_hosts(tmp_path_factory.mktemp("hosts"))
    try:
        name_hosts({LEADER: a, WORKER: b, NODES[0]: a, NODES[1]: b})
        yield a, b
    finally:
        for host in (a, b):
            host.kill_all()
        delete_hosts((a, b))
    assert not namespace_exists(a.netns) and not namespace_exists(b.netns)


@pytest.fixture(scope="module")
def plan_and_expected(hosts, tmp_path_factory):
    """The plan (the model in a cache folder every host sees) and the single-process reference text."""
    from shardserve.runtime import LLM, SamplingParams

    root = tmp_path_factory.mktemp("deploy")
    cache = root / "cache"
    shutil.copytree(DEMO_MODEL_DIR, cache / "shardserve-demo")
    plan = root / "plan.yaml"
    write_plan(cpu_cluster_plan(str(cache / "shardserve-demo"), tuple(h.ip for h in hosts)), plan)
    with LLM(str(DEMO_MODEL_DIR), device="cpu", kv_cache_memory_bytes=2**24, max_model_len=1024) as llm:
        expected = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
    return plan, cache, expected.outputs[0].text


def deploy(plan: Path, cache: Path, out: Path, *args: str) -> Path:
    done = subprocess.run([*SHARDSERVE, "deploy", str(plan), "--name", NAME, "--model-cache", f"hostpath:{cache}",
                           "-o", str(out), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (written,) = out.iterdir()
    return written


def path_env() -> str:
    return f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # the image's PATH: shardserve, python


def pod_command(pod: dict, host: Host, objects: dict, secret_values: dict, lws: dict) -> tuple[list[str], dict]:
    """The container's command and environment as the kubelet would run them on `host`."""
    (container,) = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    command = list(container["command"])
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume:  # its files in a folder of the pod; the command's path rewritten
            folder = host.state_dir.parent / f"{host.netns}-{mount['name']}"
            folder.mkdir(exist_ok=True)
            for file_name, text in objects[("ConfigMap", volume["configMap"]["name"])]["data"].items():
                (folder / file_name).write_text(text)
            command = [part.replace(mount["mountPath"] + "/", f"{folder}/") for part in command]
        elif "hostPath" in volume:
            assert volume["hostPath"]["path"] == mount["mountPath"]  # the same path: nothing to map
        else:
            assert volume.get("emptyDir", {}).get("medium") == "Memory" and mount["mountPath"] == "/dev/shm"
    env = {"PATH": path_env(), **lws}
    for item in container["env"]:
        source = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = item["value"]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[item["name"]] = host.ip
        else:
            ref = source["secretKeyRef"]
            env[item["name"]] = secret_values[(ref["name"], ref["key"])]
    return command, env


def wait_serving(host: Host, processes: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + SERVE_TIMEOUT
    while host.http("http://127.0.0.1:8000/health", timeout=5)[0] != 200:
        tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs if log.exists())
        assert all(p.poll() is None for p in processes), tails
        assert time.monotonic() < deadline, tails
        time.sleep(1)


def complete(host: Host, url: str, expected: str) -> None:
    code, body = host.http(f"{url}/v1/models")
    assert code == 200, body
    model = json.loads(body)["data"][0]["id"]
    code, body = host.http(f"{url}/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0})
    assert code == 200, body
    assert json.loads(body)["choices"][0]["text"] == expected


def stage_hosts(log: Path) -> set[str]:
    return set(re.findall(r"rank \d \(tp 0/1, pp \d/2, layers \d+-\d+\) runs on (\S+)", log.read_text()))


def test_lws_group_serves_across_two_pods_and_a_lost_worker_ends_the_leader(hosts, plan_and_expected, tmp_path):
    a, b = hosts
    plan, cache, expected = plan_and_expected
    manifest = deploy(plan, cache, tmp_path / "out", "--target", "lws", "--image", "test/shardserve:dev")
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(manifest.read_text()) if o}
    template = objects[("LeaderWorkerSet", NAME)]["spec"]["leaderWorkerTemplate"]
    secret_values = {(f"{NAME}-ray-token", "token"): secrets.token_hex(32)}
    group = {"LWS_LEADER_ADDRESS": LEADER, "LWS_GROUP_SIZE": str(template["size"])}
    assert template["size"] == 2
    logs, processes, watcher = [tmp_path / "leader.log", tmp_path / "worker.log"], [], None
    try:
        for host in hosts:  # each pod: a process table of its own; /tmp shared (Ray's folders there differ)
            host.boot()
        for host, role, index, log in ((a, "leader", 0, logs[0]), (b, "worker", 1, logs[1])):
            command, env = pod_command(template[f"{role}Template"], host, objects, secret_values,
                                       {**group, "LWS_WORKER_INDEX": str(index)})
            processes.append(host.popen(command, log, **env))
        leader = processes[0]
        wait_serving(a, processes, logs)
        assert stage_hosts(logs[0]) == {a.ip, b.ip}, logs[0].read_text()  # a pipeline stage on each pod
        complete(a, "http://127.0.0.1:8000", expected)

        health = tmp_path / "health.txt"
        watcher = a.watch("http://127.0.0.1:8000/health", health)
        deadline = time.monotonic() + 30
        while not health.exists() or "200" not in health.read_text().split():
            assert time.monotonic() < deadline, "the watcher never saw /health answer 200"
            time.sleep(0.1)
        b.kill_all()  # the worker pod is deleted: its container, its Ray node, its rank
        lost = time.monotonic()
        leader.wait(timeout=90)
        assert time.monotonic() - lost < 60, "the lost worker was noticed too late"
        assert leader.returncode == 1, logs[0].read_text()[-3000:]  # LWS then recreates the group
        assert "503" in health.read_text().split(), "/health never answered 503"
        assert "engine died" in logs[0].read_text()
    finally:
        if watcher is not None:
            watcher.kill()
            watcher.wait()
        end_pods(hosts, processes)


def left(hosts: tuple[Host, ...]) -> str:
    pids = [str(pid) for host in hosts for pid in host.pids()]
    return subprocess.run(["ps", "-o", "pid,ppid,args", "-p", ",".join(pids)], capture_output=True,
                          text=True).stdout if pids else "nothing"


def end_pods(hosts: tuple[Host, Host], processes: list[subprocess.Popen]) -> None:
    """Delete both pods (SIGKILL all), reap ours, and remove what `cluster up/join` left outside them."""
    for host in hosts:
        host.kill_all()
    for process in processes:
        process.wait(timeout=10)
    for host in hosts:
        record = read_record(host.state_dir)
        if record is not None:
            shutil.rmtree(record.temp_dir, ignore_errors=True)
            (host.state_dir / "node.json").unlink()


SCONTROL = """#!/bin/bash
# scontrol stand-in: only `scontrol show hostnames LIST`, which prints the job's nodes one a line
set -euo pipefail
[ "$1 $2" = "show hostnames" ] || { echo "scontrol stand-in: only 'show hostnames'" >&2; exit 2; }
printf '%s\\n' {nodes}
"""
SRUN = """#!/bin/bash
# srun stand-in: CMD once on each chosen node (--nodelist/-w, else the job's nodes less --exclude/-x),
# inside that node (the namespaces of its init), with the variables srun sets for a task
set -euo pipefail
declare -A init=({init})
nodes=({nodes})
want="" exclude="" count=""
while [ $# -gt 0 ]; do
  case "$1" in
    --nodelist=*) want="${1#*=}" ;;
    -w) want="$2"; shift ;;
    --exclude=*) exclude="${1#*=}" ;;
    -x) exclude="$2"; shift ;;
    --nodes=*) count="${1#*=}" ;;
    --ntasks=*|--ntasks-per-node=*|--overlap) ;;
    -*) echo "srun stand-in: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
chosen=()
for node in "${nodes[@]}"; do
  if { [ -z "$want" ] || [ "$node" = "$want" ]; } && [ "$node" != "$exclude" ]; then chosen+=("$node"); fi
done
[ "${#chosen[@]}" = "${count:-${#chosen[@]}}" ] || { echo "srun stand-in: --nodes=$count, ${#chosen[@]} chosen" >&2; exit 1; }
pids=()
for i in "${!chosen[@]}"; do
  node="${chosen[$i]}"
  SLURMD_NODENAME="$node" SLURM_PROCID="$i" SLURM_NTASKS="${#chosen[@]}" SLURM_STEP_NUM_NODES="${#chosen[@]}" \\
    nsenter --target="${init[$node]}" --pid --mount --net --wd="$PWD" -- "$@" &
  pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
"""


def slurm_bin(folder: Path, hosts: tuple[Host, Host]) -> Path:
    """srun and scontrol for a job on NODES (node i on hosts[i], booted inside hosts[0]), in `folder`."""
    folder.mkdir()
    fill = {"nodes": " ".join(NODES),
            "init": " ".join(f"[{n}]={h.pid_seen_from(hosts[0])}" for n, h in zip(NODES, hosts))}
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        for key, value in fill.items():
            text = text.replace("{" + key + "}", value)
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


def sbatch_env(script: str, job_id: str, submit_dir: Path) -> dict[str, str]:
    """The variables sbatch gives the batch script, from its #SBATCH lines (checked against NODES)."""
    asked = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", script, re.M))
    assert asked["nodes"] == str(len(NODES)) and asked["ntasks-per-node"] == "1"
    return {"SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_JOB_NAME": asked["job-name"],
            "SLURM_JOB_NODELIST": f"node[1-{len(NODES)}]", "SLURM_NODELIST": f"node[1-{len(NODES)}]",
            "SLURM_NNODES": asked["nodes"], "SLURM_JOB_NUM_NODES": asked["nodes"], "SLURM_NODEID": "0",
            "SLURMD_NODENAME": NODES[0], "SLURM_CPUS_PER_TASK": asked["cpus-per-task"],
            "SLURM_NTASKS": asked["nodes"], "SLURM_SUBMIT_DIR": str(submit_dir), "SLURM_SUBMIT_HOST": NODES[0]}


@pytest.mark.parametrize("ending", ["scancel", "a lost node"])
def test_sbatch_serves_across_two_nodes_then_ends_cleanly(hosts, plan_and_expected, tmp_path, ending):
    """scancel: every process stops within Slurm's kill wait, nothing left on the nodes' disks; a lost node
    (node2 gone): the server notices, and the job fails as the other multi-node tests expect."""
    a, b = hosts
    plan, cache, expected = plan_and_expected
    sbatch = deploy(plan, cache, tmp_path / "out", "--target", "slurm")
    script, job_id = sbatch.read_text(), str(4000 + secrets.randbelow(1000))
    own_tmp = {node: tmp_path / f"{node}-tmp" for node in NODES}  # each node's local disk
    for folder in own_tmp.values():
        folder.mkdir()
    # NOTE: a short TMPDIR: Ray's socket paths under it must stay within 107 bytes
    tmpdir = Path(tempfile.mkdtemp(prefix="ss", dir="/tmp"))
    batch = None
    try:
        a.boot({tmpdir: own_tmp[NODES[0]]})
        b.boot({tmpdir: own_tmp[NODES[1]]}, inside=a)
        env = {**sbatch_env(script, job_id, sbatch.parent), "TMPDIR": str(tmpdir),
               "PATH": f"{slurm_bin(tmp_path / 'bin', hosts)}:{path_env()}"}
        log = sbatch.parent / f"{env['SLURM_JOB_NAME']}-{job_id}.out"  # --output=%x-%j.out
        batch = a.popen(["bash", "-c", 'cd "$SLURM_SUBMIT_DIR" && exec bash "$1"', "_", str(sbatch)], log, **env)
        wait_serving(a, [batch], [log])
        assert stage_hosts(log) == {a.ip, b.ip}, log.read_text()[-3000:]
        complete(b, f"http://{NODES[0]}:8000", expected)  # a client elsewhere, by the first node's name
        assert (own_tmp[NODES[0]] / f"shardserve-{job_id}" / "plan.yaml").is_file()

        if ending == "a lost node":
            b.kill_all()  # node2 is gone: its job step, its Ray node, its rank
            lost = time.monotonic()
            batch.wait(timeout=90)
            assert time.monotonic() - lost < 60, "the lost node was noticed too late"
            assert batch.returncode != 0 and "engine died" in log.read_text(), log.read_text()[-3000:]
            return
        for host in hosts:  # scancel
            host.signal_all(signal.SIGTERM)
        stopped = [host.wait_empty(KILL_WAIT_SECONDS) for host in hosts]
        batch.wait(timeout=10)
        assert stopped == [True, True], f"left after KillWait: {left(hosts)}\n{log.read_text()[-3000:]}"
        # nothing of ours left on the nodes' disks: the plan (the EXIT trap), Ray's folders and the records
        # (cluster down); Ray's dashboard leaves its forkserver's pymp-* folder in TMPDIR when stopped
        left_on_disk = {node: sorted(p.name for p in own_tmp[node].iterdir() if not p.name.startswith("pymp-"))
                        for node in NODES}
        assert left_on_disk == {node: [] for node in NODES}
    finally:
        end_pods(hosts, [batch] if batch else [])
        shutil.rmtree(tmpdir, ignore_errors=True)
