"""The plans and options behind the `shardserve deploy` goldens in tests/launch/data/deploy/.

Regenerate the goldens from the stored plans (after changing what deploy emits):
    .venv/bin/python -m tests.launch.deploy_cases
and the stored plans too, from the planner (after changing the planner or the plan format):
    .venv/bin/python -m tests.launch.deploy_cases --plans
Review the diff either way: a golden states what users will apply to their clusters.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from shardserve.launch.deploy.output import render
from shardserve.launch.deploy.plan import DeployOptions, ModelCache, default_name
from shardserve.planner.plan_file import PlanFile
from shardserve.planner.yaml_file import read_yaml

DATA = Path(__file__).parent / "data" / "deploy"
IMAGE = "registry.example.com/shardserve:0.1.0"
# The planner's own choices on declared hardware, with catalog models (no weights needed):
PLANS = {
    # tensor 4 x 2 replicas on one node, mp executor
    "1node": {"model": "meta-llama/Llama-3.1-70B-Instruct", "hardware": "8xH100-80GB"},
    # tensor 8 x pipeline 2: one replica over 2 nodes, ray executor
    "2node": {"model": "meta-llama/Llama-3.1-405B-Instruct", "hardware": "2x8xH100-80GB"},
    # tensor 8 x 2 replicas, one node each, ray executor
    "2node-dp": {"model": "meta-llama/Llama-3.1-405B-Instruct-FP8", "hardware": "2x8xH100-80GB"},
}
PVC = ModelCache("pvc", "hf-cache", "/models")
HOST = ModelCache("hostpath", "/mnt/hf-cache", "/mnt/hf-cache")


@dataclass(frozen=True)
class Case:
    golden: str  # file name in DATA
    plan: str  # key of PLANS
    target: str
    options: dict

    def deploy_options(self, plan: PlanFile) -> DeployOptions:
        options = dict(self.options)
        return DeployOptions(self.target, options.pop("name", None) or default_name(plan), **options)


def cases() -> list[Case]:
    return [
        Case("k8s-1node.yaml", "1node", "k8s", {"image": IMAGE, "model_cache": PVC, "api_key_secret": "llm-api-key"}),
        Case("k8s-2node-dp.yaml", "2node-dp", "k8s", {"image": IMAGE, "model_cache": PVC, "namespace": "llm"}),
        Case("lws-2node.yaml", "2node", "lws", {"image": IMAGE, "model_cache": PVC, "api_key_secret": "llm-api-key",
                                                "socket_ifname": "eth0", "env": (("NCCL_DEBUG", "WARN"),)}),
        Case("kuberay-2node.yaml", "2node", "kuberay", {"image": IMAGE, "model_cache": HOST, "load_rate_gbps": 2.0}),
        Case("slurm-2node.sbatch", "2node", "slurm", {"model_cache": HOST, "socket_ifname": "ib0"}),
        Case("slurm-1node.sbatch", "1node", "slurm", {"name": "llama-70b"}),
    ]


def plan_path(key: str) -> Path:
    return DATA / f"plan-{key}.yaml"


def load_plan(key: str) -> PlanFile:
    data, _ = read_yaml(str(plan_path(key)), "plan")
    return PlanFile.from_dict(data, str(plan_path(key)))


def make_plan(key: str) -> PlanFile:
    from shardserve.launch.plan_view import make_plan_from
    return make_plan_from(dict(PLANS[key]), None, None)


def cpu_cluster_plan(model: str, node_ips: tuple[str, ...]) -> PlanFile:
    """What `shardserve plan --ray-address` makes on a Ray cluster of CPU nodes (a rank on each): a
    pipeline stage per node on the ray executor, with a small KV cache (for the tests that run it)."""
    from shardserve.planner import PlanOptions, load_model, make_plan
    from shardserve.planner.detect import hardware_from_ray_nodes
    nodes = [{"Alive": True, "NodeManagerAddress": ip, "Resources": {"CPU": 1.0}} for ip in node_ips]
    options = PlanOptions(pipeline_parallel_size=len(node_ips), distributed_executor_backend="ray",
                          kv_cache_memory_bytes=2**24, max_model_len=1024)
    return make_plan(load_model(model), hardware_from_ray_nodes(nodes), options).record()


def emitted(case: Case) -> str:
    plan = load_plan(case.plan)
    (text,) = render(plan, case.deploy_options(plan)).values()
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", action="store_true", help="make the stored plans again with the planner")
    if parser.parse_args().plans:
        from shardserve.launch.plan_view import write_plan
        for key in PLANS:
            write_plan(make_plan(key), plan_path(key))
            print(f"wrote {plan_path(key)}")
    for case in cases():
        (DATA / case.golden).write_text(emitted(case))
        print(f"wrote {DATA / case.golden}")


if __name__ == "__main__":
    main()
