"""The synchronous engine: a step is schedule, execute, update; everything else hangs off that."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from shardserve.runtime.block_manager import BlockManager
from shardserve.runtime.config import EngineConfig
from shardserve.runtime.errors import EngineDeadError
from shardserve.runtime.executor import make_executor
from shardserve.runtime.kv_sizing import size_kv_cache
from shardserve.runtime.messages import ModelRunnerOutput, SchedulerOutput
from shardserve.runtime.output_processor import OutputProcessor
from shardserve.runtime.outputs import RequestOutput
from shardserve.runtime.request import Request, RequestStatus
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.scheduler import Scheduler
from shardserve.runtime.tokenizer import eos_token_ids, load_tokenizer


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for metrics endpoints and logs."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests (cached-but-free blocks count as free)
    num_preemptions: int  # since start
    num_prefix_hit_tokens: int  # since start


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self.executor = make_executor(config)
        self.kv_cache_info = size_kv_cache(config, self.executor)
        self.executor.initialize_kv_cache(self.kv_cache_info.num_blocks)
        self.block_manager = BlockManager(self.kv_cache_info.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, config.model.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._seeds = random.Random(config.seed)  # seeds for requests that bring none
        self.in_flight: deque[SchedulerOutput] = deque()  # submitted batches, oldest first

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine was started with skip_tokenizer_init=True; "
                             "give prompts as {'prompt_token_ids': [...]}")
        return self.tokenizer(prompt).input_ids

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        """Queue a request; n > 1 becomes n scheduler requests that share the prompt's cached blocks."""
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids with skip_tokenizer_init=True")
        vocab = self.config.model.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"request {request_id!r}: prompt token ids must lie in [0, {vocab})")
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        sample_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        requests = [Request(sample_id, prompt_token_ids, params, base_seed + i, self.eos_token_ids)
                    for i, sample_id in enumerate(sample_ids)]
        for request in requests:
            self.scheduler.check_can_ever_fit(request)
        for request in requests:
            self.scheduler.add_request(request)
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, sample_ids)

    def abort_request(self, request_id: str) -> None:
        """Free everything the request holds, wherever it is."""
        self.scheduler.finish_requests(self.output_processor.sample_ids(request_id), RequestStatus.FINISHED_ABORTED)
        self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests or bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update. With pipeline stages, up to max_concurrent_batches batches are
        submitted before the oldest is collected, so no stage idles while another computes."""
        if self.executor.is_dead:
            raise EngineDeadError("the engine's workers have stopped; start a new engine")
        if self.executor.max_concurrent_batches == 1:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty and self.scheduler.has_unfinished_requests:
                raise RuntimeError("the scheduler could not run any request; this is a bug")
            return self._update(scheduler_output, self.executor.execute_model(scheduler_output))
        num_batches = self.executor.max_concurrent_batches
        share = -(-self.scheduler.num_unfinished_requests // num_batches)  # requests per batch, rounded up
        while len(self.in_flight) < num_batches:
            scheduler_output = self.scheduler.schedule(max_num_requests=max(share, 1))
            if scheduler_output.is_empty and not scheduler_output.finished_request_ids:
                break  # (an empty batch still goes out alone to tell the workers what finished)
            self.executor.submit_batch(scheduler_output)
            self.in_flight.append(scheduler_output)
        if not self.in_flight:
            if self.scheduler.has_unfinished_requests:
                raise RuntimeError("the scheduler could not run any request; this is a bug")
            return []
        scheduler_output = self.in_flight.popleft()
        return self._update(scheduler_output, self.executor.collect_batch())

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped = self.output_processor.process(updates)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def get_stats(self) -> EngineStats:
        scheduler, pool = self.scheduler, self.block_manager
        return EngineStats(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                           kv_cache_usage=1.0 - pool.num_free_blocks / pool.num_blocks,
                           num_preemptions=scheduler.num_preemptions,
                           num_prefix_hit_tokens=scheduler.num_prefix_hit_tokens)

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker rank has died; call it between steps."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()
