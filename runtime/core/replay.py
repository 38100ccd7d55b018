"""A trace replayed through the engine's own scheduler and block manager, each step timed by the planner's operator
model instead of run on a GPU: what `plan --trace` predicts, down to the scheduling decisions `launch` makes
(admission, chunked prefill, preemption, the prefix cache). Torch-free.

Each request is a prompt of its input_len tokens (the first prefix_len of them those of its prefix_id, so the prefix
cache finds what the requests share) that generates output_len tokens. A step's time is the replica's cycle for
its decoding requests (over their mean context), their drafts and prefill chunks. With speculative decoding the
scheduler drafts as the engine's does, by prompt lookup, and each draft is kept at the plan's draft_acceptance_rate
(seeded: the same replay every run). With several replicas, a request with a prefix
goes to the replica its prefix_id hashes to (the server's cache-aware router keeps a shared prefix on one replica),
the others in turn; each replica runs on its own clock.

The requests are sent as they arrived (an open loop), or with `concurrency` N as vLLM's `bench serve
--max-concurrency N` sends a list of them: N at once, then the next each time one finishes (a closed loop; the
arrival times are not read, and a request's times count from when it is sent)."""

from __future__ import annotations

import heapq
import random
import zlib
from dataclasses import dataclass, field

from shardserve.planner.operators import Chunk
from shardserve.planner.serving import Replica
from shardserve.planner.trace import TraceRequest
from shardserve.runtime.core.block_manager import BlockManager
from shardserve.runtime.core.messages import ModelRunnerOutput
from shardserve.runtime.core.request import Request
from shardserve.runtime.core.scheduler import Scheduler
from shardserve.runtime.core.scheduler_config import SchedulerConfig
from shardserve.runtime.sampling_params import SamplingParams

CONTEXT_STEP = 64  # decode contexts are rounded up to this, so steps of like batches share one timing


@dataclass
class Served:
    """One request's times on the replay's clock, in seconds."""

    arrival_s: float  # when it reached the server (a closed loop: when it was sent)
    token_times: list[float] = field(default_factory=list)  # when each output token came out

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.token_times[-1] - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (tokens - 1), as vLLM's benchmarks count it; None for one token."""
        n = len(self.token_times)
        return None if n < 2 else (self.token_times[-1] - self.token_times[0]) / (n - 1)


@dataclass(frozen=True)
class EngineShape:
    """What the replay's engines are: each replica's scheduler settings and KV pool."""

    scheduler: SchedulerConfig
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    max_model_len: int
    num_replicas: int = 1
    windows: tuple[int | None, ...] = (None,)  # each KV group's window (planner/kv_groups.py), as the engine's
    draft_acceptance_rate: float = 0.0  # speculative decoding: the chance each draft is kept once those before were


