"""The main function of one rank's process (mp executor): join the grid, build the Worker, serve calls.

A rank exits when told to, when its control pipe closes, when it fails (after reporting why) or
when the engine process disappears (a watcher thread), so no rank outlives its engine."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
import traceback

from shardserve.runtime.config import EngineConfig, first_device_index
from shardserve.runtime.distributed import Rendezvous
from shardserve.runtime.parallel_state import ParallelState
from shardserve.runtime.worker_rpc import WorkerCall, WorkerMethod, WorkerReply, call_worker

logger = logging.getLogger(__name__)

PARENT_POLL_SECONDS = 0.5
ENV_PREFIXES = ("NCCL_", "GLOO_", "CUDA_", "TORCH_", "HF_", "RAY_", "MASTER_", "OMP_")


def watch_parent(parent_pid: int) -> None:
    """NOTE: polling getppid works whatever thread started us (PR_SET_PDEATHSIG fires when the
    starting *thread* exits, which asyncio.to_thread makes likely)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def log_environment(rank: int) -> None:
    values = {k: ("<set>" if "TOKEN" in k else v) for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    logger.debug("rank %d runs with %s", rank, values)


def worker_device(config: EngineConfig, state: ParallelState):
    import torch

    if config.device.startswith("cuda"):  # 'cuda:N': this engine's ranks start at GPU N
        first = first_device_index(config.device)
        return torch.device("cuda", (first + state.global_rank) % torch.cuda.device_count())
    return torch.device("cpu")


def setup_rank(config: EngineConfig, state: ParallelState, rendezvous: Rendezvous, num_threads: int):
    """Join the process grid and build this rank's Worker (it loads only its own shard)."""
    import torch

    from shardserve.runtime.distributed import init_distributed
    from shardserve.runtime.worker import Worker

    torch.set_num_threads(num_threads)
    log_environment(state.global_rank)
    device = worker_device(config, state)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_distributed(state, rendezvous, device)
    return Worker(config, device)


def run_worker(config: EngineConfig, state: ParallelState, rendezvous: Rendezvous, conn, parent_pid: int,
               num_threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the engine, which stops us
    watch_parent(parent_pid)
    rank = state.global_rank
    try:
        worker = setup_rank(config, state, rendezvous, num_threads)
        conn.send_bytes(pickle.dumps(WorkerReply(rank)))  # ready
        serve(worker, conn, state)
    except (EOFError, BrokenPipeError):
        pass  # the engine went away
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(WorkerReply(rank, error=traceback.format_exc())))
        except (OSError, ValueError):
            pass
        os._exit(1)
    finally:
        from shardserve.runtime.distributed import destroy_distributed
        destroy_distributed()


def serve(worker, conn, state: ParallelState) -> None:
    while True:
        call: WorkerCall = pickle.loads(conn.recv_bytes())
        if call.method is WorkerMethod.SHUTDOWN:
            return
        value = call_worker(worker, call)
        if call.method is not WorkerMethod.EXECUTE_MODEL or state.is_output_rank:
            conn.send_bytes(pickle.dumps(WorkerReply(state.global_rank, value)))
