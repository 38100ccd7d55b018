"""The one client of an engine core: a core in a process of its own (each replica a server runs) or on a
thread of this process (AsyncEngine), talked to over a socket either way.

In a process: the client starts `python -m shardserve.runtime.core.loop`, hands it the engine's settings
(EngineArgs) and its devices (a CUDA_VISIBLE_DEVICES slice on GPUs) and waits for its EngineInfo. Then it
sends prompts and makes text of the core's token updates (its OutputProcessor: detokenizing, stop strings,
logprobs' text), a stream per prompt: the one implementation of launch's EngineClient. Prompts come
processed (the server's one InputProcessor, made from the EngineInfo: the engine's own rules), and the core
takes them as they are. The core's death (its engine failing, or its process or thread gone) sets `error`,
as a dead rank does for an engine."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING

from shardserve.runtime.distributed.child_process import (frame, read_message, recv_blocking, send_blocking, start_child,
                                              stop_process)
from shardserve.runtime.config import resolve_device
from shardserve.runtime.core.protocol import (AbortPrompt, AddPrompt, CoreReady, CoreStartFailed, CoreStartup,
                                              EngineFailed, PromptAdded, PromptFailed, StatsMessage, StepUpdates,
                                              StopCore, StopRequests)
from shardserve.runtime.errors import EngineDeadError
from shardserve.runtime.output_processor import OutputProcessor
from shardserve.runtime.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from shardserve.runtime.core.engine import EngineInfo, EngineStats, EngineCore
    from shardserve.runtime.engine_args import EngineArgs

logger = logging.getLogger("shardserve.runtime.core")

CORE_MODULE = "shardserve.runtime.core.loop"
STOP_GRACE_SECONDS = 10.0
SILENCE_SECONDS = 15.0  # a core's heartbeat comes every second, whatever its step does; this long without: hung
_ABORTED = object()  # ends a prompt's stream here
_ADDED = object()  # the core has the prompt (PromptAdded)
OPENED = object()  # the first item of a stream that open() hands back: the core has the prompt


def replica_devices(device: str, num_ranks: int, replica: int, visible: str | None) -> str | None:
    """The CUDA_VISIBLE_DEVICES of replica r: the r-th block of num_ranks GPUs after the first GPU that
    `device` names ('cuda' or 'cuda:N'), counted in the server's own visible list; None off GPUs."""
    if not device.startswith("cuda"):
        return None
    first = int(device.partition(":")[2] or 0)
    ids = visible.split(",") if visible else None
    chosen = range(first + replica * num_ranks, first + (replica + 1) * num_ranks)
    if ids is not None and chosen[-1] >= len(ids):
        raise ValueError(f"replica {replica} needs GPUs {list(chosen)} of CUDA_VISIBLE_DEVICES={visible}")
    return ",".join(ids[i] if ids is not None else str(i) for i in chosen)


