"""The objects of `deploy --target kuberay`: a KubeRay RayCluster holding the whole plan (the head
pod runs `launch` for every replica, the worker pods are Ray nodes), the plan's ConfigMap and a
Service on the head.

NOTE: a RayCluster, not a RayService: a RayService deploys Ray Serve applications, and shardserve's
server is not one. With the annotation ray.io/overwrite-container-cmd KubeRay runs our command and
leaves its own `ray start` in $KUBERAY_GEN_RAY_START_CMD, which the scripts run.
"""

from __future__ import annotations

from shardserve.launch.deploy import scripts as deploy_scripts
from shardserve.launch.deploy.plan import DeployOptions, describe, startup_failure_threshold, whole_shape
from shardserve.launch.deploy.pod import (PLAN_MOUNT, container, env, labels, plan_config_map, pod_spec,
                                          server_container, service, serving_annotations, metadata)
from shardserve.planner.plan_file import PlanFile

RAY_API = "ray.io/v1"
# The head's Ray ports, as KubeRay names them for its head Service, and ours.
HEAD_PORTS = [{"name": "gcs-server", "containerPort": 6379, "protocol": "TCP"},
              {"name": "dashboard", "containerPort": 8265, "protocol": "TCP"},
              {"name": "client", "containerPort": 10001, "protocol": "TCP"}]


def kuberay_objects(plan: PlanFile, options: DeployOptions) -> list[dict]:
    shape = whole_shape(plan)
    failures = startup_failure_threshold(plan, shape, options.load_rate_gbps)
    plan_path = f"{PLAN_MOUNT}/plan.yaml"
    head = server_container("ray-head", options, shape,
                            ["/bin/bash", "-c", deploy_scripts.kuberay_head(shape, plan_path)],
                            env(options, is_server=True, uses_ray_token=False), failures)
    head["ports"] = HEAD_PORTS + head["ports"]
    head_template = {"metadata": {"labels": labels(options, "server"), "annotations": serving_annotations(plan)},
                     "spec": pod_spec(plan, options, shape, head, has_plan=True)}
    # CPU ranks: one Ray CPU slot per rank, so that Ray places as many on a pod as the plan does
    start_params = {"num-cpus": str(shape.gpus_per_pod)} if shape.is_cpu else {}
    spec: dict = {"headGroupSpec": {"rayStartParams": dict(start_params), "template": head_template}}
    num_workers = shape.pods_per_group - 1
    if num_workers:
        worker = container("ray-worker", options, shape, ["/bin/bash", "-c", deploy_scripts.kuberay_worker()],
                           env(options, is_server=False, uses_ray_token=False), has_plan=False)
        spec["workerGroupSpecs"] = [{
            "groupName": "gpu", "replicas": num_workers, "minReplicas": num_workers, "maxReplicas": num_workers,
            "rayStartParams": dict(start_params),
            "template": {"metadata": {"labels": labels(options, "worker")},
                         "spec": pod_spec(plan, options, shape, worker, has_plan=False)}}]
    annotations = {"ray.io/overwrite-container-cmd": "true", "shardserve/plan": describe(plan)}
    cluster = {"apiVersion": RAY_API, "kind": "RayCluster",
               "metadata": metadata(options, options.name, "server", annotations), "spec": spec}
    selector = {"ray.io/cluster": options.name, "ray.io/node-type": "head"}
    return [plan_config_map(plan, options), cluster, service(options, selector)]
