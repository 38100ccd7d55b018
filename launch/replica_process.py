"""The main of one data-parallel replica's process (`python -m shardserve.launch.replica_process FD PID`).

FD is the replica's end of a socketpair with the API server: a ReplicaStartup arrives, the replica
builds its AsyncEngine (and with it its ranks, started as children of this process), answers
ReplicaReady, then serves AddPrompt / AbortPrompt with DeltaBatches until StopReplica, the socket
closing, its engine dying (EngineFailed, then exit 1) or the server's process disappearing."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import traceback

from shardserve.launch.replica_protocol import (AbortPrompt, AddPrompt, DeltaBatch, EngineFailed, PromptFailed,
                                                ReplicaFailed, ReplicaReady, ReplicaStartup, StatsMessage,
                                                StopReplica, frame, portable_error, read_message,
                                                recv_blocking, send_blocking)

logger = logging.getLogger("shardserve.launch.replica")

STATS_SECONDS = 0.5


class ReplicaServer:
    """One replica's engine, driven by the server's messages on an asyncio stream."""

    def __init__(self, engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.engine, self.reader, self.writer = engine, reader, writer
        self.prompts: dict[str, asyncio.Task] = {}
        self._deltas: list = []  # this loop turn's deltas, sent together by _flush

    def send(self, message: object) -> None:
        self._flush()  # nothing overtakes a delta
        self.writer.write(frame(message))

    def _send_delta(self, delta) -> None:
        """NOTE: a step's deltas wake every prompt's task in the same loop turn; the first one schedules a
        flush after them, so one step's deltas cross the socket as one DeltaBatch."""
        if not self._deltas:
            asyncio.get_running_loop().call_soon(self._flush)
        self._deltas.append(delta)

    def _flush(self) -> None:
        if self._deltas:
            deltas, self._deltas = self._deltas, []
            self.writer.write(frame(DeltaBatch(deltas)))

    async def serve(self) -> int:
        """Until StopReplica or the server goes; the process's exit code."""
        self.engine.start()
        watch = asyncio.create_task(self._report())
        try:
            while not watch.done():
                read = asyncio.create_task(read_message(self.reader))
                await asyncio.wait({read, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    break
                try:
                    message = read.result()
                except EOFError:
                    return 0  # the server went away
                if isinstance(message, StopReplica):
                    return 0
                self._handle(message)
            return 1  # the engine died: EngineFailed is sent
        finally:
            watch.cancel()
            for task in self.prompts.values():
                task.cancel()
            await self.engine.shutdown()

    def _handle(self, message: object) -> None:
        if isinstance(message, AddPrompt):
            self.prompts[message.prompt_id] = asyncio.create_task(self._run(message))
        elif isinstance(message, AbortPrompt):
            task = self.prompts.pop(message.prompt_id, None)
            if task is not None:
                task.cancel()  # the engine's generate() frees the prompt's blocks as it unwinds
        else:
            raise TypeError(f"a replica cannot act on {type(message).__name__}")

    async def _run(self, add: AddPrompt) -> None:
        try:
            async for delta in self.engine.generate(add.prompt, add.params, add.prompt_id, add.lora):
                self._send_delta(delta)
        except asyncio.CancelledError:
            pass
        except Exception as error:
            self.send(PromptFailed(add.prompt_id, portable_error(error)))
        finally:
            self.prompts.pop(add.prompt_id, None)

    async def _report(self) -> None:
        """Stats for /metrics every STATS_SECONDS; returns once the engine has died (after saying so)."""
        while self.engine.error is None:
            self.send(StatsMessage(self.engine.get_stats()))
            await self.writer.drain()
            await asyncio.sleep(STATS_SECONDS)
        error = self.engine.error
        self.send(EngineFailed(f"{type(error).__name__}: {error}"))
        await self.writer.drain()


def build_engine(sock: socket.socket, startup: ReplicaStartup):
    """The replica's AsyncEngine, announced with ReplicaReady; None (after ReplicaFailed) if it failed."""
    from shardserve.runtime import AsyncEngine

    try:
        engine = AsyncEngine(startup.model, **startup.engine_kwargs)
    except Exception as error:
        send_blocking(sock, ReplicaFailed(portable_error(error), traceback.format_exc()))
        return None
    send_blocking(sock, ReplicaReady(engine.engine.config.model, engine.sampling_defaults, engine.kv_cache_info,
                                     engine.get_stats()))
    return engine


async def run(engine, sock: socket.socket) -> int:
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        return await ReplicaServer(engine, reader, writer).serve()
    finally:
        writer.close()


def main() -> None:
    from shardserve.runtime.worker_process import watch_parent

    # Ctrl-C, and a SIGTERM to the whole process group (systemd's stop), belong to the server, which drains
    # and then stops us (a stop that cannot wait escalates to SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    fd, parent_pid = (int(arg) for arg in sys.argv[1:3])
    watch_parent(parent_pid)
    sock = socket.socket(fileno=fd)
    try:
        startup = recv_blocking(sock)
    except EOFError:
        return  # the server went away before we started
    assert isinstance(startup, ReplicaStartup)  # the server's first message
    logger.info("replica %d (pid %d) starting", startup.index, os.getpid())
    engine = build_engine(sock, startup)
    if engine is None:
        sys.exit(1)
    sys.exit(asyncio.run(run(engine, sock)))


if __name__ == "__main__":
    main()
