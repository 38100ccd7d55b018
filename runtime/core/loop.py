"""The engine core's loop, and the main of a core's own process (`python -m shardserve.runtime.core.loop FD
PID`, what each replica of a server runs).

A plain loop, no asyncio: take what arrived on the socket (add, abort, stop), step, send the step's token
updates as one StepUpdates, until StopCore, the socket closing or the engine dying (EngineFailed). In a process of
its own, a CoreStartup arrives first; the core builds its engine (and with it its ranks, started as
children of this process) and answers CoreReady; the process also ends when its parent disappears."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

from shardserve.runtime.core.protocol import (AbortPrompt, AddPrompt, Alive, CoreReady, CoreStartFailed, CoreStartup,
                                              EngineFailed, PromptAdded, PromptFailed, StatsMessage, StepUpdates,
                                              StopCore, StopRequests, portable_error)
from shardserve.runtime.distributed.child_process import FrameReader, child_main, send_blocking

if TYPE_CHECKING:
    from shardserve.runtime.core.structured_output import GrammarCompile

logger = logging.getLogger("shardserve.runtime.core")

STATS_SECONDS = 0.5  # stats for /metrics (a sign of life) this often and when the engine turns idle; its idle health as often
COMPILE_POLL_SECONDS = 0.005  # how often an idle loop looks at the grammars being compiled
HEARTBEAT_SECONDS = 1.0  # an Alive this often, from a thread beside the loop


class CoreLoop:
    """An engine, driven by its client's messages between its steps. NOTE: a prompt under a
    grammar waits here, out of the engine, until its grammar is compiled in a worker thread (xgrammar
    releases the GIL), so no step waits on a compile; then the client hears PromptAdded, or PromptFailed
    if it failed or took longer than the prompt's compile_timeout. Grammars compile only here: the
    server's process never compiles one."""

    def __init__(self, engine, sock: socket.socket):
        self.engine, self.sock = engine, sock
        self.inbox = FrameReader(sock)
        self.compiling: dict[str, tuple[AddPrompt, GrammarCompile]] = {}  # prompt id -> its add, its grammar's compile
        self.last_report = 0.0
        self._send_lock = threading.Lock()  # the loop and the heartbeat write whole frames, one at a time
        self._ended = threading.Event()

    def send(self, message: object) -> None:
        with self._send_lock:
            send_blocking(self.sock, message)

    def _heartbeat(self) -> None:
        while not self._ended.wait(HEARTBEAT_SECONDS):
            try:
                self.send(Alive())
            except OSError:
                return  # the client went away

    def serve(self) -> int:
        """Until StopCore or the client goes; 1 if the engine died, else 0."""
        threading.Thread(target=self._heartbeat, name="core-heartbeat", daemon=True).start()
        try:
            return self._serve()
        finally:
            self._ended.set()

    def _serve(self) -> int:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            for message in self.inbox.read(0.0 if busy else self._idle_wait()):
                if isinstance(message, StopCore):
                    return 0
                self._handle(message)
            if self.inbox.closed:
                return 0  # the client went away
            self._add_compiled()
            report = time.monotonic() - self.last_report >= STATS_SECONDS
            try:
                if busy:
                    updates = engine.step()
                    if updates:
                        self.send(StepUpdates(updates))
                    for failed in engine.take_failed_prompts():  # (an adapter its ranks could not read)
                        self.send(failed)
                    report = report or not engine.has_unfinished_requests()  # idle now: say so at once
                elif report:
                    engine.check_health()  # a rank that died while the engine was idle
            except Exception as error:
                logger.error("the engine failed: %s", traceback.format_exc())
                self.send(EngineFailed(f"{type(error).__name__}: {error}"))
                return 1
            if report:
                self.send(StatsMessage(engine.get_stats()))
                self.last_report = time.monotonic()

    def _idle_wait(self) -> float:
        if self.compiling:
            return COMPILE_POLL_SECONDS
        return max(0.0, STATS_SECONDS - (time.monotonic() - self.last_report))

    def _handle(self, message: object) -> None:
        if isinstance(message, AddPrompt):
            outputs = getattr(message.params, "structured_outputs", None)
            if outputs is None:
                self._add(message)
            else:
                from shardserve.runtime.core.structured_output import GrammarCompile
                compile_ = GrammarCompile(self.engine.config.model, self.engine.tokenizer, outputs)
                self.compiling[message.prompt_id] = (message, compile_)
        elif isinstance(message, AbortPrompt):
            pending = self.compiling.pop(message.prompt_id, None)
            if pending is not None:
                pending[1].cancel()
            else:
                self.engine.abort_request(message.prompt_id)
        elif isinstance(message, StopRequests):
            self.engine.stop_requests(message.request_ids)
        else:
            raise TypeError(f"an engine core cannot act on {type(message).__name__}")

    def _add_compiled(self) -> None:
        for prompt_id, (add, compile_) in list(self.compiling.items()):
            if not compile_.is_over(add.compile_timeout):
                continue
            del self.compiling[prompt_id]
            error = compile_.error(add.compile_timeout)
            if error is not None:
                self.send(PromptFailed(prompt_id, portable_error(error)))
            elif self._add(add):
                self.send(PromptAdded(prompt_id))

    def _add(self, add: AddPrompt) -> bool:
        """A prompt the engine refuses (one its pool cannot hold, an id in use) fails alone."""
        try:
            self.engine.add_request(add.prompt_id, add.prompt, add.params, add.lora)
            return True
        except Exception as error:
            self.send(PromptFailed(add.prompt_id, portable_error(error)))
            return False


def serve(engine, sock: socket.socket) -> int:
    """Run the loop, then shut the engine down (its ranks with it); the loop's exit code."""
    from shardserve.runtime.core.structured_output import prepare_compiler

    try:
        prepare_compiler(engine.config.model, engine.tokenizer)
        return CoreLoop(engine, sock).serve()
    finally:
        engine.shutdown()


def build_engine(sock: socket.socket, startup: CoreStartup):
    """The core's engine, announced with CoreReady; None (after CoreStartFailed) if it failed."""
    from shardserve.runtime.core.engine import EngineCore

    try:
        engine = EngineCore(startup.args.create_engine_config())
    except Exception as error:
        send_blocking(sock, CoreStartFailed(portable_error(error), traceback.format_exc()))
        return None
    send_blocking(sock, CoreReady(engine.info()))
    return engine


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    started = child_main()
    if started is None:
        return  # the client went away before we started
    sock, startup = started
    assert isinstance(startup, CoreStartup)  # the client's first message
    logger.info("replica %d (pid %d) starting", startup.index, os.getpid())
    engine = build_engine(sock, startup)
    sys.exit(1 if engine is None else serve(engine, sock))


if __name__ == "__main__":
    main()
