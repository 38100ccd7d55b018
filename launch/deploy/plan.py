"""What every `shardserve deploy` target derives from a plan: the options, the pods' shape and
resources, the GPU's node label, the start-up budget, and the plan one replica serves.

Pure functions of the plan record and the options; nothing here touches a cluster.

    the plan                         k8s / lws (a replica at a time)     kuberay / slurm (the whole plan)
    tp x pp ranks per replica  ->    groups = dp, each spanning           one Ray cluster of all the nodes,
    dp replicas                      ceil(tp*pp / gpus_per_node) pods     one `launch` serving every replica
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

from shardserve.planner import PlanError
from shardserve.planner.plan_file import PlanFile

KUBERNETES_TARGETS = ("k8s", "lws", "kuberay")
HTTP_PORT = 8000  # the server's port in every pod: the API, /health and /metrics
RAY_PORT = 6379  # the Ray head's port (Ray's own default)
PVC_MOUNT = "/models"  # where a --model-cache pvc:NAME is mounted (HF_HOME points there)
DEFAULT_LOAD_RATE_GBPS = 1.0
# The start-up budget: the weights a pod loads over --load-rate-gbps, times LOAD_MARGIN, plus
# START_SECONDS for imports, CUDA, NCCL and CUDA graphs; a group's leader also waits up to
# GROUP_WAIT_SECONDS for the other nodes to join.
LOAD_MARGIN = 2.0
START_SECONDS = 180
GROUP_WAIT_SECONDS = 600
PROBE_PERIOD_SECONDS = 10
# Host resources per pod (the plan predicts GPU memory only), stated here and in the --help:
# memory = HOST_BASE + HOST_PER_GPU per GPU + the /dev/shm emptyDir (it counts against the limit)
# (+ what CPU ranks hold in host memory);
# CPUs = CPU_BASE + CPU_PER_GPU per GPU requested, twice that as the limit (no throttling in bursts).
HOST_BASE_GIB = 8
HOST_PER_GPU_GIB = 6
SHM_PER_GPU_GIB = 2
CPU_BASE = 2
CPU_PER_GPU = 4
# Our GPU names -> the nvidia.com/gpu.product values NVIDIA's GPU feature discovery writes (NVML's
# product name with spaces as dashes). GPUs missing here get no nodeSelector (a warning says so).
GPU_PRODUCT_LABELS = {
    "H100-80GB": "NVIDIA-H100-80GB-HBM3",
    "H100-PCIE": "NVIDIA-H100-PCIe",
    "H200": "NVIDIA-H200",
    "B200": "NVIDIA-B200",
    "A100-80GB": "NVIDIA-A100-SXM4-80GB",
    "A100-40GB": "NVIDIA-A100-SXM4-40GB",
    "L40S": "NVIDIA-L40S",
    "L4": "NVIDIA-L4",
    "A10G": "NVIDIA-A10G",
    "T4": "Tesla-T4",
}
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # a DNS-1035 label: Service names need it
MAX_NAME_LENGTH = 40  # room for the suffixes (-plan, -ray-token, LWS's -0-1 pod names) within 63


class DeployError(PlanError):
    exit_code = 1


@dataclass(frozen=True)
class ModelCache:
    kind: str  # pvc | hostpath
    source: str  # the claim's name, or the node's folder
    mount_path: str  # where the pods see it (HF_HOME)


@dataclass(frozen=True)
class DeployOptions:
    target: str
    name: str
    image: str | None = None
    namespace: str | None = None
    model_cache: ModelCache | None = None
    api_key_secret: str | None = None
    load_rate_gbps: float = DEFAULT_LOAD_RATE_GBPS
    socket_ifname: str | None = None
    env: tuple[tuple[str, str], ...] = ()

    @property
    def ray_token_secret(self) -> str:
        """The Secret (key `token`) with the Ray cluster's token, shared by a group's pods."""
        return f"{self.name}-ray-token"

    def variables(self) -> dict[str, str]:
        """Plain variables every pod or node gets: the socket interface, then --env."""
        out = dict.fromkeys(("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"), self.socket_ifname or "")
        out = {k: v for k, v in out.items() if v}
        return out | dict(self.env)


@dataclass(frozen=True)
class Shape:
    """The pods (or Slurm nodes) a target asks for: groups side by side, each of pods_per_group pods
    with gpus_per_pod GPUs; num_gpus: the GPUs one group's `launch` waits for. In a CPU plan the
    "GPUs" are CPU ranks: a pod asks for no GPU, its Ray node offers one CPU slot per rank, and its
    memory holds each rank's weights, KV cache and activations (rank_host_bytes)."""
    num_groups: int
    pods_per_group: int
    gpus_per_pod: int
    num_gpus: int
    is_cpu: bool = False
    rank_host_bytes: int = 0