class ProcessCore:
    """A core in a process of its own."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.pid = process, process.pid
        self.where = f"process {process.pid}"

    def start(self) -> None:
        pass  # (running since it was made)

    def wait(self) -> int:
        return self.process.wait()

    def is_running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float) -> None:
        stop_process(self.process, grace)


class ThreadCore:
    """A core on a thread of this process, started with its client: no process, the engine built here."""

    def __init__(self, engine: EngineCore, sock: socket.socket):
        self.engine, self.sock, self.pid = engine, sock, os.getpid()
        self.where = "this process"
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, name="engine-core", daemon=True)

    def _run(self) -> None:
        from shardserve.runtime.core.loop import serve

        try:
            self.code = serve(self.engine, self.sock)
        finally:
            self.sock.close()  # the client reads the end

    def start(self) -> None:
        if self.thread.ident is None:
            self.thread.start()

    def wait(self) -> int:
        self.thread.join()
        return 1 if self.code is None else self.code

    def is_running(self) -> bool:
        return self.thread.is_alive()

    def stop(self, grace: float) -> None:
        if self.thread.ident is None:  # never started: the engine is ours to stop
            self.engine.shutdown()
            self.sock.close()
        self.thread.join(grace)


class EngineCoreClient:
    def __init__(self, index: int, core: ProcessCore | ThreadCore, sock: socket.socket):
        self.index, self.core, self.sock = index, core, sock
        self.info: EngineInfo  # what the core said once it was up (wait_ready; a thread's at once)
        self.outputs: OutputProcessor  # the text side (use_tokenizer)
        self._stats: EngineStats
        self._error: BaseException | None = None
        self._last_heard = time.monotonic()
        self._streams: dict[str, asyncio.Queue] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None

    @classmethod
    def in_process(cls, index: int, args: EngineArgs) -> EngineCoreClient:
        """A core in a process of its own, starting; wait_ready() waits for it."""
        env = dict(os.environ)
        device = resolve_device(args.device)  # 'auto' on a GPU machine slices too
        num_ranks = (args.tensor_parallel_size or 1) * (args.pipeline_parallel_size or 1)
        devices = replica_devices(device, num_ranks, index, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if devices is not None:  # the replica's GPUs are its 0..n-1
            env["CUDA_VISIBLE_DEVICES"], args = devices, dataclasses.replace(args, device="cuda")
        process, sock = start_child(CORE_MODULE, CoreStartup(index, args), env)
        client = cls(index, ProcessCore(process), sock)
        weakref.finalize(client, stop_process, process, 0.0)  # dropped without shutdown(): still stopped
        return client

    @classmethod
    def in_thread(cls, engine: EngineCore) -> EngineCoreClient:
        """A core on a thread of this process over an engine built here (AsyncEngine's)."""
        sock, core_end = socket.socketpair()
        client = cls(0, ThreadCore(engine, core_end), sock)
        client._take_info(engine.info())
        client.use_tokenizer(engine.tokenizer)
        return client

    @property
    def pid(self) -> int:
        return self.core.pid

    def wait_ready(self) -> None:
        """Block until the replica's engine is up; its start-up error (or death) is raised here."""
        try:
            message = recv_blocking(self.sock)
        except (EOFError, OSError):
            raise RuntimeError(f"replica {self.index} (pid {self.pid}) exited while starting, "
                               f"code {self.core.wait()}") from None
        if isinstance(message, CoreStartFailed):
            logger.debug("replica %d failed to start:\n%s", self.index, message.traceback)
            raise message.error
        if not isinstance(message, CoreReady):
            raise RuntimeError(f"replica {self.index} answered {type(message).__name__} to its start-up")
        self._take_info(message.info)
        logger.info("replica %d up in process %d", self.index, self.pid)

    def _take_info(self, info: EngineInfo) -> None:
        self.info, self._stats = info, info.stats

    def use_tokenizer(self, tokenizer) -> None:
        """The tokenizer this client makes text with (None: the model skips it, and outputs have no text); one
        per process, shared by its clients."""
        self.outputs = OutputProcessor(tokenizer)

    @property
    def tokenizer(self):
        return self.outputs.tokenizer

    def discard(self) -> None:
        """Stop a core that never served (it failed to start, or another replica did) at once."""
        self.core.stop(0.0)
        self.sock.close()

    @property
    def error(self) -> BaseException | None:
        """Why the replica is dead (its engine failed, its process exited, or it went silent), or None."""
        if self._error is None and self._reader_task is not None and \
                time.monotonic() - self._last_heard > SILENCE_SECONDS:
            self._fail(EngineDeadError(f"replica {self.index} ({self.core.where}) has sent nothing for "
                                       f"{SILENCE_SECONDS:.0f} s"))
        return self._error

    def get_stats(self):
        """The core's latest EngineStats (a StatsMessage comes every core.loop.STATS_SECONDS)."""
        return self._stats

    def start(self) -> None:
        """Relay the core's messages from now on (inside the event loop)."""
        if self._reader_task is None:
            self.core.start()
            self._last_heard = time.monotonic()
            self._connected = asyncio.get_running_loop().create_future()
            self._reader_task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        """NOTE: the one place the socket becomes a stream (two transports on one socket would race)."""
        self._reader, self._writer = await asyncio.open_connection(sock=self.sock)
        self._connected.set_result(None)
        while True:
            try:
                message = await read_message(self._reader)
            except EOFError:
                code = await asyncio.to_thread(self.core.wait)
                self._fail(EngineDeadError(f"replica {self.index}'s engine core ({self.core.where}) exited with "
                                           f"code {code}"))
                return
            self._last_heard = time.monotonic()
            if isinstance(message, StepUpdates):
                deltas, stopped = self.outputs.process(message.updates)
                for delta in deltas:
                    self._put(delta.prompt_id, delta)
                if stopped:  # (the stream opened above)
                    self._writer.write(frame(StopRequests(tuple(stopped))))
            elif isinstance(message, PromptAdded):
                self._put(message.prompt_id, _ADDED)
            elif isinstance(message, PromptFailed):
                self._put(message.prompt_id, message.error)
            elif isinstance(message, StatsMessage):
                self._stats = message.stats
            elif isinstance(message, EngineFailed):
                self._fail(EngineDeadError(f"replica {self.index}: {message.reason}"))

    def _put(self, prompt_id: str, item) -> None:
        stream = self._streams.get(prompt_id)
        if stream is not None:
            stream.put_nowait(item)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        for stream in self._streams.values():
            stream.put_nowait(error)

    async def open(self, prompt, sampling_params, prompt_id: str, lora_request=None,
                   compile_timeout: float | None = None) -> AsyncGenerator:
        """Hand the core a prompt (a ProcessedPrompt: the caller processed it) and return once the core has
        it: at once, or for a prompt under a grammar once its grammar has compiled (within compile_timeout
        seconds), so that a grammar's failure raises here, before any delta. The returned iterator yields
        the prompt's deltas, the last one finished (with PoolingParams, the one delta carrying its vector);
        closing it early aborts the prompt."""
        return await opened(self._stream(prompt, sampling_params, prompt_id, lora_request, compile_timeout))

    async def generate(self, prompt, sampling_params, prompt_id: str, lora_request=None) -> AsyncIterator:
        """open()'s deltas, as one iterator."""
        stream = await self.open(prompt, sampling_params, prompt_id, lora_request)
        try:
            async for delta in stream:
                yield delta
        finally:
            await stream.aclose()

    async def _stream(self, prompt, sampling_params, prompt_id: str, lora_request,
                      compile_timeout: float | None) -> AsyncGenerator:
        """OPENED, then the prompt's deltas."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self.error!r}")
        if prompt_id in self._streams:
            raise ValueError(f"prompt id {prompt_id!r} is already in use")
        self.start()
        await asyncio.shield(self._connected)  # a cancelled prompt must not cancel the connection
        writer = self._writer
        assert writer is not None  # connected
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[prompt_id] = stream
        self.outputs.add_prompt(prompt_id, sampling_params)
        finished = False
        try:
            writer.write(frame(AddPrompt(prompt_id, prompt, sampling_params, lora_request, compile_timeout)))
            if getattr(sampling_params, "structured_outputs", None) is not None:
                item = await stream.get()  # PromptAdded, or why not
                if item is not _ADDED:
                    finished = True
                    if isinstance(item, BaseException):
                        raise item
                    return  # aborted meanwhile
            yield OPENED
            while not finished:
                item = await stream.get()
                if item is _ABORTED:  # abort() has told the core
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(prompt_id, None)
            self.outputs.abort(prompt_id)
            if not finished and self._error is None and not writer.is_closing():
                writer.write(frame(AbortPrompt(prompt_id)))  # the consumer went away

    async def abort(self, prompt_id: str) -> None:
        """End the prompt's stream; the core frees its blocks between two steps."""
        if prompt_id in self._streams and self._writer is not None and not self._writer.is_closing():
            self._writer.write(frame(AbortPrompt(prompt_id)))
        self.outputs.abort(prompt_id)
        self._put(prompt_id, _ABORTED)

    async def shutdown(self) -> None:
        """Ask the core to stop its engine and end; after STOP_GRACE_SECONDS, a process is stopped by
        pid. Its going is expected from here on: it sets no error."""
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None and not self._writer.is_closing():
            try:
                self._writer.write(frame(StopCore()))
                await self._writer.drain()
            except ConnectionError:
                pass
        elif self._writer is None and self.core.is_running():
            try:
                send_blocking(self.sock, StopCore())
            except OSError:
                pass
        await asyncio.to_thread(self.core.stop, STOP_GRACE_SECONDS)
        if self._writer is not None:
            self._writer.close()
        self.sock.close()


async def opened(stream: AsyncGenerator) -> AsyncGenerator:
    """A stream whose first item is OPENED, once that item has come (what came before it raises here; a
    stream aborted before it is handed back ended)."""
    async for first in stream:
        assert first is OPENED, first
        break
    return stream


def start_replica(args: EngineArgs, index: int, tokenizer) -> EngineCoreClient:
    """Replica `index`'s core, started and ready (a restart: the server's tokenizer is its)."""
    client = EngineCoreClient.in_process(index, args)
    try:
        client.wait_ready()
    except BaseException:
        client.discard()
        raise
    client.use_tokenizer(tokenizer)
    return client


def start_replicas(args: EngineArgs, num_replicas: int) -> list[EngineCoreClient]:
    """Every replica's core process at once (they load in parallel), then each one's readiness; if one
    fails, the others are stopped and its error raised."""
    replicas: list[EngineCoreClient] = []
    try:
        for index in range(num_replicas):
            replicas.append(EngineCoreClient.in_process(index, args))
        for replica in replicas:
            replica.wait_ready()
        tokenizer = load_tokenizer(replicas[0].info.model_config)  # one for every replica: the same model
        for replica in replicas:
            replica.use_tokenizer(tokenizer)
    except BaseException:
        for replica in replicas:
            replica.discard()
        raise
    return replicas