def replay(requests: tuple[TraceRequest, ...], replica: Replica, shape: EngineShape,
           concurrency: int | None = None) -> list[Served]:
    """Every request's times, in the order given: sent at their arrivals, or (`concurrency` N) N in flight."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"a closed loop of {concurrency} requests in flight: at least 1")
    engines = [_Engine(shape, replica) for _ in range(shape.num_replicas)]
    served: list[Served | None] = [None] * len(requests)

    def send(index: int, at: float) -> None:
        request = requests[index]
        where = zlib.crc32(request.prefix_id.encode()) if request.prefix_id else index
        served[index] = engines[where % len(engines)].send(index, request, at)

    if concurrency is None:
        for index, request in enumerate(requests):
            send(index, request.arrival_s)
    else:
        for index in range(min(concurrency, len(requests))):
            send(index, 0.0)
    unsent = len(requests) if concurrency is None else min(concurrency, len(requests))
    # NOTE: the engine furthest behind steps first, so a closed loop's next request is sent at the time the one
    # before it finished, whichever replica ran it; an open loop's replicas never meet, and step as they would alone.
    while busy := [e for e in engines if e.is_busy]:
        engine = min(busy, key=lambda e: e.next_event_s)
        for _ in range(engine.step()):
            if unsent < len(requests):
                send(unsent, engine.clock)
                unsent += 1
    return [s for s in served if s is not None]


class _Engine:
    """One replica: its scheduler and KV pool on a clock of its own, and the requests sent to it not yet arrived."""

    def __init__(self, shape: EngineShape, replica: Replica):
        pool = BlockManager(shape.num_blocks, shape.block_size, shape.enable_prefix_caching, shape.windows)
        self.scheduler, self.replica = Scheduler(shape.scheduler, pool, shape.max_model_len), replica
        self.acceptance, self.draws = shape.draft_acceptance_rate, random.Random(0)  # (the same replay every run)
        spec = shape.scheduler.speculative  # generated tokens cycle with period k + 1: prompt lookup then drafts k
        self.period = 1 + (spec.num_speculative_tokens if spec else 0)  # a step (steps without a match: in the rate)
        self.clock = 0.0
        self.arriving: list[tuple[float, int, TraceRequest]] = []  # a heap by arrival
        self.served: dict[str, Served] = {}

    def send(self, index: int, request: TraceRequest, at: float) -> Served:
        heapq.heappush(self.arriving, (at, index, request))
        self.served[str(index)] = Served(at)
        return self.served[str(index)]

    @property
    def is_busy(self) -> bool:
        return bool(self.arriving) or self.scheduler.has_unfinished_requests

    @property
    def next_event_s(self) -> float:
        """When this engine next steps: now, or (idle) when its next request arrives."""
        return self.clock if self.scheduler.has_unfinished_requests else max(self.clock, self.arriving[0][0])

    def step(self) -> int:
        """Admit what has arrived, run one step; how many requests it finished."""
        self.clock = self.next_event_s
        scheduler = self.scheduler
        while self.arriving and self.arriving[0][0] <= self.clock:
            _, index, request = heapq.heappop(self.arriving)
            scheduler.add_request(_engine_request(index, request))
        output = scheduler.schedule()
        if not output.num_scheduled_tokens:
            raise RuntimeError("the replay's scheduler scheduled nothing with requests unfinished")
        self.clock += _step_ms(scheduler, output.num_scheduled_tokens, self.replica) / 1000
        accepted = {rid: drafts[:self._num_accepted(len(drafts))] for rid, drafts in output.spec_token_ids.items()}
        sampled = {rid: self._output_token(scheduler.requests[rid].num_output_tokens + len(accepted.get(rid, ())))
                   for rid in output.num_scheduled_tokens if scheduler.requests[rid].num_pending_tokens > 0}
        finished = 0
        for update in scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids=sampled,
                                                                             accepted_drafts=accepted)):
            self.served[update.request_id].token_times += [self.clock] * len(update.new_token_ids)
            finished += update.finish_reason is not None
        return finished

    def _output_token(self, index: int) -> int:
        """The request's generated token at `index` (requests ignore EOS: they stop at output_len)."""
        return 1 + index % self.period

    def _num_accepted(self, num_drafts: int) -> int:
        """The drafts the model keeps: each with the acceptance rate, up to the first it does not."""
        num = 0
        while num < num_drafts and self.draws.random() < self.acceptance:
            num += 1
        return num


def _engine_request(index: int, request: TraceRequest) -> Request:
    """input_len tokens: the prefix's (one token per prefix id, repeated) then this request's own."""
    shared = [1 + zlib.crc32(request.prefix_id.encode()) % (1 << 30)] * request.prefix_len if request.prefix_id else []
    own = [-(index + 1)] * (request.input_len - len(shared))
    params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
    return Request(str(index), shared + own, params, seed=0)


def _step_ms(scheduler: Scheduler, scheduled: dict[str, int], replica: Replica) -> float:
    """The replica's cycle for this step: its decoding requests and its prefill chunks."""
    decoding, chunks, drafts = [], [], 0
    for request_id, num_new in scheduled.items():
        request = scheduler.requests[request_id]
        if request.num_computed_tokens - num_new >= request.num_prompt_tokens:  # past its prompt: one token
            decoding.append(request.num_computed_tokens)  # (and its drafts, verified beside it)
            drafts += num_new - 1
        else:
            chunks.append(Chunk(num_new, request.num_computed_tokens))
    context = 0 if not decoding else -(-sum(decoding) // len(decoding) // CONTEXT_STEP) * CONTEXT_STEP
    return replica.cycle_ms(len(decoding), tuple(chunks), context, drafts)
