"""The main of one mp rank's process (`python -m shardserve.runtime.distributed.worker_process FD PARENT_PID`).

FD is the rank's end of its socket (runtime/distributed/child_process.py): a RankStartup arrives first, then
WorkerCalls, each answered by Rank.handle. A rank exits when told to, when the socket closes, when it
fails (after reporting why) or when the engine process disappears, so no rank outlives its engine."""

from __future__ import annotations

import os
import socket

from shardserve.runtime.distributed.child_process import child_main, recv_payload, send_payload
from shardserve.runtime.distributed.rank import Rank, failure_reply
from shardserve.runtime.distributed.worker_rpc import RankStartup


def serve(startup: RankStartup, sock: socket.socket) -> None:
    """Relay calls to the Rank until SHUTDOWN; a failure is reported, then the process exits."""
    from shardserve.runtime.distributed.process_group import destroy_distributed

    try:
        rank = Rank(startup)
        send_payload(sock, rank.ready())
        while rank.is_serving:
            reply = rank.handle(recv_payload(sock))
            if reply is not None:
                send_payload(sock, reply)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        destroy_distributed()  # the engine went away
        return
    except BaseException:
        try:
            send_payload(sock, failure_reply(startup.state.global_rank))
        except (OSError, ValueError):
            pass
        os._exit(1)
    if rank.has_failed:
        os._exit(1)


def main() -> None:
    started = child_main()
    if started is None:
        return  # the engine went away before we started
    sock, startup = started
    assert isinstance(startup, RankStartup)  # the engine's first message
    serve(startup, sock)


if __name__ == "__main__":
    main()
