"""Engine replicas behind one server: least-loaded routing, liveness and per-request metrics."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import AsyncIterator

from shardserve.launch.metrics import ServerMetrics
from shardserve.runtime.outputs import RequestOutput
from shardserve.runtime.sampling_params import SamplingParams


class Replica:
    def __init__(self, index: int, engine):
        self.index, self.engine = index, engine
        self.num_active = 0  # requests this server has given the replica and not seen end

    def stats(self) -> dict:
        return dataclasses.asdict(self.engine.engine.get_stats())

    @property
    def error(self) -> BaseException | None:
        return self.engine.error  # set once the engine's step loop has died


class ReplicaSet:
    def __init__(self, engines: list, metrics: ServerMetrics | None = None):
        self.replicas = [Replica(i, e) for i, e in enumerate(engines)]
        self.metrics = metrics

    @functools.cached_property
    def tokenizer(self):
        """The server's own tokenizer: fast tokenizers are not safe to share with the engine's
        step thread, which detokenizes while the event loop tokenizes new prompts."""
        engine = self.replicas[0].engine.engine
        if engine.tokenizer is None:
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(engine.config.model.model)

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].engine.engine.config.model.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].engine.engine.config.model.vocab_size

    def stats(self) -> list[dict]:
        return [r.stats() for r in self.replicas]

    def dead_reason(self) -> str | None:
        """Why serving stopped (a rank or the engine loop died), or None while all is well."""
        for r in self.replicas:
            if r.error is not None:
                return f"replica {r.index}: {type(r.error).__name__}: {r.error}"
        return None

    def pick(self) -> Replica:
        return min(self.replicas, key=lambda r: (r.num_active, r.index))

    async def generate(self, prompt: dict, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """The request's cumulative outputs from the least-loaded replica, timed for metrics."""
        replica = self.pick()
        replica.num_active += 1
        labels = (self.metrics.model, str(replica.index)) if self.metrics else None
        start = last = time.monotonic()
        num_tokens = 0
        try:
            async for output in replica.engine.generate(prompt, params, request_id):
                now = time.monotonic()
                produced = sum(len(c.token_ids) for c in output.outputs)
                if labels and produced > num_tokens:
                    first = num_tokens == 0
                    (self.metrics.ttft if first else self.metrics.itl).labels(*labels).observe(
                        now - (start if first else last))
                    self.metrics.generation_tokens.labels(*labels).inc(produced - num_tokens)
                    num_tokens, last = produced, now
                yield output
            if labels:
                self.metrics.prompt_tokens.labels(*labels).inc(len(prompt["prompt_token_ids"]))
                self.metrics.e2e.labels(*labels).observe(time.monotonic() - start)
        finally:
            replica.num_active -= 1

    def start(self) -> None:
        """Every engine watches its ranks from now on, busy or not."""
        for r in self.replicas:
            r.engine.start()

    async def shutdown(self) -> None:
        for r in self.replicas:
            await r.engine.shutdown()