def parse_model_cache(text: str | None) -> ModelCache | None:
    if text is None:
        return None
    kind, sep, source = text.partition(":")
    if kind == "pvc" and sep and _NAME.match(source.replace(".", "-")):
        return ModelCache("pvc", source, PVC_MOUNT)
    if kind == "hostpath" and sep and source.startswith("/") and source != "/":
        return ModelCache("hostpath", source.rstrip("/"), source.rstrip("/"))
    raise DeployError(f"--model-cache {text!r}: write pvc:CLAIM (a PersistentVolumeClaim, mounted at "
                      f"{PVC_MOUNT}) or hostpath:/ABSOLUTE/PATH (a folder on every node, mounted at the same path)")


def default_name(plan: PlanFile) -> str:
    """The model's name as a DNS label: meta-llama/Llama-3.1-8B -> llama-3-1-8b."""
    text = re.sub(r"[^a-z0-9]+", "-", plan.model.id.rsplit("/", 1)[-1].lower()).strip("-")
    text = text if text[:1].isalpha() else f"model-{text}"
    return text[:MAX_NAME_LENGTH].rstrip("-") or "shardserve"


def check_name(name: str, flag: str) -> str:
    if len(name) > MAX_NAME_LENGTH or not _NAME.match(name):
        raise DeployError(f"{flag} {name!r}: use at most {MAX_NAME_LENGTH} lowercase letters, digits and dashes, "
                          "starting with a letter (a Kubernetes name), such as llama-70b")
    return name


def check_options(plan: PlanFile, options: DeployOptions) -> None:
    """Refuse what the target cannot deploy, naming the flag or target that can."""
    if options.target in KUBERNETES_TARGETS and not options.image:
        raise DeployError(f"--target {options.target} needs --image: the container image with shardserve "
                          "(the repo's Dockerfile builds it: docker build -t REGISTRY/shardserve:TAG .)")
    if options.target == "slurm":
        for flag, value in (("--image", options.image), ("--api-key-secret", options.api_key_secret),
                            ("--namespace", options.namespace)):
            if value:
                raise DeployError(f"{flag} is for the Kubernetes targets; the sbatch script runs the shardserve "
                                  "on PATH (export SHARDSERVE_API_KEY before sbatch for a key)")
        if options.model_cache and options.model_cache.kind == "pvc":
            raise DeployError("--model-cache pvc:... is a Kubernetes claim; on Slurm write "
                              "--model-cache hostpath:/shared/hf-cache")
    nodes = nodes_per_replica(plan)
    if options.target == "k8s" and nodes > 1:
        par = plan.parallel
        raise DeployError(f"a replica of this plan spans {nodes} nodes (tensor {par.tensor_parallel_size} x pipeline "
                          f"{par.pipeline_parallel_size} on {plan.hardware.gpus_per_node} GPUs per node); a "
                          "Deployment's pod is one node: use --target lws (or kuberay, slurm)")
    if options.target == "kuberay" and plan.parallel.distributed_executor_backend != "ray":
        raise DeployError(f"the plan's executor is {plan.parallel.distributed_executor_backend}, not ray: KubeRay "
                          "runs a Ray cluster; use --target k8s, or plan with --distributed-executor-backend ray")
    shape = whole_shape(plan) if options.target == "slurm" else replica_shape(plan)
    if shape.pods_per_group > 1 and plan.parallel.distributed_executor_backend != "ray":
        raise DeployError(f"the plan's {shape.pods_per_group} nodes make one Ray cluster, but its executor is "
                          f"{plan.parallel.distributed_executor_backend}: plan again with "
                          "--distributed-executor-backend ray")
    if options.target in KUBERNETES_TARGETS:  # Slurm nodes see the submitting host's shared folders
        _check_model_visible(plan, options.model_cache)


def _check_model_visible(plan: PlanFile, cache: ModelCache | None) -> None:
    path = plan.model.path
    if path is None:
        return  # a Hugging Face id: found in (or downloaded into) the cache at HF_HOME
    if cache is None or cache.kind != "hostpath" or not (path + "/").startswith(cache.mount_path + "/"):
        raise DeployError(f"the plan's model is the folder {path}, which the pods cannot see: pass --model-cache "
                          "hostpath:DIR with DIR holding it on every node, or plan with the model's Hugging Face "
                          "id (found in the --model-cache)")


def ranks_per_replica(plan: PlanFile) -> int:
    return plan.parallel.tensor_parallel_size * plan.parallel.pipeline_parallel_size


def nodes_per_replica(plan: PlanFile) -> int:
    ranks, per_node = ranks_per_replica(plan), plan.hardware.gpus_per_node
    if ranks > per_node and ranks % per_node:
        raise DeployError(f"a replica's {ranks} ranks do not fill whole nodes of {per_node} GPUs: plan with a "
                          "tensor x pipeline size that is a multiple of the GPUs per node")
    return math.ceil(ranks / per_node)


