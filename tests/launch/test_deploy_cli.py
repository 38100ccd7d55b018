"""`shardserve deploy` on the command line: what it refuses (one red line naming the fix, nothing
written), how it writes its folder (all or nothing), and the leader's wait for the group's GPUs (or nodes)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.launch.deploy.output import render, write_folder
from shardserve.launch.deploy.plan import DeployError, DeployOptions, parse_model_cache
from shardserve.launch.cluster.wait_cluster import wait_for_cluster
from tests.launch.deploy_cases import IMAGE, cpu_cluster_plan, load_plan, plan_path


def deploy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardserve.launch", "deploy", *args],
                          capture_output=True, text=True, timeout=120)


def refused(done: subprocess.CompletedProcess, *named: str) -> None:
    message = " ".join(done.stderr.split())
    assert done.returncode == 1, done.stdout + done.stderr
    assert message.startswith("error:") and "Traceback" not in message
    for text in named:
        assert text in message, message


@pytest.mark.slow
@pytest.mark.parametrize("plan, args, named", [
    ("1node", ["--target", "kuberay", "--image", IMAGE], ["executor is mp", "--target k8s"]),
    ("2node", ["--target", "k8s", "--image", IMAGE], ["spans 2 nodes", "--target lws"]),
    ("2node", ["--target", "lws"], ["--target lws needs --image", "Dockerfile"]),
    ("2node", ["--target", "lws", "--image", IMAGE, "--model-cache", "nfs:/x"], ["pvc:CLAIM", "hostpath:"]),
    ("2node", ["--target", "slurm", "--model-cache", "pvc:hf"], ["hostpath:"]),
    ("2node", ["--target", "lws", "--image", IMAGE, "--name", "Llama_405B"], ["--name", "lowercase"]),
    ("2node", ["--target", "lws", "--image", IMAGE, "--model", "x"], ["--model with a plan file"]),
])
def test_a_target_that_cannot_serve_the_plan_is_refused_naming_the_fix(tmp_path, plan, args, named):
    folder = tmp_path / "out"
    refused(deploy(str(plan_path(plan)), *args, "-o", str(folder)), *named)
    assert not folder.exists()


@pytest.mark.slow
def test_a_non_empty_folder_is_refused_without_force(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "notes.yaml").write_text("mine\n")
    refused(deploy(str(plan_path("2node")), "--target", "slurm", "-o", str(folder)), "not empty", "--force")
    assert [p.name for p in folder.iterdir()] == ["notes.yaml"]
    (folder / "keep").mkdir()
    refused(deploy(str(plan_path("2node")), "--target", "slurm", "-o", str(folder), "--force"), "holds keep")
    assert sorted(p.name for p in folder.iterdir()) == ["keep", "notes.yaml"]


@pytest.mark.slow
def test_no_output_folder_is_refused(tmp_path):
    refused(deploy(str(plan_path("2node")), "--target", "slurm"), "-o DIR is required")


@pytest.mark.slow
def test_deploy_writes_the_files_and_says_what_to_run(tmp_path):
    folder = tmp_path / "out"
    done = deploy(str(plan_path("2node")), "--target", "lws", "--image", IMAGE, "--namespace", "llm",
                  "--model-cache", "pvc:hf-cache", "-o", str(folder))
    assert done.returncode == 0, done.stderr
    plan = load_plan("2node")
    options = DeployOptions("lws", "llama-3-1-405b-instruct", IMAGE, "llm",
                            parse_model_cache("pvc:hf-cache"))
    assert {p.name: p.read_text() for p in folder.iterdir()} == render(plan, options)
    assert "kubectl create secret generic llama-3-1-405b-instruct-ray-token -n llm" in done.stdout
    assert f"kubectl apply -f {folder}" in done.stdout


@pytest.mark.slow
def test_force_replaces_a_previous_deploy_whole(tmp_path):
    folder = tmp_path / "out"
    assert deploy(str(plan_path("1node")), "--target", "k8s", "--image", IMAGE, "-o", str(folder)).returncode == 0
    done = deploy(str(plan_path("1node")), "--target", "slurm", "-o", str(folder), "--force")
    assert done.returncode == 0, done.stderr
    assert [p.name for p in folder.iterdir()] == ["slurm.sbatch"]  # no stale k8s.yaml for kubectl to apply


@pytest.mark.slow
def test_deploy_plans_from_flags_as_plan_does(tmp_path):
    folder = tmp_path / "out"
    done = deploy("--model", "meta-llama/Llama-3.1-70B-Instruct", "--hardware", "8xH100-80GB",
                  "--target", "slurm", "-o", str(folder))
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --gpus-per-node=8\n" in (folder / "slurm.sbatch").read_text()


def test_a_plan_of_cpu_ranks_gets_pods_without_gpus_and_a_cpu_slot_per_rank():
    """As `plan --ray-address` makes it on CPU nodes (test_deploy_run.py runs these files)."""
    plan = cpu_cluster_plan(str(DEMO_MODEL_DIR), ("10.0.0.1", "10.0.0.2"))
    cache = parse_model_cache(f"hostpath:{DEMO_MODEL_DIR.parent}")
    (text,) = render(plan, DeployOptions("lws", "demo", IMAGE, model_cache=cache)).values()
    assert "nvidia.com/gpu" not in text and "tolerations" not in text
    assert "cluster up --head --node-ip \"$POD_IP\" --port 6379 --num-cpus 1\n" in text
    assert "--node-ip \"$POD_IP\" --num-cpus 1\n" in text  # the worker's join
    assert "wait_cluster --address auto --nodes 2 --timeout 600\n" in text
    assert "memory: 17Gi" in text  # 8 + 6 + 2 (/dev/shm) GiB, + the rank's weights, KV cache and activations
    (sbatch,) = render(plan, DeployOptions("slurm", "demo")).values()
    assert "--gpus-per-node" not in sbatch and "--nodes 2 --timeout 600" in sbatch


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def fail(*args):
        raise OSError("disk full")
    folder = tmp_path / "out"
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_folder(folder, {"a.yaml": "x\n"}, force=False)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_swap_puts_the_old_folder_back(tmp_path, monkeypatch):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "old.yaml").write_text("old\n")
    real_rename, calls = os.rename, []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == 2:  # the new folder into place
            raise OSError("interrupted")
        real_rename(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError):
        write_folder(folder, {"new.yaml": "new\n"}, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in folder.iterdir()] == ["old.yaml"]


def test_write_folder_refuses_a_file_as_folder(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(DeployError, match="is a file"):
        write_folder(tmp_path / "f", {"a.yaml": ""}, force=True)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_leader_waits_until_the_group_offers_the_gpus():
    clock, said = FakeClock(), []
    seen = iter([None, None, (8.0, 1), (8.0, 1), (16.0, 2)])
    assert wait_for_cluster(lambda: next(seen), 16, 1, timeout=60, interval=2, clock=clock, sleep=clock.sleep,
                            say=said.append)
    assert said[0] == "shardserve: waiting for 16 GPUs: the head does not answer yet (0 s)"
    assert said[-1] == "shardserve: the cluster offers 16 GPUs on 2 node(s); 16 GPUs needed"


def test_the_leader_gives_up_with_one_line_naming_what_is_missing():
    clock, said = FakeClock(), []
    assert not wait_for_cluster(lambda: (8.0, 1), 16, 1, timeout=30, interval=2, clock=clock, sleep=clock.sleep,
                                say=said.append)
    assert said[-1].startswith("shardserve: gave up after 30 s waiting for 16 GPUs (8 GPUs on 1 node(s))")
    assert clock.now == 30


def test_a_group_of_cpu_ranks_waits_for_its_nodes():
    clock, said = FakeClock(), []
    seen = iter([(0.0, 1), (0.0, 2)])
    assert wait_for_cluster(lambda: next(seen), 0, 2, timeout=60, interval=2, clock=clock, sleep=clock.sleep,
                            say=said.append)
    assert said == ["shardserve: waiting for 2 nodes: 0 GPUs on 1 node(s) (0 s)",
                    "shardserve: the cluster offers 0 GPUs on 2 node(s); 2 nodes needed"]


def test_a_plan_of_a_local_folder_needs_a_cache_the_pods_see():
    plan = load_plan("1node")
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, path="/data/models/llama-70b"))
    with pytest.raises(DeployError, match="--model-cache hostpath:DIR"):
        render(plan, DeployOptions("k8s", "x", IMAGE, model_cache=parse_model_cache("pvc:hf")))
    (text,) = render(plan, DeployOptions("k8s", "x", IMAGE, model_cache=parse_model_cache("hostpath:/data/models"))).values()
    assert "path: /data/models\n" in text
    assert render(plan, DeployOptions("slurm", "x"))  # Slurm nodes share the submitting host's folders


@pytest.mark.slow
def test_dash_o_dash_writes_the_file_to_stdout_for_kubectl_apply():
    """`deploy ... -o -` (kubectl apply -f -): the one file on stdout, the warnings on stderr, nothing written."""
    done = deploy(str(plan_path("2node")), "--target", "slurm", "-o", "-")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("#!") and "srun" in done.stdout and "wrote" not in done.stdout
