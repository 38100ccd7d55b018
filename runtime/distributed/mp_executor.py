"""The multiprocessing executor: one process per rank on this machine, a socket to each
(runtime/distributed/child_process.py starts them and frames the sockets)."""

from __future__ import annotations

import os
import socket
import subprocess
import weakref
from collections import deque
from typing import cast

from shardserve.runtime.distributed.child_process import FrameReader, send_payload, start_child, stop_process
from shardserve.runtime.distributed.process_group import Rendezvous
from shardserve.runtime.distributed.distributed_executor import DistributedExecutor, WorkerHandle
from shardserve.runtime.distributed.worker_rpc import RankStartup, WorkerReply

RANK_MODULE = "shardserve.runtime.distributed.worker_process"


class ProcessHandle(WorkerHandle):
    def __init__(self, process: subprocess.Popen, sock: socket.socket):
        self.process, self.sock = process, sock
        self.inbox = FrameReader(sock)
        self.replies: deque[WorkerReply] = deque()  # read, not yet taken

    def send(self, payload: bytes) -> None:
        send_payload(self.sock, payload)

    def poll(self, timeout: float) -> WorkerReply | None:
        if not self.replies:  # (the rank gone: is_alive says so once it is reaped)
            self.replies.extend(cast(list[WorkerReply], self.inbox.read(timeout)))
        return self.replies.popleft() if self.replies else None

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float) -> None:
        stop_process(self.process, grace)
        self.sock.close()


def start_rank(startup: RankStartup) -> ProcessHandle:
    return ProcessHandle(*start_child(RANK_MODULE, startup))


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
