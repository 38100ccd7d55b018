"""Engine replicas behind one server: least-loaded routing, liveness and per-prompt metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncIterator

from shardserve.launch.metrics import ServerMetrics
from shardserve.launch.plan_check import FinishedRequest, PlanCheck
from shardserve.launch.protocol import shutting_down
from shardserve.runtime.input_processor import InputProcessor, ProcessedPrompt
from shardserve.runtime.outputs import PromptDelta
from shardserve.runtime.sampling_params import SamplingParams


_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.\-]+){2,}/?")


def public_message(text: str) -> str:
    """An internal error as a client may read it: the first line, paths and tracebacks removed
    (the full text goes to the server log)."""
    first = text.strip().splitlines()[0] if text.strip() else "internal error"
    if "Traceback" in first or 'File "' in first:
        first = first.split("Traceback")[0].split('File "')[0].rstrip(" :(") or "internal error"
    return _PATH.sub("<path>", first)[:300] + "; the server log has the details"


class Replica:
    """engine: a ReplicaClient (the server's replicas, one or many, each in a process of its own) or an
    AsyncEngine in this process; both answer generate, abort, get_stats, error, start and shutdown alike."""

    def __init__(self, index: int, engine):
        self.index, self.engine = index, engine
        self.num_active = 0  # prompts this server has given the replica and not seen end

    def stats(self) -> dict:
        return dataclasses.asdict(self.engine.get_stats())

    @property
    def error(self) -> BaseException | None:
        return self.engine.error  # set once the engine's step loop has died


class ReplicaSet:
    def __init__(self, engines: list, metrics: ServerMetrics | None = None, plan_check: PlanCheck | None = None):
        self.replicas = [Replica(i, e) for i, e in enumerate(engines)]
        self.metrics = metrics
        self.plan_check = plan_check  # fed each finished prompt's times (with metrics)
        self.prompts: dict[str, Replica] = {}  # prompt id -> its replica, while its deltas flow
        self.is_stopping = False  # shutting down: running prompts are aborted, new ones refused

    @property
    def input_processor(self) -> InputProcessor:
        """Every replica serves the same model, so the first one's processor serves them all."""
        return self.replicas[0].engine.input_processor

    @property
    def sampling_defaults(self) -> dict:
        """The model's generation_config.json sampling fields (every replica serves the same model)."""
        return self.replicas[0].engine.sampling_defaults

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].engine.max_model_len

    def stats(self) -> list[dict]:
        return [r.stats() for r in self.replicas]

    def dead_reason(self) -> str | None:
        """Why serving stopped (a rank or the engine loop died), in full for the log, or None."""
        for r in self.replicas:
            if r.error is not None:
                return f"replica {r.index}: {type(r.error).__name__}: {r.error}"
        return None

    def public_dead_reason(self) -> str | None:
        """dead_reason as a client may read it: its first line, no traceback, no file path."""
        reason = self.dead_reason()
        return None if reason is None else public_message(reason)

    def pick(self) -> Replica:
        return min(self.replicas, key=lambda r: (r.num_active, r.index))

    async def generate(self, prompt: ProcessedPrompt, params: SamplingParams,
                       prompt_id: str) -> AsyncIterator[PromptDelta]:
        """The prompt's deltas from the least-loaded replica, timed for metrics. A prompt that stop()
        ended raises a 503."""
        if self.is_stopping:
            raise shutting_down()
        replica = self.pick()
        replica.num_active += 1
        self.prompts[prompt_id] = replica
        metrics = self.metrics
        labels = (metrics.model, str(replica.index)) if metrics is not None else ("", "")
        start = last = first = time.monotonic()
        num_tokens, is_finished = 0, False
        try:
            async for delta in replica.engine.generate(prompt, params, prompt_id):
                is_finished = delta.finished
                now = time.monotonic()
                num_new = sum(len(sample.new_token_ids) for sample in delta.samples)
                if metrics is not None:
                    self._observe_times(metrics, delta, labels)
                if metrics is not None and num_new:
                    is_first = num_tokens == 0
                    (metrics.ttft if is_first else metrics.itl).labels(*labels).observe(
                        now - (start if is_first else last))
                    metrics.generation_tokens.labels(*labels).inc(num_new)
                    num_tokens, last = num_tokens + num_new, now
                    first = now if is_first else first
                yield delta
            if not is_finished and self.is_stopping:
                raise shutting_down()
            if metrics is not None:
                self._observe_finish(metrics, labels, prompt.num_prompt_tokens, num_tokens / params.n, start, first)
        finally:
            self.prompts.pop(prompt_id, None)
            replica.num_active -= 1

    def _observe_finish(self, metrics: ServerMetrics, labels: tuple[str, str], num_prompt_tokens: int,
                        num_output_tokens: float, start: float, first: float) -> None:
        """A finished prompt: e2e; TPOT = (e2e - TTFT) / (output tokens - 1) with 2 tokens or more
        (output tokens per sample when n > 1); the plan check's record."""
        e2e, ttft = time.monotonic() - start, first - start
        metrics.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        metrics.e2e.labels(*labels).observe(e2e)
        tpot = (e2e - ttft) / (num_output_tokens - 1) if num_output_tokens >= 2 else None
        if tpot is not None:
            metrics.tpot.labels(*labels).observe(tpot)
        if self.plan_check is not None and num_output_tokens >= 1:
            self.plan_check.record(FinishedRequest(ttft, tpot, e2e, num_prompt_tokens, round(num_output_tokens)))

    @staticmethod
    def _observe_times(metrics: ServerMetrics, delta: PromptDelta, labels: tuple[str, str]) -> None:
        for sample in delta.samples:
            if sample.times is not None:
                metrics.queue_time.labels(*labels).observe(sample.times.queue_s)
                metrics.prefill_time.labels(*labels).observe(sample.times.prefill_s)

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
        for r in self.replicas:
            await r.engine.shutdown()
