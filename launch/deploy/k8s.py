"""The Kubernetes objects of `deploy --target k8s` (a Deployment of one-node replicas) and
`--target lws` (a LeaderWorkerSet, one group of pods per replica), from the plan."""

from __future__ import annotations

from shardserve.launch.deploy import scripts as deploy_scripts
from shardserve.launch.deploy.plan import (DeployOptions, describe, replica_plan, replica_shape,
                                           startup_failure_threshold)
from shardserve.launch.deploy.pod import (PLAN_MOUNT, container, env, labels, launch_args, metadata,
                                          plan_config_map, pod_spec, server_container, service,
                                          serving_annotations)
from shardserve.planner.plan_file import PlanFile

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # LWS puts it on every pod of the set
# NOTE: a rollout replaces a pod at a time without a surge pod: a surge pod would need GPUs that a
# cluster sized to the plan does not have, and would wait Pending.
ROLLOUT = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def k8s_objects(plan: PlanFile, options: DeployOptions) -> list[dict]:
    """ConfigMap (the plan of one replica), Deployment (data_parallel_size pods, each tp x pp GPUs on
    one node, running `launch`), Service."""
    shape = replica_shape(plan)
    served = replica_plan(plan)
    failures = startup_failure_threshold(plan, shape, options.load_rate_gbps)
    main = server_container("server", options, shape, launch_args(),
                            env(options, is_server=True, uses_ray_token=False), failures)
    selector = labels(options, "server")
    template = {"metadata": {"labels": selector, "annotations": serving_annotations(served)},
                "spec": pod_spec(plan, options, shape, main, has_plan=True)}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                  "metadata": metadata(options, options.name, "server", {"shardserve/plan": describe(plan)}),
                  "spec": {"replicas": shape.num_groups, "selector": {"matchLabels": selector},
                           "strategy": ROLLOUT, "template": template}}
    return [plan_config_map(served, options), deployment, service(options, selector)]


def lws_objects(plan: PlanFile, options: DeployOptions) -> list[dict]:
    """ConfigMap, LeaderWorkerSet (replicas = data_parallel_size groups of size = nodes per replica;
    a failed pod recreates its whole group), Service on the leaders."""
    shape = replica_shape(plan)
    served = replica_plan(plan)
    failures = startup_failure_threshold(plan, shape, options.load_rate_gbps)
    is_group = shape.pods_per_group > 1
    plan_path = f"{PLAN_MOUNT}/plan.yaml"
    if is_group:
        command = ["/bin/bash", "-c", deploy_scripts.lws_leader(shape, plan_path)]
    else:
        command = launch_args(plan_path)
    leader = server_container("leader", options, shape, command,
                              env(options, is_server=True, uses_ray_token=is_group), failures)
    leader_labels = {**labels(options, "server"), "role": "leader"}
    leader_template = {"metadata": {"labels": leader_labels, "annotations": serving_annotations(served)},
                       "spec": pod_spec(plan, options, shape, leader, has_plan=True)}
    worker = container("worker", options, shape, ["/bin/bash", "-c", deploy_scripts.lws_worker(shape)],
                       env(options, is_server=False, uses_ray_token=True), has_plan=False)
    worker_template = {"metadata": {"labels": {**labels(options, "worker"), "role": "worker"}},
                       "spec": pod_spec(plan, options, shape, worker, has_plan=False)}
    lws = {"apiVersion": LWS_API, "kind": "LeaderWorkerSet",
           "metadata": metadata(options, options.name, "server", {"shardserve/plan": describe(plan)}),
           "spec": {"replicas": shape.num_groups, "startupPolicy": "LeaderCreated",
                    "leaderWorkerTemplate": {"size": shape.pods_per_group,
                                             "restartPolicy": "RecreateGroupOnPodRestart",
                                             "leaderTemplate": leader_template,
                                             "workerTemplate": worker_template}}}
    selector = {LWS_NAME_LABEL: options.name, "role": "leader"}
    return [plan_config_map(served, options), lws, service(options, selector)]
