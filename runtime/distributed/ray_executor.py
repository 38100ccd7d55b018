"""The Ray executor: one actor per rank in placement groups (a stage's TP ranks packed on one node,
stages wherever Ray finds room), joining RAY_ADDRESS or starting a local Ray."""

from __future__ import annotations

import collections
import os
import pickle
import time

from shardserve.runtime.distributed.process_group import Rendezvous
from shardserve.runtime.distributed.distributed_executor import DistributedExecutor, WorkerHandle
from shardserve.runtime.distributed.rank import ENV_PREFIXES
from shardserve.runtime.distributed.worker_rpc import RankPlacement, RankStartup, WorkerReply

PLACEMENT_TIMEOUT_SECONDS = 300.0
FORWARD_ENV = "SHARDSERVE_FORWARD_ENV"
HEARTBEAT_SECONDS = 1.0  # an idle actor is pinged this often, so a lost node is seen at once
# Per-node variables: the node's own value (`shardserve cluster join`, Ray) beats the driver's.
NODE_OWN_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES")  # Ray sets the last


class RankActor:
    """One rank as a Ray actor (wrapped by ray.remote when Ray is imported): a thin adapter over Rank."""

    def __init__(self, startup: RankStartup, env: dict[str, str]):
        import ray

        from shardserve.runtime.distributed.rank import Rank

        apply_env(env)
        self.node_ip = ray.util.get_node_ip_address()
        self.rank = Rank(startup)

    def ready(self) -> bytes:
        """The ready reply names the rank's node and the per-node and chosen variables it got."""
        names = (*NODE_OWN_ENV, *chosen_env_names())
        return self.rank.ready(RankPlacement(self.node_ip, {k: os.environ[k] for k in names if k in os.environ}))

    def ping(self) -> None:
        return None

    def call(self, payload: bytes) -> bytes | None:
        """A pickled WorkerCall in, a pickled WorkerReply out (None where the rank owes no reply)."""
        return self.rank.handle(payload)


class ActorHandle(WorkerHandle):
    def __init__(self, actor, rank: int):
        import ray

        self.ray, self.actor, self.rank = ray, actor, rank
        self.pending = collections.deque([actor.ready.remote()])
        self.is_dead = False
        self.heartbeat = None  # an outstanding ping
        self.last_heartbeat = time.monotonic()

    def send(self, payload: bytes) -> None:
        self.pending.append(self.actor.call.remote(payload))

    def poll(self, timeout: float) -> WorkerReply | None:
        """Replies come in call order; calls that owe none resolve to None and are skipped."""
        while self.pending:
            ready, _ = self.ray.wait([self.pending[0]], timeout=timeout)
            if not ready:
                return None
            ref = self.pending.popleft()
            try:
                payload = self.ray.get(ref)
            except self.ray.exceptions.RayError as error:  # the actor died (or its call was lost)
                self.is_dead = True
                self.pending.clear()
                return WorkerReply(self.rank, error=f"actor of rank {self.rank} died: {error}")
            if payload is not None:
                return pickle.loads(payload)
            timeout = 0
        return None

    def is_alive(self) -> bool:
        """NOTE: a call pending on a lost actor fails by itself, but an idle engine has none, so a
        ping goes out every HEARTBEAT_SECONDS; the GCS fails it once the actor or its node is gone."""
        if self.is_dead:
            return False
        if self.heartbeat is not None and self.ray.wait([self.heartbeat], timeout=0)[0]:
            try:
                self.ray.get(self.heartbeat)
            except self.ray.exceptions.RayError:
                self.is_dead = True
                self.pending.clear()
                return False
            self.heartbeat = None
        if self.heartbeat is None and time.monotonic() - self.last_heartbeat > HEARTBEAT_SECONDS:
            self.heartbeat = self.actor.ping.remote()
            self.last_heartbeat = time.monotonic()
        return True

    def stop(self, grace: float) -> None:
        if grace > 0 and not self.is_dead and self.pending:
            self.ray.wait(list(self.pending), num_returns=len(self.pending), timeout=grace)
        self.ray.kill(self.actor)
        self.is_dead = True


def chosen_env_names() -> list[str]:
    """Variables named in SHARDSERVE_FORWARD_ENV (comma-separated) travel too."""
    return [n for n in os.environ.get(FORWARD_ENV, "").split(",") if n]


def forwarded_env() -> dict[str, str]:
    """The variables every rank must see, remote nodes included (NCCL_*, GLOO_*, HF_TOKEN, ...,
    and the chosen ones). NOTE: not RAY_*: those belong to each node's own Ray."""
    chosen = {*chosen_env_names(), FORWARD_ENV}
    return {k: v for k, v in os.environ.items()
            if (k.startswith(ENV_PREFIXES) and not k.startswith("RAY_")) or k in chosen}


def apply_env(env: dict[str, str]) -> None:
    """In a rank, before torch.distributed starts: the driver's variables, except the per-node ones
    the node already sets (a node's interface name is its own)."""
    for key, value in env.items():
        if key not in NODE_OWN_ENV or key not in os.environ:
            os.environ[key] = value


class RayExecutor(DistributedExecutor):
    def rendezvous_host(self) -> str:
        ray = connect_ray(self.config.parallel.world_size)
        return ray.util.get_node_ip_address()

    def start_workers(self, rendezvous: Rendezvous) -> list[WorkerHandle]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        tp = self.config.parallel.tensor_parallel_size
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if self.config.device.startswith("cuda") else {})}
        check_cluster_fits(bundle, len(self.states))
        # NOTE: one STRICT_PACK group per stage keeps TP all-reduces inside a node
        groups = [ray.util.placement_group([bundle] * tp, strategy="STRICT_PACK")
                  for _ in range(self.config.parallel.pipeline_parallel_size)]
        ray.get([g.ready() for g in groups], timeout=PLACEMENT_TIMEOUT_SECONDS)
        actor_class = ray.remote(RankActor)
        handles: list[WorkerHandle] = []
        for state in self.states:
            strategy = PlacementGroupSchedulingStrategy(groups[state.pp_rank], state.tp_rank)
            actor = actor_class.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                        scheduling_strategy=strategy).remote(
                RankStartup(self.config, state, rendezvous, 1), forwarded_env())
            handles.append(ActorHandle(actor, state.global_rank))
        self.placement_groups = groups
        return handles

    def shutdown(self) -> None:
        super().shutdown()
        import ray

        for group in getattr(self, "placement_groups", []):
            ray.util.remove_placement_group(group)


def check_cluster_fits(bundle: dict[str, float], num_ranks: int) -> None:
    """Refuse before placing anything when the cluster lacks a device per rank."""
    import ray

    total = ray.cluster_resources()
    for resource, amount in bundle.items():
        if total.get(resource, 0.0) < amount * num_ranks:
            raise ValueError(f"{num_ranks} ranks need {amount * num_ranks:g} {resource} in the Ray cluster, "
                             f"which has {total.get(resource, 0.0):g}")


def connect_ray(world_size: int):
    """Join RAY_ADDRESS (or the address given), else start a local Ray with a CPU slot per rank."""
    import ray

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, world_size), include_dashboard=False,
                     log_to_driver=False)
    return ray
