"""The multiprocessing executor: one spawned process per rank on this machine, a pipe to each."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import weakref

from shardserve.runtime.distributed import Rendezvous
from shardserve.runtime.distributed_executor import DistributedExecutor, WorkerHandle
from shardserve.runtime.worker_process import run_worker
from shardserve.runtime.worker_rpc import WorkerReply


class ProcessHandle(WorkerHandle):
    def __init__(self, process: multiprocessing.process.BaseProcess, conn):
        self.process, self.conn = process, conn

    def send(self, payload: bytes) -> None:
        self.conn.send_bytes(payload)

    def poll(self, timeout: float) -> WorkerReply | None:
        try:
            if self.conn.poll(timeout):
                return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            pass  # the rank is gone; is_alive says so once it is reaped
        return None

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, grace: float) -> None:
        stop_process(self.process, grace)


def stop_process(process, grace: float) -> None:
    process.join(grace)
    if process.is_alive():
        process.terminate()
        process.join(1.0)
    if process.is_alive():
        process.kill()
        process.join(1.0)


class MultiprocExecutor(DistributedExecutor):
    def rendezvous_host(self) -> str:
        return "127.0.0.1"

    def start_workers(self, rendezvous: Rendezvous) -> list[WorkerHandle]:
        context = multiprocessing.get_context("spawn")  # NOTE: fork would copy torch and CUDA state
        num_threads = max(1, (os.cpu_count() or 1) // len(self.states))
        handles = []
        for state in self.states:
            parent_end, child_end = context.Pipe()
            process = context.Process(target=run_worker, name=f"shardserve-rank{state.global_rank}", daemon=True,
                                      args=(self.config, state, rendezvous, child_end, os.getpid(), num_threads))
            process.start()
            child_end.close()
            handles.append(ProcessHandle(process, parent_end))
            # if the executor is dropped without shutdown(), still stop the process (also at exit)
            weakref.finalize(self, stop_process, process, 0.0)
        return handles
