"""Engine replicas behind one server: routing (launch/server/prefix_router.py), liveness (a dead replica's
prompts fail, the others serve on while it is restarted) and per-prompt metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING

from shardserve.launch.server.engine_client import EngineClient
from shardserve.launch.server.fair_share import FairShare
from shardserve.launch.server.metrics import PromptTimer, ServerMetrics
from shardserve.launch.server.plan_check import FinishedRequest, PlanCheck
from shardserve.launch.server.prefix_router import CACHE_AWARE, PrefixRouter, Route
from shardserve.launch.openai_api.protocol import shutting_down
from shardserve.launch.server.api_error import APIError
from shardserve.runtime.input_processor import ProcessedPrompt
from shardserve.runtime.lora_request import LoRARequest
from shardserve.runtime.outputs import EmbeddingRequestOutput, PromptDelta, embedding_output
from shardserve.runtime.pooling_params import PoolingParams
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.core.client import OPENED, opened
from shardserve.runtime.core.structured_output import prepare_checks

if TYPE_CHECKING:
    from shardserve.runtime.core.engine import EngineStats
    from shardserve.launch.server.trace_recorder import TraceRecorder


_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.\-]+){2,}/?")
logger = logging.getLogger("shardserve.launch")
DEAD_LOAD = sys.maxsize  # a dead replica's load, as the router sees it: never chosen while another lives
RESTART_FIRST_SECONDS, RESTART_MAX_SECONDS = 1.0, 60.0  # a dead replica's restarts back off, doubling


def public_message(text: str) -> str:
    """An internal error as a client may read it: the first line, paths and tracebacks removed
    (the full text goes to the server log)."""
    first = text.strip().splitlines()[0] if text.strip() else "internal error"
    if "Traceback" in first or 'File "' in first:
        first = first.split("Traceback")[0].split('File "')[0].rstrip(" :(") or "internal error"
    return _PATH.sub("<path>", first)[:300] + "; the server log has the details"


class Replica:
    """engine: the replica's EngineClient (an EngineCoreClient: the replica's core runs in a process of its own)."""

    def __init__(self, index: int, engine: EngineClient):
        self.index, self.engine = index, engine
        self.num_active = 0  # prompts this server has given the replica and not seen end
        self.num_seqs = 0  # their sequences (n each)

    @property
    def error(self) -> BaseException | None:
        return self.engine.error  # set once the engine's step loop has died


class ReplicaSet:
    def __init__(self, engines: Sequence[EngineClient], metrics: ServerMetrics | None = None,
                 plan_check: PlanCheck | None = None, routing_policy: str = CACHE_AWARE,
                 restart: Callable[[int], EngineClient] | None = None, fair_share: FairShare | None = None,
                 max_num_seqs: int | None = None):
        """restart(index): a new engine for replica `index`, started and ready (blocking; run in a thread).
        With it and more than one replica, a replica that dies is restarted while the others serve;
        without it (or with one replica), its death is the server's."""
        self.replicas = [Replica(i, e) for i, e in enumerate(engines)]
        self.fair_share = fair_share  # the engines' sequences shared between clients; None: first come first served
        self.max_num_seqs = max_num_seqs  # each replica's; a replica holding as many is full (None: never)
        self.restart = restart if len(engines) > 1 else None
        self._restarts: dict[int, asyncio.Task] = {}
        kv = self.replicas[0].engine.info.kv_cache_info  # every replica has the same layout, so the same pool
        self.router = PrefixRouter(len(self.replicas), kv.block_size, kv.num_blocks, routing_policy)
        self.metrics = metrics
        self.plan_check = plan_check  # fed each finished prompt's times (with metrics)
        self.recorder: TraceRecorder | None = None  # --record-trace's: each served prompt's line
        self.prompts: dict[str, Replica] = {}  # prompt id -> its replica, while its deltas flow
        self.is_stopping = False  # shutting down: running prompts are aborted, new ones refused
        # the server's one input processor, with the process's one tokenizer: every prompt is processed here,
        # once, and every replica (they serve the same model) takes it as it is
        info = self.replicas[0].engine.info
        self.input_processor = info.input_processor(self.replicas[0].engine.tokenizer)
        prepare_checks()  # (grammars are checked here, compiled in the replicas)

    @property
    def sampling_defaults(self) -> dict:
        """The model's generation_config.json sampling fields (every replica serves the same model)."""
        return self.replicas[0].engine.info.sampling_defaults

    @property
    def max_model_len(self) -> int:
        return self.input_processor.max_model_len

    def stats(self) -> list[EngineStats]:
        return [r.engine.get_stats() for r in self.replicas]

    def dead_reason(self) -> str | None:
        """Why serving stopped (every replica is dead, or one that is not restarted), in full for the log;
        None while a replica serves."""
        down = self.down()
        if down and (self.restart is None or len(down) == len(self.replicas)):
            return "; ".join(f"replica {index}: {reason}" for index, reason in down.items())
        return None

    def down(self) -> dict[int, str]:
        """The dead replicas (restarting, where they are restarted) and why each died."""
        return {r.index: f"{type(r.error).__name__}: {r.error}" for r in self.replicas if r.error is not None}

    def restart_dead(self) -> None:
        """Start restarting each dead replica that is not being restarted yet (the server's watchdog, twice a
        second); one back gives its sequences to the clients waiting for room."""
        self._share_live()
        for r in self.replicas:
            if self.restart is not None and r.error is not None and r.index not in self._restarts:
                logger.error("replica %d died (%s: %s); its requests failed, the others serve on; restarting it",
                             r.index, type(r.error).__name__, r.error)
                self._restarts[r.index] = asyncio.get_running_loop().create_task(self._restarted(r))

    def _share_live(self) -> None:
        """The fair share counts the live replicas' sequences only: with one dead, a client's fan-out sized for
        all of them would fill the others, and another's request wait behind it."""
        if self.fair_share is not None and self.max_num_seqs is not None:
            capacity = self.max_num_seqs * max(1, sum(r.error is None for r in self.replicas))
            if self.fair_share.capacity != capacity:
                self.fair_share.resize(capacity)

    async def _restarted(self, replica: Replica) -> None:
        assert self.restart is not None  # (restart_dead's condition)
        delay = RESTART_FIRST_SECONDS
        try:
            while not self.is_stopping:
                await asyncio.sleep(delay)
                try:
                    engine = await asyncio.to_thread(self.restart, replica.index)
                except Exception as error:  # noqa: BLE001 - logged, tried again later
                    delay = min(2 * delay, RESTART_MAX_SECONDS)
                    logger.error("replica %d could not restart (%s: %s); next try in %g s", replica.index,
                                 type(error).__name__, error, delay)
                    continue
                old, replica.engine = replica.engine, engine
                self.router.forget(replica.index)
                engine.start()
                await old.shutdown()
                logger.info("replica %d is back", replica.index)
                return
        finally:
            del self._restarts[replica.index]

    def public_dead_reason(self) -> str | None:
        """dead_reason as a client may read it: its first line, no traceback, no file path."""
        reason = self.dead_reason()
        return None if reason is None else public_message(reason)

    def loads(self) -> list[int]:
        """Each replica's prompts in flight (a dead one's: DEAD_LOAD); a 503 when none is alive."""
        loads = [r.num_active if r.error is None else DEAD_LOAD for r in self.replicas]
        if min(loads) == DEAD_LOAD:
            raise APIError(503, "no replica is running (they are restarting)", error_type="service_unavailable")
        return loads

    def pick(self) -> Replica:
        loads = self.loads()
        return min(self.replicas, key=lambda r: (loads[r.index], r.index))

    def route(self, prompt: ProcessedPrompt, session: str | None, lora: LoRARequest | None = None, n: int = 1) -> Route:
        """The replica for a prompt of n sequences (the router's choice among the live ones with room for them,
        counted), which now holds its blocks (an adapter's apart from the base model's)."""
        limit = self.max_num_seqs
        full = [r.error is not None or (limit is not None and r.num_seqs + n > limit) for r in self.replicas]
        route = self.router.choose(self.loads(), prompt.prompt_token_ids, session,
                                   None if lora is None else lora.lora_int_id, full)
        self.router.record(route, prompt.prompt_token_ids, session)
        if self.metrics is not None:
            self.metrics.routed.labels(self.metrics.model, str(route.index), route.reason).inc()
        return route

    async def open(self, prompt: ProcessedPrompt, params: SamplingParams, prompt_id: str, session: str | None = None,
                   lora: LoRARequest | None = None, compile_timeout: float | None = None,
                   client: str | None = None) -> AsyncGenerator[PromptDelta]:
        """The prompt handed to the replica the router chose (`session`: the conversation's key), once that
        replica has it (a grammar compiled: its failure raises here) and, with a fair share, once `client`
        may hold its sequences (a 503 if it waits too long); the returned iterator yields its deltas, timed
        for metrics. A prompt that stop() ended raises a 503."""
        return await opened(self._stream(prompt, params, prompt_id, session, lora, compile_timeout, client))

    async def _stream(self, prompt: ProcessedPrompt, params: SamplingParams, prompt_id: str, session: str | None,
                      lora: LoRARequest | None, compile_timeout: float | None, client: str | None) -> AsyncGenerator:
        share = self.fair_share
        self._share_live()  # (a replica that died a moment ago)
        async with share.holding(client, params.n) if share and client else contextlib.AsyncExitStack():
            async for item in self._routed(prompt, params, prompt_id, session, lora, compile_timeout):
                yield item

    async def _routed(self, prompt: ProcessedPrompt, params: SamplingParams, prompt_id: str, session: str | None,
                      lora: LoRARequest | None, compile_timeout: float | None) -> AsyncGenerator:
        if self.is_stopping:
            raise shutting_down()
        route = self.route(prompt, session, lora, params.n)
        replica = self.replicas[route.index]
        replica.num_active += 1
        replica.num_seqs += params.n
        self.prompts[prompt_id] = replica
        timer = self.metrics.prompt_timer(replica.index, prompt.num_prompt_tokens, params) if self.metrics else None
        arrival = self.recorder.arrived() if self.recorder else 0.0
        is_finished, is_opened, num_cached, spec_counts = False, False, None, None
        output: list[int] = []  # the first sample's tokens: cached after the prompt's
        try:
            deltas = await replica.engine.open(prompt, params, prompt_id, lora, compile_timeout)
            is_opened = True
            yield OPENED
            try:
                async for delta in deltas:
                    is_finished = delta.finished
                    for sample in delta.samples:
                        if sample.sample_index == 0:
                            output.extend(sample.new_token_ids)
                            num_cached = num_cached if sample.num_cached_tokens is None else sample.num_cached_tokens
                            spec_counts = sample.spec_counts or spec_counts
                    if timer is not None:
                        timer.delta(delta)
                    yield delta
            finally:
                await deltas.aclose()
            if not is_finished and self.is_stopping:
                raise shutting_down()
            if self.router.is_active:
                self.router.record(route, [*prompt.prompt_token_ids, *output])
            if timer is not None:
                self._finished(timer)
            if self.recorder is not None and is_finished:
                self.recorder.served(arrival, prompt.prompt_token_ids, len(output), num_cached, spec_counts)
        finally:
            if timer is not None and is_opened and not is_finished:  # aborted: its client left, or a drain
                timer.aborted()
            self.prompts.pop(prompt_id, None)
            replica.num_active -= 1
            replica.num_seqs -= params.n

    async def embed(self, prompt: ProcessedPrompt, params: PoolingParams, prompt_id: str) -> EmbeddingRequestOutput:
        """The prompt's pooled vector from the least-loaded replica (whose runner is pooling), counted for
        metrics. A prompt that stop() ended raises a 503."""
        if self.is_stopping:
            raise shutting_down()
        replica = self.pick()
        replica.num_active += 1
        self.prompts[prompt_id] = replica
        start, last = time.monotonic(), None
        try:
            deltas = await replica.engine.open(prompt, params, prompt_id)
            try:
                async for delta in deltas:
                    last = delta
            finally:
                await deltas.aclose()
        finally:
            self.prompts.pop(prompt_id, None)
            replica.num_active -= 1
        if last is None or not last.finished:  # its stream was ended: an abort by stop()
            raise shutting_down()
        if self.metrics is not None:
            self.metrics.pooled(replica.index, prompt.num_prompt_tokens, time.monotonic() - start)
        return embedding_output(prompt_id, prompt, last)

    def _finished(self, timer: PromptTimer) -> None:
        """A finished prompt's metrics, and the plan check's record."""
        ttft, tpot, e2e, num_output_tokens = timer.finish()
        if self.plan_check is not None and num_output_tokens >= 1:
            self.plan_check.record(FinishedRequest(ttft, tpot, e2e, timer.num_prompt_tokens,
                                                   round(num_output_tokens)))

    def start(self) -> None:
        """Every engine watches its ranks from now on, busy or not."""
        for r in self.replicas:
            r.engine.start()

    async def stop(self) -> int:
        """The drain is over: abort every prompt still running (each one's API request ends with a 503 or
        an error event) and refuse new ones; how many were aborted."""
        self.is_stopping = True
        running = list(self.prompts.items())
        await asyncio.gather(*(replica.engine.abort(prompt_id) for prompt_id, replica in running),
                             return_exceptions=True)  # a dead engine has nothing left to abort
        return len(running)

    async def shutdown(self) -> None:
        for task in self._restarts.values():
            task.cancel()
        for r in self.replicas:
            await r.engine.shutdown()
