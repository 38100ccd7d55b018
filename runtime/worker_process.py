"""The main of one mp rank's process (`python -m shardserve.runtime.worker_process FD PARENT_PID`).

FD is the rank's end of its control channel: a RankStartup arrives first, then WorkerCalls, each
answered by Rank.handle. A rank exits when told to, when the channel closes, when it fails (after
reporting why) or when the engine process disappears (a watcher thread), so no rank outlives its engine."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from shardserve.runtime.rank import Rank, failure_reply
from shardserve.runtime.worker_rpc import RankStartup

PARENT_POLL_SECONDS = 0.5


def watch_parent(parent_pid: int) -> None:
    """NOTE: polling getppid works whatever thread started us (PR_SET_PDEATHSIG fires when the
    starting *thread* exits, which asyncio.to_thread makes likely)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve(startup: RankStartup, conn: Connection) -> None:
    """Relay calls to the Rank until SHUTDOWN; a failure is reported, then the process exits."""
    from shardserve.runtime.distributed import destroy_distributed

    try:
        rank = Rank(startup)
        conn.send_bytes(rank.ready())
        while rank.is_serving:
            reply = rank.handle(conn.recv_bytes())
            if reply is not None:
                conn.send_bytes(reply)
    except (EOFError, BrokenPipeError):
        destroy_distributed()  # the engine went away
        return
    except BaseException:
        try:
            conn.send_bytes(failure_reply(startup.state.global_rank))
        except (OSError, ValueError):
            pass
        os._exit(1)
    if rank.has_failed:
        os._exit(1)


def main() -> None:
    # Ctrl-C, and a SIGTERM to the whole process group (systemd's stop), belong to the engine, which drains
    # and then stops us (a stop that cannot wait escalates to SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd, parent_pid = (int(arg) for arg in sys.argv[1:3])
    watch_parent(parent_pid)
    conn = Connection(fd)
    try:
        startup: RankStartup = pickle.loads(conn.recv_bytes())
    except EOFError:
        return  # the engine went away before we started
    serve(startup, conn)


if __name__ == "__main__":
    main()
