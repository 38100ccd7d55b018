"""Wait until a Ray cluster offers the GPUs (for CPU ranks: the nodes) a plan's ranks need: a deployed
leader's step between starting the Ray head and `shardserve launch` (whose hardware check reads the
cluster once).

    python -m shardserve.launch.cluster.wait_cluster --address auto --gpus 16 --timeout 600
    python -m shardserve.launch.cluster.wait_cluster --address auto --nodes 2 --timeout 600

Exit 0 once the live nodes hold the GPUs and number at least --nodes; exit 1 with one line naming
what was missing when the time runs out.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

REPORT_EVERY_SECONDS = 15.0


def wanted(gpus: int, nodes: int) -> str:
    """'16 GPUs', '2 nodes' or '16 GPUs on 2 nodes': what the leader waits for, as its lines say it."""
    parts = ([f"{gpus} GPUs"] if gpus else []) + ([f"{nodes} nodes"] if nodes > 1 or not gpus else [])
    return " on ".join(parts)


def wait_for_cluster(count: Callable[[], tuple[float, int] | None], gpus: int, nodes: int, timeout: float,
                     interval: float = 2.0, clock: Callable[[], float] = time.monotonic,
                     sleep: Callable[[float], None] = time.sleep, say: Callable[[str], None] = print) -> bool:
    """Poll `count` (GPUs and live nodes, or None while the cluster cannot be reached) until it shows
    `gpus` GPUs on at least `nodes` nodes; say where things stand every REPORT_EVERY_SECONDS. False on
    timeout. NOTE: a CPU plan's group waits for its nodes: each offers one CPU slot per rank."""
    start, need = clock(), wanted(gpus, nodes)
    last_report = None
    seen: tuple[float, int] | None = None
    while True:
        seen = count()
        if seen is not None and seen[0] >= gpus and seen[1] >= nodes:
            say(f"shardserve: the cluster offers {seen[0]:g} GPUs on {seen[1]} node(s); {need} needed")
            return True
        waited = clock() - start
        if waited >= timeout:
            found = "no cluster answered" if seen is None else f"{seen[0]:g} GPUs on {seen[1]} node(s)"
            say(f"shardserve: gave up after {timeout:g} s waiting for {need} ({found}); are the other "
                "nodes running and able to reach the head? Look at their logs")
            return False
        if last_report is None or waited - last_report >= REPORT_EVERY_SECONDS:
            found = "the head does not answer yet" if seen is None else f"{seen[0]:g} GPUs on {seen[1]} node(s)"
            say(f"shardserve: waiting for {need}: {found} ({waited:.0f} s)")
            last_report = waited
        sleep(interval)


def ray_counter(address: str) -> Callable[[], tuple[float, int] | None]:
    """GPUs and live nodes of the Ray cluster at `address` ('auto': the one this host is in)."""
    import ray

    from shardserve.launch.cluster.ray_cluster import resolve_address, use_cluster_auth

    address = resolve_address(address)
    use_cluster_auth()

    def count() -> tuple[float, int] | None:
        if not ray.is_initialized():
            try:
                ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
            except Exception:  # ConnectionError, RuntimeError: not up yet
                ray.shutdown()
                return None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        return sum(n.get("Resources", {}).get("GPU", 0) for n in nodes), len(nodes)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardserve.launch.cluster.wait_cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="auto", help="HEAD:PORT, or auto (this host's cluster)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs the live nodes must hold")
    parser.add_argument("--nodes", type=int, default=1, help="live nodes the cluster must have")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    args = parser.parse_args(argv)
    ok = wait_for_cluster(ray_counter(args.address), args.gpus, args.nodes, args.timeout,
                          say=lambda m: print(m, flush=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
