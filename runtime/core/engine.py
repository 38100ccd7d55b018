"""The engine core: a step is schedule, execute, update, on token ids only (no text, no threads, no asyncio);
everything else hangs off that. Its clients (runtime/llm.py in-process, runtime/core/client.py over a socket)
turn text into prompts and its RequestUpdates back into text."""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from dataclasses import dataclass

from shardserve.planner.lora import AdapterError
from shardserve.runtime.core.block_manager import BlockManager
from shardserve.runtime.config import EngineConfig, KVCacheInfo, ModelConfig
from shardserve.runtime.errors import EngineDeadError
from shardserve.runtime.distributed.backend import make_executor
from shardserve.runtime.generation_config import sampling_defaults
from shardserve.runtime.input_processor import InputProcessor, ProcessedPrompt, PromptType, check_runner
from shardserve.runtime.core.kv_sizing import size_kv_cache, with_measured_len
from shardserve.runtime.lora_request import AdapterChecks, LoRARequest
from shardserve.runtime.core.lora_slots import LoRASlots
from shardserve.runtime.core.messages import ModelRunnerOutput, RequestUpdate, SchedulerOutput
from shardserve.runtime.core.protocol import PromptFailed
from shardserve.runtime.pooling_params import PROMPT_ONLY, PoolingParams
from shardserve.runtime.core.request import Request, RequestStatus, sample_request_ids
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.core.scheduler import Scheduler
from shardserve.runtime.core.step_histogram import HistogramSnapshot, StepHistogram
from shardserve.runtime.core.structured_output import accept_tokens, grammar_bitmask
from shardserve.runtime.core.spec_decode import SpecDecodeStats
from shardserve.runtime.tokenizer import eos_token_ids, load_tokenizer


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for metrics endpoints and logs."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests (cached-but-free blocks count as free)
    num_preemptions: int  # since start
    num_prefix_hit_tokens: int  # since start
    num_prefix_query_tokens: int  # prompt tokens looked up in the prefix cache, since start
    num_offload_hit_tokens: int  # prompt tokens loaded from the CPU tier, since start
    num_offload_query_tokens: int  # prompt tokens looked up there past the GPU pool's hits, since start
    iteration_tokens: HistogramSnapshot  # per step, as vLLM counts: sampled tokens and the prompts they began
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters, since start; None: it is off


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine tells its client once it is up: enough to process prompts for it (the model, the
    sampling defaults, what its scheduling cannot honour) and to report on it, in one typed record."""

    model_config: ModelConfig
    sampling_defaults: dict  # the model's generation_config.json sampling fields, for requests that set none
    kv_cache_info: KVCacheInfo
    async_scheduling: bool  # the requests it refuses are refused by the client's InputProcessor too
    stats: EngineStats

    def input_processor(self, tokenizer) -> InputProcessor:
        """The input rules this engine holds prompts to, for a client with its own tokenizer."""
        return InputProcessor(self.model_config, tokenizer, self.async_scheduling)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self.sampling_defaults = sampling_defaults(config.model)  # for requests that set none
        self.executor = make_executor(config)
        self.kv_cache_info = size_kv_cache(config, self.executor)
        self.config = config = with_measured_len(config, self.kv_cache_info)
        info = self.kv_cache_info
        self.executor.initialize_kv_cache(info.num_blocks, info.num_offload_blocks)
        self.block_manager = BlockManager(info.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                          config.model.kv_groups.windows, info.num_offload_blocks)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, config.model.max_model_len,
                                   None if config.lora is None else LoRASlots(config.lora.max_loras))
        self.adapter_checks = AdapterChecks(config)
        self.prompts: dict[str, set[str]] = {}  # prompt id -> its requests not finished yet
        self._prompt_of: dict[str, str] = {}  # request id -> its prompt's id
        self._draining: set[str] = set()  # aborted prompts whose requests are in a batch still in flight
        self._failed: list[PromptFailed] = []  # prompts failed by a step, for the client (take_failed_prompts)
        self._seeds = random.Random(config.seed)  # seeds for prompts that bring none
        self.in_flight: deque[SchedulerOutput] = deque()  # submitted batches, oldest first
        # the step loop, chosen once: a batch at a time, or batches overlapped (pipeline stages, async scheduling)
        self._step = self._step_one if self.executor.max_concurrent_batches == 1 else self._step_overlapped
        self.iteration_tokens = StepHistogram()
        self.input_processor = self.info().input_processor(self.tokenizer)  # (the same rules as its clients')

    def add_request(self, prompt_id: str, prompt: PromptType | ProcessedPrompt,
                    params: SamplingParams | PoolingParams, lora_request: LoRARequest | None = None) -> None:
        """Queue a prompt: it fans out to n requests, one per sample, that share its cached blocks.
        A ProcessedPrompt was checked with these params already; anything else is checked here.
        With PoolingParams (a pooling runner) it is one request whose one delta carries its vector.
        With a lora_request its samples run with that adapter (enable_lora; checked here once per adapter)."""
        self.adapter_checks.check(lora_request)
        if prompt_id in self.prompts or prompt_id in self._draining:
            raise ValueError(f"prompt id {prompt_id!r} is already in use")
        check_runner(self.config.model.runner, params)  # (a ProcessedPrompt too: the worker would fail)
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.input_processor.process(prompt, params)
        request_ids = sample_request_ids(prompt_id, params)
        if isinstance(params, PoolingParams):
            assert self.config.model.pooler is not None  # a pooling runner (check_runner)
            self.scheduler.add_request(Request(prompt_id, list(prompt.prompt_token_ids), PROMPT_ONLY, 0,
                                               pooling_params=params.resolved(self.config.model.pooler)))
        else:
            base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(62)
            for sample_index, request_id in enumerate(request_ids):  # the first refusal comes before any is queued
                self.scheduler.add_request(Request(request_id, list(prompt.prompt_token_ids), params,
                                                   base_seed + sample_index, self.eos_token_ids, lora=lora_request))
        self.prompts[prompt_id] = set(request_ids)
        self._prompt_of.update(dict.fromkeys(request_ids, prompt_id))

    def abort_request(self, prompt_id: str) -> None:
        """Free everything the prompt's requests hold, wherever they are. NOTE: its id stays in use while a
        batch that holds its requests is in flight (that batch's tokens would reach a new prompt of that id)."""
        request_ids = self._forget(self.prompts.get(prompt_id, ()))
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if request_ids and self.in_flight:
            self._draining.add(prompt_id)

    def stop_requests(self, request_ids) -> None:
        """Finish samples their client ended (a stop string in their text) as stopped."""
        self.scheduler.finish_requests(self._forget(request_ids), RequestStatus.FINISHED_STOPPED)

    def _forget(self, request_ids) -> list[str]:
        """Drop finished requests from their prompts (a prompt with none left, too); the ones that were known."""
        known = [r for r in request_ids if r in self._prompt_of]
        for request_id in known:
            prompt_id = self._prompt_of.pop(request_id)
            unfinished = self.prompts[prompt_id]
            unfinished.discard(request_id)
            if not unfinished:
                del self.prompts[prompt_id]
        return known

    def info(self) -> EngineInfo:
        return EngineInfo(self.config.model, self.sampling_defaults, self.kv_cache_info,
                          self.config.scheduler.async_scheduling, self.get_stats())

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation defaults (vLLM's get_default_sampling_params)."""
        return SamplingParams(**self.sampling_defaults)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests or bool(self.in_flight)

    def step(self) -> list[RequestUpdate]:
        """One turn of the step loop (a batch at a time, or overlapped: pipeline stages, async scheduling):
        what each request that advanced gained, in token ids."""
        if self.executor.is_dead:
            raise EngineDeadError("the engine's workers have stopped; start a new engine")
        updates = self._step()
        self._forget([u.request_id for u in updates if u.finish_reason is not None])
        if not self.in_flight:
            self._draining.clear()
        return updates

    def _step_one(self) -> list[RequestUpdate]:
        """Schedule, execute, update."""
        scheduler_output = self._schedule()
        if scheduler_output.is_empty and self.scheduler.has_unfinished_requests:
            raise RuntimeError("the scheduler could not run any request; this is a bug")
        return self._update(scheduler_output, self.executor.execute_model(scheduler_output))

    def _step_overlapped(self) -> list[RequestUpdate]:
        """Submit batches until max_concurrent_batches are in flight, then collect the oldest. With
        pipeline stages each batch takes a share of the requests, so no stage idles while another
        computes; with async scheduling, step N+1 is queued on the device before step N's tokens are
        read (every running request goes in each batch)."""
        self._submit_batches()
        if not self.in_flight:
            if self.scheduler.has_unfinished_requests:
                raise RuntimeError("the scheduler could not run any request; this is a bug")
            return []
        scheduler_output = self.in_flight.popleft()
        return self._update(scheduler_output, self.executor.collect_batch())

    def _submit_batches(self) -> None:
        num_batches = self.executor.max_concurrent_batches
        per_batch = -(-self.scheduler.num_unfinished_requests // num_batches)  # requests per batch, rounded up
        share = None if self.config.scheduler.async_scheduling else max(per_batch, 1)
        while len(self.in_flight) < num_batches:
            scheduler_output = self._schedule(max_num_requests=share)
            if scheduler_output.is_empty and not scheduler_output.finished_request_ids:
                break  # (an empty batch still goes out alone to tell the workers what finished)
            self.executor.submit_batch(scheduler_output)
            self.in_flight.append(scheduler_output)

    def _schedule(self, max_num_requests: int | None = None) -> SchedulerOutput:
        """The scheduler's batch, with what its requests under a grammar may sample next."""
        output = self.scheduler.schedule(max_num_requests=max_num_requests)
        requests = self.scheduler.requests
        bitmask = grammar_bitmask([requests[r] for r in output.num_scheduled_tokens], self.config.model,
                                  self.tokenizer, output.spec_token_ids)
        return output if bitmask is None else dataclasses.replace(output, grammar_bitmask=bitmask)

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        if runner_output.failed_loras:  # their requests' tokens from this step are dropped below
            self._fail_adapters(scheduler_output, runner_output.failed_loras)
        if scheduler_output.grammar_bitmask is not None:  # before a finished request leaves the scheduler
            accept_tokens(scheduler_output.grammar_bitmask, self.scheduler.requests, runner_output.sampled_token_ids,
                          runner_output.accepted_drafts)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        if not scheduler_output.is_empty:
            self.iteration_tokens.observe(self.scheduler.last_step_tokens)
        return updates

    def _fail_adapters(self, scheduler_output: SchedulerOutput, failed_loras: tuple[int, ...]) -> None:
        """The adapters a rank could not read when this step loaded them (their files changed or vanished after
        add_request checked them) fail their prompts alone: each prompt's error waits in take_failed_prompts,
        and the next request naming the adapter is checked again when it is added."""
        for lora in (lora for _, lora in scheduler_output.lora_loads if lora.lora_int_id in failed_loras):
            self.adapter_checks.forget(lora)
            request_ids = self.scheduler.fail_adapter(lora)
            prompt_ids = dict.fromkeys(self._prompt_of[r] for r in request_ids if r in self._prompt_of)
            self._forget(request_ids)
            error = AdapterError(f"LoRA adapter {lora.lora_name!r}: its weights could not be read (its files changed "
                                 "or were removed after it was loaded); load it again")
            for prompt_id in prompt_ids:
                self._failed.append(PromptFailed(prompt_id, error))
                if self.in_flight:  # as an abort's: its id stays in use while a batch holding it runs
                    self._draining.add(prompt_id)

    def take_failed_prompts(self) -> list[PromptFailed]:
        """The prompts steps have failed since the last call (an adapter its ranks could not read): they have
        no more updates, and their clients end them with the error."""
        failed, self._failed = self._failed, []
        return failed

    def get_stats(self) -> EngineStats:
        scheduler, pool = self.scheduler, self.block_manager
        return EngineStats(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                           kv_cache_usage=1.0 - pool.num_free_blocks / pool.num_blocks,
                           num_preemptions=scheduler.num_preemptions,
                           num_prefix_hit_tokens=scheduler.num_prefix_hit_tokens,
                           num_prefix_query_tokens=scheduler.num_prefix_query_tokens,
                           num_offload_hit_tokens=scheduler.num_offload_hit_tokens,
                           num_offload_query_tokens=scheduler.num_offload_query_tokens,
                           iteration_tokens=self.iteration_tokens.snapshot(),
                           spec_decode=None if self.config.scheduler.speculative is None else
                           dataclasses.replace(scheduler.spec_stats, accepted_per_position=list(
                               scheduler.spec_stats.accepted_per_position)))

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker rank has died; call it between steps."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()
