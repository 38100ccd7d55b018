"""The bash the deploy targets run in their pods and nodes: start or join the Ray cluster, wait for
the rest of the group, then `launch`. Each script starts with `set -euo pipefail`; the tests run
shellcheck on every one.

NOTE: no `$(...)` anywhere: Kubernetes reads `$(NAME)` in a container's command as one of its own
variables, so the scripts read the environment the shell's way ("$NAME") and count with $SECONDS.
"""

from __future__ import annotations

from shardserve.launch.deploy.plan import GROUP_WAIT_SECONDS, HTTP_PORT, RAY_PORT, Shape

STRICT = "set -euo pipefail"
ULIMIT = 'ulimit -n 65536 || echo "shardserve: could not raise the open-file limit to 65536 (Ray wants it)"'


def wait_for_port(host: str, port: str, what: str) -> list[str]:
    """Lines that wait until HOST:PORT accepts a connection, saying so every 5 s, and give up after
    GROUP_WAIT_SECONDS with one line naming what to look at. `host`, `port`: shell words."""
    return [
        f'until (: > "/dev/tcp/{host}/{port}") 2>/dev/null; do',
        f'  if [ "$SECONDS" -ge {GROUP_WAIT_SECONDS} ]; then',
        f'    echo "shardserve: no Ray head at {host}:{port} after {GROUP_WAIT_SECONDS} s; giving up (look at {what})" >&2',
        "    exit 1",
        "  fi",
        f'  echo "shardserve: waiting for the Ray head at {host}:{port} ($SECONDS s)"',
        "  sleep 5",
        "done",
    ]


def group_need(shape: Shape) -> str:
    """What a group's leader waits for, in words: '16 GPUs', or '2 nodes' of CPU ranks."""
    return f"{shape.pods_per_group} nodes" if shape.is_cpu else f"{shape.num_gpus} GPUs"


def wait_for_group(address: str, shape: Shape) -> str:
    """The leader's wait: until the cluster offers the GPUs the plan's ranks need (CPU ranks: until
    every node of the group has joined)."""
    need = f"--nodes {shape.pods_per_group}" if shape.is_cpu else f"--gpus {shape.num_gpus}"
    return f"python -m shardserve.launch.cluster.wait_cluster --address {address} {need} --timeout {GROUP_WAIT_SECONDS}"


def node_slots(shape: Shape) -> str:
    """`cluster up/join` options: CPU ranks get one Ray CPU slot each, so that Ray places as many on
    a node as the plan does (it would count every core of the pod otherwise); GPUs place themselves."""
    return f" --num-cpus {shape.gpus_per_pod}" if shape.is_cpu else ""


def hold_node(*cleanup: str) -> list[str]:
    """Hold the pod or the job step while this node's Ray runs; on SIGTERM (the pod deleted, the job
    cancelled) stop the node with `cluster down`, which SIGKILLs what outlives its grace (Ray's GCS
    server ignores SIGTERM) and removes Ray's temp folder, well within Kubernetes' grace period and
    Slurm's KillWait (30 s each by default).
    NOTE: `sleep & wait`, not `exec sleep`: bash runs a trap only between commands, and a sleep as a
    pod's PID 1 ignores SIGTERM, so a deleted pod waited out the whole grace period.
    `cleanup`: commands run after `cluster down`."""
    return [f"trap '{'; '.join(['shardserve cluster down', *cleanup, 'exit 0'])}' TERM", "sleep infinity &", "wait"]


def launch_line(plan_path: str, ray_address: str | None, port: str = str(HTTP_PORT)) -> str:
    line = f"exec shardserve launch {plan_path} --host 0.0.0.0 --port {port}"
    return line + (f" --ray-address {ray_address}" if ray_address else "")


def lws_leader(shape: Shape, plan_path: str) -> str:
    """A group's leader: the Ray head on the pod's IP, the workers awaited, then the server."""
    return "\n".join([
        STRICT,
        f'echo "shardserve: Ray head on $POD_IP:{RAY_PORT}, waiting for {group_need(shape)} in the group"',
        f'shardserve cluster up --head --node-ip "$POD_IP" --port {RAY_PORT}{node_slots(shape)}',
        wait_for_group("auto", shape),
        launch_line(plan_path, "auto"),
    ]) + "\n"


def lws_worker(shape: Shape) -> str:
    """A group's worker: wait for the leader's head, join it, then hold the pod while Ray runs.
    NOTE: when a node is lost the leader's `launch` exits, and LWS recreates the whole group."""
    return "\n".join([
        STRICT,
        *wait_for_port("$LWS_LEADER_ADDRESS", str(RAY_PORT), "the leader pod's log"),
        f'shardserve cluster join "$LWS_LEADER_ADDRESS:{RAY_PORT}" --node-ip "$POD_IP"{node_slots(shape)}',
        *hold_node(),
    ]) + "\n"


def kuberay_head(shape: Shape, plan_path: str) -> str:
    """KubeRay's own `ray start --head --block` (its KUBERAY_GEN_RAY_START_CMD) in the background,
    then the server once the worker pods' GPUs have joined."""
    return "\n".join([
        STRICT,
        ULIMIT,
        'eval "$KUBERAY_GEN_RAY_START_CMD" &',
        wait_for_group("auto", shape),
        launch_line(plan_path, "auto"),
    ]) + "\n"


def kuberay_worker() -> str:
    """A worker is KubeRay's generated `ray start --block` (KubeRay's init container waits for the head)."""
    return "\n".join([STRICT, ULIMIT, 'eval "exec $KUBERAY_GEN_RAY_START_CMD"']) + "\n"
