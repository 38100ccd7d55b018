"""A trace replayed through the engine's own scheduler and block manager, each step timed by the planner's operator
model instead of run on a GPU: what `plan --trace` predicts, down to the scheduling decisions `launch` makes
(admission, chunked prefill, preemption, the prefix cache). Torch-free.

Each request is a prompt of its input_len tokens (the first prefix_len of them those of its prefix_id, so the prefix
cache finds what the requests share) that generates output_len tokens. A step's time is the replica's cycle for
its decoding requests (over their mean context) and prefill chunks. With several replicas, a request with a prefix
goes to the replica its prefix_id hashes to (the server's cache-aware router keeps a shared prefix on one replica),
the others in turn; each replica runs on its own clock."""

from __future__ import annotations

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
OUTPUT_TOKEN = 1  # every generated token (requests ignore EOS: they stop at output_len)


@dataclass
class Served:
    """One request's times on the replay's clock, in seconds."""

    arrival_s: float
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


def replay(requests: tuple[TraceRequest, ...], replica: Replica, shape: EngineShape) -> list[Served]:
    """Every request's times, in the order given, each replica's requests replayed on its own clock."""
    share: list[list[int]] = [[] for _ in range(shape.num_replicas)]
    for index, request in enumerate(requests):
        where = zlib.crc32(request.prefix_id.encode()) if request.prefix_id else index
        share[where % shape.num_replicas].append(index)
    served: list[Served | None] = [None] * len(requests)
    for indices in share:
        for index, result in zip(indices, _replay_one([requests[i] for i in indices], indices, replica, shape)):
            served[index] = result
    return [s for s in served if s is not None]


def _replay_one(requests: list[TraceRequest], ids: list[int], replica: Replica, shape: EngineShape) -> list[Served]:
    pool = BlockManager(shape.num_blocks, shape.block_size, shape.enable_prefix_caching)
    scheduler = Scheduler(shape.scheduler, pool, shape.max_model_len)
    served = {str(i): Served(r.arrival_s) for i, r in zip(ids, requests)}
    arrivals, clock, next_arrival = sorted(zip(ids, requests), key=lambda p: p[1].arrival_s), 0.0, 0
    while next_arrival < len(arrivals) or scheduler.has_unfinished_requests:
        while next_arrival < len(arrivals) and arrivals[next_arrival][1].arrival_s <= clock:
            scheduler.add_request(_engine_request(*arrivals[next_arrival]))
            next_arrival += 1
        if not scheduler.has_unfinished_requests:
            clock = arrivals[next_arrival][1].arrival_s
            continue
        output = scheduler.schedule()
        if not output.num_scheduled_tokens:
            raise RuntimeError("the replay's scheduler scheduled nothing with requests unfinished")
        clock += _step_ms(scheduler, output.num_scheduled_tokens, replica) / 1000
        sampled = {rid: OUTPUT_TOKEN for rid in output.num_scheduled_tokens
                   if scheduler.requests[rid].num_pending_tokens > 0}
        for update in scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids=sampled)):
            if update.new_token_ids:
                served[update.request_id].token_times.append(clock)
    return [served[str(i)] for i in ids]


def _engine_request(index: int, request: TraceRequest) -> Request:
    """input_len tokens: the prefix's (one token per prefix id, repeated) then this request's own."""
    shared = [1 + zlib.crc32(request.prefix_id.encode()) % (1 << 30)] * request.prefix_len if request.prefix_id else []
    own = [-(index + 1)] * (request.input_len - len(shared))
    params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
    return Request(str(index), shared + own, params, seed=0)


def _step_ms(scheduler: Scheduler, scheduled: dict[str, int], replica: Replica) -> float:
    """The replica's cycle for this step: its decoding requests and its prefill chunks."""
    decoding, chunks = [], []
    for request_id, num_new in scheduled.items():
        request = scheduler.requests[request_id]
        if request.num_computed_tokens - num_new >= request.num_prompt_tokens:  # past its prompt: one token
            decoding.append(request.num_computed_tokens)
        else:
            chunks.append(Chunk(num_new, request.num_computed_tokens))
    context = 0 if not decoding else -(-sum(decoding) // len(decoding) // CONTEXT_STEP) * CONTEXT_STEP
    return replica.cycle_ms(len(decoding), tuple(chunks), context)
