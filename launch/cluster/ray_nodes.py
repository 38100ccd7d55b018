"""The nodes of a Ray cluster as shardserve sees them: resources and liveness from the GCS, and
each live node's own facts (versions, interfaces, model files) from a task pinned to it."""

from __future__ import annotations

import logging
import os

from shardserve.launch.cluster.ray_cluster import ClusterError, use_cluster_auth
from shardserve.launch.cluster.node_facts import (ip_problem, interface_problem, model_differences,
                                          node_facts, version_differences)

FACTS_TIMEOUT_SECONDS = 120.0


def connect(address: str | None):
    """Join the cluster at `address` (or RAY_ADDRESS), with this host's cluster token if any."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ClusterError("no cluster address: pass --address HEAD_IP:PORT, set RAY_ADDRESS, "
                           "or run `shardserve cluster up --head` on this host first")
    if not ray.is_initialized():
        use_cluster_auth()
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
        except (ConnectionError, RuntimeError) as e:
            raise ClusterError(f"cannot join the Ray cluster at {address}: {e} (is it up, and "
                               "does this host have the cluster's token?)") from None
    return ray


def list_nodes(model_path: str | None = None, address: str | None = None) -> list[dict]:
    """One record per node: ip, alive, head, gpus, cpus and (live nodes) `facts` or `error`."""
    ray = connect(address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(ray.nodes(), key=lambda n: (not _is_head(n), n["NodeManagerAddress"]))
    task = ray.remote(num_cpus=0)(node_facts)
    refs = {n["NodeID"]: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(model_path, n["NodeManagerAddress"])
        for n in nodes if n["Alive"]}
    records = []
    for n in nodes:
        record = {"ip": n["NodeManagerAddress"], "alive": n["Alive"], "head": _is_head(n),
                  "gpus": int(n["Resources"].get("GPU", 0)),
                  "cpus": int(n["Resources"].get("CPU", 0))}
        if n["NodeID"] in refs:
            try:
                record["facts"] = ray.get(refs[n["NodeID"]], timeout=FACTS_TIMEOUT_SECONDS)
            except Exception as e:  # noqa: BLE001 - a node that cannot answer is reported
                record["error"] = f"{type(e).__name__}: {e}"
        records.append(record)
    return records


def _is_head(node: dict) -> bool:
    return "node:__internal_head__" in node["Resources"]


def node_problems(nodes: list[dict], reference: dict) -> dict[str, list[str]]:
    """ip -> what differs from `reference` (the launching host's facts) or is wrong there."""
    problems = {}
    for node in nodes:
        if not node["alive"]:
            continue
        if "facts" not in node:
            problems[node["ip"]] = [f"it did not report its facts ({node.get('error')})"]
            continue
        facts = node["facts"]
        found = version_differences(reference, facts) + model_differences(reference, facts)
        found += [p for p in (ip_problem(facts), interface_problem(facts)) if p]
        if found:
            problems[node["ip"]] = found
    return problems


def check_cluster(model_path: str | None, address: str | None = None) -> list[dict]:
    """Before loading: every live node has the model's files and the launching host's versions.
    A mismatch raises naming the node and the difference; returns the nodes."""
    nodes = list_nodes(model_path, address)
    problems = node_problems(nodes, node_facts(model_path, ip=None))
    if problems:
        lines = [f"node {ip}: {p}" for ip, found in problems.items() for p in found]
        raise ClusterError("the cluster's nodes differ from this host:\n  " + "\n  ".join(lines)
                           + "\ninstall the same versions and copy the model folder to every "
                           "node at the same path")
    return nodes
