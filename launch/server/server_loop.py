"""The server's event loop: uvicorn, the engine's watchdog, the plan check, and the drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time

from shardserve.launch.server.admission import Admission
from shardserve.launch.server.connections import quiet_accept_errors, raise_file_limit
from shardserve.launch.server.replicas import ReplicaSet

logger = logging.getLogger("shardserve.launch")

POLL_SECONDS = 0.05
ENDING_SECONDS = 1  # after the drain: for the stopped requests' last bytes to leave


class Drain:
    """SIGTERM (or Ctrl-C): refuse new API requests (503, /health too), give those in flight up to
    `timeout` seconds, then abort the rest in the engines (a stream ends with an error event and
    [DONE], a non-streaming request gets a 503), then stop uvicorn. A second signal cuts the wait short.

    NOTE: uvicorn's own graceful stop closes the listening socket at once (new clients hang or are
    refused rather than told 503) and cancels the requests still running at its timeout (tracebacks,
    cut streams, 500s); uvicorn is told to stop only once nothing is left for it to cut."""

    def __init__(self, admission: Admission, replicas: ReplicaSet, timeout: float):
        self.admission, self.replicas, self.timeout = admission, replicas, timeout
        self.task: asyncio.Task | None = None
        self.is_cut_short = False

    def on_signal(self, server) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run(server))
        else:
            logger.warning("second signal: ending the requests in flight now")
            self.is_cut_short = True

    async def run(self, server) -> None:
        self.admission.is_draining = True
        num_in_flight = self.admission.num_in_flight
        if num_in_flight:
            logger.info("shutting down: new requests get 503; %d in flight get up to %g s to finish "
                        "(--shutdown-timeout)", num_in_flight, self.timeout)
        if not await self._wait_idle(self.timeout):
            num_left = self.admission.num_in_flight
            num_aborted = await self.replicas.stop()
            logger.warning("shutting down: %d requests still in flight are ended with a 503 (%d prompts aborted)",
                           num_left, num_aborted)
            await self._wait_idle(ENDING_SECONDS)
        server.should_exit = True

    async def _wait_idle(self, timeout: float) -> bool:
        """Until no admitted request is left, `timeout` passes or a second signal; whether none is left."""
        deadline = time.monotonic() + timeout
        while self.admission.num_in_flight and time.monotonic() < deadline and not self.is_cut_short:
            await asyncio.sleep(POLL_SECONDS)
        return self.admission.num_in_flight == 0


def server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """NOTE: uvicorn re-raises SIGTERM after a graceful stop, so the process would die by the signal;
        shardserve owns SIGINT/SIGTERM instead: they start the drain, and the process exits 0."""

        def __init__(self, config: uvicorn.Config, drain: Drain):
            super().__init__(config)
            self.drain = drain

        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.drain.on_signal, self)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

    return Server


async def run(server, replicas: ReplicaSet, listener: socket.socket) -> tuple[int, bool]:
    """Serve until the drain or the engine's death stops uvicorn, then stop the engines;
    (exit code, whether the engine died)."""
    exit_code, engine_died = 0, False
    quiet_accept_errors(asyncio.get_running_loop(), raise_file_limit())

    async def watchdog():
        nonlocal exit_code, engine_died
        while not server.should_exit:
            dead = replicas.dead_reason()
            if dead:
                logger.error("engine died: %s; stopping the server", dead)
                exit_code, engine_died = 1, True
                await asyncio.sleep(1.0)  # /health answers 503 meanwhile
                server.should_exit = True
                return
            replicas.restart_dead()  # (with replicas: one that died is restarted while the others serve)
            await asyncio.sleep(0.5)

    replicas.start()
    watch = asyncio.create_task(watchdog())
    check = asyncio.create_task(replicas.plan_check.run()) if replicas.plan_check else None  # once a minute
    try:
        await server.serve(sockets=[listener])
    finally:
        watch.cancel()
        if check is not None:
            check.cancel()
        await replicas.shutdown()
    if exit_code == 0 and not server.started:
        exit_code = 1  # could not bind the port: uvicorn has said why
    logger.info("shut down cleanly" if exit_code == 0 else "stopped with an error")
    return exit_code, engine_died
