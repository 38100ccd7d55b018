"""The Kubernetes pieces every `deploy` target's pods share, as plain dicts: labels, the plan's
ConfigMap, the Service, a container with its resources, probes, variables and volumes, the pod spec."""

from __future__ import annotations

import hashlib

import yaml

from shardserve.launch.deploy.plan import (HTTP_PORT, PROBE_PERIOD_SECONDS, DeployOptions, Shape, cpus,
                                           gpu_product_label, memory_gib, shm_gib)
from shardserve.planner.plan_file import PlanFile

PLAN_MOUNT = "/plan"  # the ConfigMap's folder in a serving pod: /plan/plan.yaml
API_KEY_SECRET_KEY = "api-key"  # the key in --api-key-secret's Secret
RAY_TOKEN_SECRET_KEY = "token"  # the key in the NAME-ray-token Secret


def plan_text(plan: PlanFile) -> str:
    return yaml.safe_dump(plan.to_dict(), sort_keys=False, width=100)


def labels(options: DeployOptions, component: str) -> dict:
    return {"app.kubernetes.io/name": options.name, "app.kubernetes.io/component": component}


def metadata(options: DeployOptions, name: str, component: str, annotations: dict | None = None) -> dict:
    out: dict = {"name": name}
    if options.namespace:
        out["namespace"] = options.namespace
    out["labels"] = labels(options, component)
    if annotations:
        out["annotations"] = annotations
    return out


def plan_config_map(plan: PlanFile, options: DeployOptions) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(options, f"{options.name}-plan", "plan"),
            "data": {"plan.yaml": plan_text(plan)}}


def service(options: DeployOptions, selector: dict) -> dict:
    """The API, /health and /metrics of the serving pods, inside the cluster (expose it as you expose others)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(options, options.name, "server"),
            "spec": {"type": "ClusterIP", "selector": selector,
                     "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def serving_annotations(plan: PlanFile) -> dict:
    """Prometheus scrapes /metrics; a new plan changes the hash, so the pods roll."""
    digest = hashlib.sha256(plan_text(plan).encode()).hexdigest()[:16]
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(HTTP_PORT),
            "prometheus.io/path": "/metrics", "shardserve/plan-sha256": digest}


def launch_args(plan_path: str = f"{PLAN_MOUNT}/plan.yaml") -> list[str]:
    return ["shardserve", "launch", plan_path, "--host", "0.0.0.0", "--port", str(HTTP_PORT)]


def resources(shape: Shape) -> dict:
    """GPUs from the plan (none for CPU ranks); host memory and CPUs by the rules in deploy_plan
    (requests = limits, but CPUs)."""
    memory, cores = f"{memory_gib(shape)}Gi", cpus(shape)
    gpus = {} if shape.is_cpu else {"nvidia.com/gpu": str(shape.gpus_per_pod)}
    return {"requests": {"cpu": str(cores), "memory": memory, **gpus},
            "limits": {"cpu": str(2 * cores), "memory": memory, **gpus}}


def env(options: DeployOptions, *, is_server: bool, uses_ray_token: bool) -> list[dict]:
    """The pod's IP (the downward API), HF_HOME on the model cache, the API key and the Ray token from
    their Secrets, and the plain variables (socket interface, --env)."""
    out: list[dict] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    if options.model_cache:
        out.append({"name": "HF_HOME", "value": options.model_cache.mount_path})
    if is_server and options.api_key_secret:
        out.append({"name": "SHARDSERVE_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": options.api_key_secret, "key": API_KEY_SECRET_KEY}}})
    if uses_ray_token:
        out.append({"name": "RAY_AUTH_MODE", "value": "token"})
        out.append({"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": options.ray_token_secret, "key": RAY_TOKEN_SECRET_KEY}}})
    out += [{"name": k, "value": v} for k, v in options.variables().items()]
    return out


def probes(startup_failures: int) -> dict:
    """/health answers 200 once the engines serve, 503 while draining or when an engine died. The
    startup probe holds the other two off for startup_failures x PROBE_PERIOD_SECONDS."""
    def http_get(**timing) -> dict:
        return {"httpGet": {"path": "/health", "port": "http"}, **timing}
    return {"startupProbe": http_get(periodSeconds=PROBE_PERIOD_SECONDS, failureThreshold=startup_failures),
            "readinessProbe": http_get(periodSeconds=5, failureThreshold=2),
            "livenessProbe": http_get(periodSeconds=PROBE_PERIOD_SECONDS, failureThreshold=3, timeoutSeconds=5)}


def container(name: str, options: DeployOptions, shape: Shape, command: list[str], env_list: list[dict],
              has_plan: bool) -> dict:
    return {"name": name, "image": options.image, "command": command, "env": env_list,
            "resources": resources(shape), "volumeMounts": volume_mounts(options, has_plan)}


def server_container(name: str, options: DeployOptions, shape: Shape, command: list[str], env_list: list[dict],
                     startup_failures: int) -> dict:
    """A container that runs `launch`: its port, with the probes on /health."""
    out = container(name, options, shape, command, env_list, has_plan=True)
    out["ports"] = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    return {**out, **probes(startup_failures)}


def volume_mounts(options: DeployOptions, has_plan: bool) -> list[dict]:
    out: list[dict] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if has_plan:
        out.append({"name": "plan", "mountPath": PLAN_MOUNT, "readOnly": True})
    if options.model_cache:
        out.append({"name": "model-cache", "mountPath": options.model_cache.mount_path})
    return out


def volumes(options: DeployOptions, shape: Shape, has_plan: bool) -> list[dict]:
    """/dev/shm in memory (NCCL and the ranks keep buffers there; a container's default is 64 MiB),
    the plan, and the model cache."""
    out: list[dict] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{shm_gib(shape)}Gi"}}]
    if has_plan:
        out.append({"name": "plan", "configMap": {"name": f"{options.name}-plan"}})
    cache = options.model_cache
    if cache and cache.kind == "pvc":
        out.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": cache.source}})
    elif cache:
        out.append({"name": "model-cache", "hostPath": {"path": cache.source, "type": "Directory"}})
    return out


def pod_spec(plan: PlanFile, options: DeployOptions, shape: Shape, main: dict, has_plan: bool) -> dict:
    """One container on a node with the plan's GPU (its nvidia.com/gpu.product label), tolerating the
    usual taint of GPU nodes; CPU ranks go wherever the scheduler finds room."""
    spec: dict = {"containers": [main]}
    label = gpu_product_label(plan)
    if label:
        spec["nodeSelector"] = {"nvidia.com/gpu.product": label}
    if not shape.is_cpu:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    spec["volumes"] = volumes(options, shape, has_plan)
    return spec
