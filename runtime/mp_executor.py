"""The multiprocessing executor: one process per rank on this machine, started from a module, a pipe to each."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import weakref

from shardserve.runtime.distributed import Rendezvous
from shardserve.runtime.distributed_executor import DistributedExecutor, WorkerHandle
from shardserve.runtime.worker_rpc import RankStartup, WorkerReply

RANK_MODULE = "shardserve.runtime.worker_process"
KILL_WAIT_SECONDS = 1.0
SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()  # the caller's working directory stays off the path


class ProcessHandle(WorkerHandle):
    def __init__(self, process: subprocess.Popen, conn):
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
        return self.process.poll() is None

    def stop(self, grace: float) -> None:
        stop_process(self.process, grace)
        self.conn.close()


def stop_process(process: subprocess.Popen, grace: float) -> None:
    """Wait up to `grace` seconds for an exit, then SIGKILL it (its pid alone). NOTE: ranks and replicas
    ignore SIGTERM, which a service manager sends the whole process group: the server drains them."""
    for stop, wait in ((None, grace), (process.kill, KILL_WAIT_SECONDS)):
        if stop is not None:
            stop()
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


def start_rank(startup: RankStartup) -> ProcessHandle:
    """NOTE: a fresh interpreter runs the rank's module, never the caller's main (spawn imports it
    again: a script on stdin, or one without a main guard, breaks or runs twice). It imports
    shardserve as any fresh interpreter would: installed, or on PYTHONPATH."""
    parent_end, child_end = multiprocessing.Pipe()
    fd = child_end.fileno()
    process = subprocess.Popen([sys.executable, *SAFE_PATH, "-m", RANK_MODULE, str(fd), str(os.getpid())],
                               pass_fds=(fd,), stdin=subprocess.DEVNULL)
    child_end.close()
    try:
        parent_end.send_bytes(pickle.dumps(startup))
    except OSError:
        pass  # the rank died at once: the executor's wait for it says so
    return ProcessHandle(process, parent_end)


class MultiprocExecutor(DistributedExecutor):
    def rendezvous_host(self) -> str:
        return "127.0.0.1"

    def start_workers(self, rendezvous: Rendezvous) -> list[WorkerHandle]:
        num_threads = max(1, (os.cpu_count() or 1) // len(self.states))
        handles: list[WorkerHandle] = []
        for state in self.states:
            handle = start_rank(RankStartup(self.config, state, rendezvous, num_threads))
            handles.append(handle)
            # if the executor is dropped without shutdown(), still stop the process (also at exit)
            weakref.finalize(self, stop_process, handle.process, 0.0)
        return handles