def replica_shape(plan: PlanFile) -> Shape:
    """k8s and lws: one group per replica (dp groups), each group the nodes one replica spans."""
    ranks, nodes = ranks_per_replica(plan), nodes_per_replica(plan)
    return Shape(plan.parallel.data_parallel_size, nodes, ranks // nodes, ranks, **_device(plan))


def whole_shape(plan: PlanFile) -> Shape:
    """kuberay and slurm: one Ray cluster for the whole plan; replicas that fit a node share nodes."""
    ranks, dp, per_node = ranks_per_replica(plan), plan.parallel.data_parallel_size, plan.hardware.gpus_per_node
    nodes = nodes_per_replica(plan)
    if nodes > 1:
        return Shape(1, nodes * dp, per_node, ranks * dp, **_device(plan))
    per_pod = min(dp, per_node // ranks)  # whole replicas on each node
    return Shape(1, math.ceil(dp / per_pod), ranks * per_pod, ranks * dp, **_device(plan))


def is_cpu_plan(plan: PlanFile) -> bool:
    return plan.runtime.device == "cpu" or plan.hardware.gpu.is_cpu


def _device(plan: PlanFile) -> dict:
    if not is_cpu_plan(plan):
        return {}
    per = plan.memory.per_gpu
    return {"is_cpu": True, "rank_host_bytes": (per.weights_bytes + per.kv_cache_bytes + per.activation_bytes
                                                 + per.overhead_bytes)}


def shm_gib(shape: Shape) -> int:
    return SHM_PER_GPU_GIB * shape.gpus_per_pod


def memory_gib(shape: Shape) -> int:
    ranks_own = math.ceil(shape.gpus_per_pod * shape.rank_host_bytes / 2**30)  # CPU ranks: in host memory
    return HOST_BASE_GIB + HOST_PER_GPU_GIB * shape.gpus_per_pod + shm_gib(shape) + ranks_own


def cpus(shape: Shape) -> int:
    return CPU_BASE + CPU_PER_GPU * shape.gpus_per_pod


def gpu_product_label(plan: PlanFile) -> str | None:
    return GPU_PRODUCT_LABELS.get(plan.hardware.gpu.name)


def load_seconds(plan: PlanFile, shape: Shape, load_rate_gbps: float) -> float:
    """Seconds a pod takes to read its share of the weights: weight bytes x gpus_per_pod / (tp x pp)."""
    share = plan.model.weight_bytes * shape.gpus_per_pod / ranks_per_replica(plan)
    return share / (load_rate_gbps * 1e9)


def startup_failure_threshold(plan: PlanFile, shape: Shape, load_rate_gbps: float) -> int:
    """startupProbe failureThreshold: periods covering the predicted start (see LOAD_MARGIN)."""
    seconds = START_SECONDS + LOAD_MARGIN * load_seconds(plan, shape, load_rate_gbps)
    if shape.pods_per_group > 1:
        seconds += GROUP_WAIT_SECONDS
    return math.ceil(seconds / PROBE_PERIOD_SECONDS)


def replica_plan(plan: PlanFile) -> PlanFile:
    """The plan one k8s pod or LWS group serves: one replica (data_parallel_size 1) on the nodes it
    spans, with 1/dp of the traffic, so that `launch` checks the hardware and the speed it sees."""
    dp = plan.parallel.data_parallel_size
    if dp == 1:
        return plan
    shape = replica_shape(plan)
    per = dataclasses.replace
    service = per(plan.service, concurrency=_share(plan.service.concurrency, dp),
                  request_rate=_share(plan.service.request_rate, dp))
    est = plan.estimates
    estimates = per(est, workload=per(est.workload, concurrency=_share(est.workload.concurrency, dp),
                                      request_rate=_share(est.workload.request_rate, dp)),
                    output_tokens_per_s=round(est.output_tokens_per_s / dp, 1),
                    max_request_rate=round(est.max_request_rate / dp, 2))
    hardware = per(plan.hardware, nodes=shape.pods_per_group, gpus_per_node=shape.gpus_per_pod,
                   node_ips=())
    note = (f"deploy: one replica of the plan's {dp} (data_parallel_size 1 here, traffic 1/{dp}); "
            "the other replicas are pods of their own")
    return per(plan, parallel=per(plan.parallel, data_parallel_size=1), hardware=hardware, service=service,
               estimates=estimates, rationale=(*plan.rationale, note))


def _share(value: float | None, dp: int) -> float | None:
    return None if value is None else value / dp


def describe(plan: PlanFile) -> str:
    """One line naming the plan, for comments in the emitted files."""
    par, hw = plan.parallel, plan.hardware
    return (f"{plan.model.id}: tensor_parallel_size={par.tensor_parallel_size} pipeline_parallel_size="
            f"{par.pipeline_parallel_size} data_parallel_size={par.data_parallel_size} "
            f"({par.distributed_executor_backend}) on {hw.nodes}x{hw.gpus_per_node}x{hw.gpu.name}")
