"""One rank in whatever process holds it: join the grid, build the Worker, answer the engine's calls.

The mp rank process (worker_process.py) and the Ray actor (ray_executor.py) are thin adapters: they
carry pickled WorkerCalls to Rank.handle and carry back what it returns."""

from __future__ import annotations

import logging
import os
import pickle
import traceback

from shardserve.runtime.config import EngineConfig, first_device_index
from shardserve.runtime.distributed.parallel_state import ParallelState
from shardserve.runtime.distributed.worker_rpc import RankPlacement, RankStartup, WorkerCall, WorkerMethod, WorkerReply, call_worker

logger = logging.getLogger(__name__)

ENV_PREFIXES = ("NCCL_", "GLOO_", "CUDA_", "TORCH_", "HF_", "RAY_", "MASTER_", "OMP_")


def log_environment(rank: int) -> None:
    values = {k: ("<set>" if "TOKEN" in k else v) for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    logger.debug("rank %d runs with %s", rank, values)


def configure_logging(startup: RankStartup) -> None:
    """A rank process logs as its engine does (nothing when the engine shows no logs), its lines
    marked with the rank; a rank sharing the engine's process keeps the process's logging."""
    if startup.log_level is None or logging.getLogger().handlers:
        return
    logging.basicConfig(level=startup.log_level, datefmt="%H:%M:%S",
                        format=f"%(asctime)s %(levelname)s %(name)s (rank {startup.state.global_rank}): %(message)s")


def worker_device(config: EngineConfig, state: ParallelState):
    import torch

    if config.device.startswith("cuda"):  # 'cuda:N': this engine's ranks start at GPU N
        first = first_device_index(config.device)
        return torch.device("cuda", (first + state.global_rank) % torch.cuda.device_count())
    return torch.device("cpu")


def setup_rank(startup: RankStartup):
    """Join the process grid and build this rank's Worker (it loads only its own shard)."""
    import torch

    from shardserve.runtime.distributed.process_group import init_distributed
    from shardserve.runtime.worker.worker import Worker

    torch.set_num_threads(startup.num_threads)
    configure_logging(startup)
    log_environment(startup.state.global_rank)
    device = worker_device(startup.config, startup.state)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_distributed(startup.state, startup.rendezvous, device)
    return Worker(startup.config, device)


def failure_reply(rank: int) -> bytes:
    """The exception being handled, as a rank's last reply."""
    return pickle.dumps(WorkerReply(rank, error=traceback.format_exc()))


class Rank:
    """A rank serves until SHUTDOWN or its first failure (is_serving turns False, has_failed says which)."""

    def __init__(self, startup: RankStartup):
        self.state = startup.state
        self.worker = setup_rank(startup)
        self.is_serving = True
        self.has_failed = False

    def ready(self, placement: RankPlacement | None = None) -> bytes:
        """The first reply: the rank is up (placement None: a process of the engine's host)."""
        return pickle.dumps(WorkerReply(self.state.global_rank, placement))

    def handle(self, payload: bytes) -> bytes | None:
        """A pickled WorkerCall in; a pickled WorkerReply out, or None where the rank owes none
        (SHUTDOWN, and a step on any rank but the output rank)."""
        call: WorkerCall = pickle.loads(payload)
        if call.method is WorkerMethod.SHUTDOWN:
            from shardserve.runtime.distributed.process_group import destroy_distributed

            self.is_serving = False
            destroy_distributed()
            return None
        try:
            value = call_worker(self.worker, call)
        except Exception:
            self.is_serving, self.has_failed = False, True
            return failure_reply(self.state.global_rank)
        if call.method is WorkerMethod.EXECUTE_MODEL and not self.state.is_output_rank:
            return None
        return pickle.dumps(WorkerReply(self.state.global_rank, value))
