"""One model replica shard on one device: loads the model, owns its KV cache tensors, runs steps."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re

import torch

from shardserve.planner.kv_groups import KVGroups
from shardserve.planner.linear_attention import state_copies
from shardserve.planner.rules import FP8_COMPUTE_CAPABILITY, fp8_kv_problem
from shardserve.planner.settings import DEFAULT_CPU_KV_CACHE_BYTES
from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.attention.torch_backend import TorchAttentionBackend
from shardserve.runtime.config import EngineConfig
from shardserve.runtime.worker.cuda_graph_plan import agreed_decision, local_decision, log_graph_memory, reserved_graph_bytes
from shardserve.runtime.worker.cuda_graphs import DecodeGraphRunner, static_intermediate
from shardserve.runtime.worker.eagle import HeadRunner, make_drafter
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context
from shardserve.runtime.worker.inputs import (HostInputs, RequestState, apply_scheduler_output, build_host_inputs,
                                       count_samples, to_device)
from shardserve.runtime.layers.lora_batch import LoRABatch
from shardserve.runtime.layers.recurrent_state import RecurrentLayer, state_bytes_per_slot
from shardserve.runtime.worker.loader import load_model
from shardserve.runtime.worker.lora_adapters import RankAdapters, step_lora_batch
from shardserve.runtime.core.messages import ModelRunnerOutput, SchedulerOutput
from shardserve.runtime.distributed.parallel_state import get_parallel_state
from shardserve.runtime.worker.pipeline import (IntermediateTensors, recv_intermediate, recv_intermediate_into,
                                         send_intermediate)
from shardserve.runtime.worker.pooler import pool_step
from shardserve.runtime.worker.prompt_logprobs import score_prompts, wants_prompt_logprobs
from shardserve.runtime.worker.sampler import logprobs_by_row, sample_on_device
from shardserve.runtime.worker.spec_rows import add_drafts, draft_rows
from shardserve.runtime.worker.state_rollback import StateRollback
from shardserve.runtime.worker.kv_tier import host_tier, run_transfers
from shardserve.runtime.worker.sampling_batch import SamplingCache
from shardserve.runtime.worker.staging import SampledTokenBuffers, StagingBuffer, StepOutput
from shardserve.runtime.worker.state_slots import StateSlots
from shardserve.runtime.core.structured_output import GrammarBitmask, sampling_bitmask

logger = logging.getLogger(__name__)


def select_attention_backend(device: torch.device):
    if device.type == "cuda":
        from shardserve.runtime.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    return TorchAttentionBackend()


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)(?:\.|$)")


def kv_tensor_of_layers(model: torch.nn.Module, groups: KVGroups) -> list[tuple[Attention, int]]:
    """Each attention layer with the KV tensor it uses, its kv_group set (planner/kv_groups.py's reading of
    config.json). Refuses to run if a layer's window is not its group's: the block manager would free
    blocks that layer still reads."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Attention)]
    placed = []
    for position, (name, attention) in enumerate(layers):
        if groups.is_hybrid:
            match = _LAYER_INDEX.search(name)
            if match is None:
                raise ValueError(f"attention layer {name!r} has no decoder layer index: its KV group is unknown")
            group, tensor = groups.slot_of(int(match.group(1)))
        else:
            group, tensor = 0, position  # every layer of a one-group model has its own tensor, in order
        if groups.windows[group] is not None and attention.sliding_window != groups.windows[group]:
            raise ValueError(f"config.json gives attention layer {name} a window of {groups.windows[group]}, but "
                             f"the model's layer uses {attention.sliding_window}: the KV cache would free blocks "
                             "it still reads")
        attention.kv_group = group
        placed.append((attention, tensor))
    return placed


class Worker:
    """In a multi-rank engine, distributed.init_distributed has set the parallel state (and groups)
    before this is built; alone, the default single-rank state applies."""

    def __init__(self, config: EngineConfig, device: torch.device | None = None):
        self.config = config
        self.parallel_state = get_parallel_state()
        self.device = device or torch.device(config.device)
        self._check_kv_cache_dtype()
        torch.manual_seed(config.seed)
        self.model = load_model(config.model, self.device)
        # enable_lora's slots on this rank's layers, before the KV budget is measured
        self.adapters = None if config.lora is None else \
            RankAdapters(self.model, config.lora, config.model.dtype, self.device)
        self.backend = select_attention_backend(self.device)
        self.states: dict[str, RequestState] = {}
        self.drafter = make_drafter(config, self.model, self.device, self.backend, self.states)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.recurrent_layers = [m for m in self.model.modules() if isinstance(m, RecurrentLayer)]
        # a row of every recurrent layer's states per running request (None: the model has no such layer)
        self.state_slots = StateSlots(config.scheduler.max_num_seqs) if self.recurrent_layers else None
        spec = config.scheduler.speculative  # a request with k drafts samples k + 1 rows
        self.num_drafts = spec.num_speculative_tokens if spec else 0
        self.rollback = StateRollback(self.recurrent_layers, self.num_drafts) if spec and self.recurrent_layers \
            else None
        for attention in self.attention_layers:
            attention.fix_kv_scales()
        self.kv_tensors = kv_tensor_of_layers(self.model, config.model.kv_groups)  # (layer, its KV tensor)
        self.kv_cache: torch.Tensor | None = None
        self.offload_cache: torch.Tensor | None = None  # the CPU tier's share of this rank (host memory)
        self.cuda_graphs: DecodeGraphRunner | None = None  # built with the KV cache
        self.staging = StagingBuffer(self.device)  # every step's inputs go to the device through it
        self.token_buffers = SampledTokenBuffers(config.scheduler.max_num_seqs * (1 + self.num_drafts), self.device)
        self.last_sampled: torch.Tensor | None = None  # [num_sampled] the last step's ids, on the device
        self.sampling_cache = SamplingCache()  # the sampling rank's parameter arrays, per batch composition
        self.memory_profile: dict[str, int] = {}  # CUDA: what the KV budget was measured from (bytes)

    def kv_pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[layers, planes, num_blocks, block_size, kv_heads, head_dim]: K and V (or MLA's latent alone)."""
        if not self.attention_layers:  # a pipeline stage of recurrent layers only: no KV at all
            return (0, 2, num_blocks, self.config.cache.block_size, 1, 1)
        layer = self.attention_layers[0]
        num_tensors = max(tensor for _, tensor in self.kv_tensors) + 1  # a page spans them (kv_groups.py)
        return (num_tensors, layer.cache_planes, num_blocks, self.config.cache.block_size,
                layer.num_kv_heads, layer.head_dim)

    @property
    def state_bytes(self) -> int:
        """The recurrent layers' states on this rank: a slot per request the scheduler may run, and scratch."""
        if self.state_slots is None:
            return 0
        return self.state_slots.num_slots * state_bytes_per_slot(self.recurrent_layers) * state_copies(self.num_drafts)

    @property
    def bytes_per_block(self) -> int:
        """One block across this worker's layers (and its draft model's)."""
        drafts = 0 if self.drafter is None else self.drafter.bytes_per_block(self.kv_cache_dtype)
        return math.prod(self.kv_pool_shape(1)) * self.kv_cache_dtype.itemsize + drafts

    def _check_kv_cache_dtype(self) -> None:
        """The planner's fp8 KV rule, on this worker's own device."""
        if self.device.type != "cuda":
            return
        has_fp8 = torch.cuda.get_device_capability(self.device) >= FP8_COMPUTE_CAPABILITY
        problem = fp8_kv_problem(self.config.cache.kv_cache_dtype, torch.cuda.get_device_name(self.device), has_fp8)
        if problem:
            raise ValueError(problem)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.config.cache.torch_dtype(self.config.model.dtype)

    def available_kv_cache_bytes(self) -> int:
        """What the KV pool may take: the cache's memory (kv_cache_memory_bytes, the CPU default, or what the
        profile leaves on a GPU) less the recurrent layers' states, which vLLM and the planner count in it."""
        budget = self._cache_budget()
        if self.state_bytes:
            logger.info("%.3f GiB of the KV cache's memory set aside for the recurrent layers' states",
                        self.state_bytes / 1024**3)
        return max(budget - self.state_bytes, 0)

    def _cache_budget(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type == "cpu":
            logger.info("KV cache on CPU: using the default %.1f GiB (set kv_cache_memory_bytes to change it)",
                        DEFAULT_CPU_KV_CACHE_BYTES / 1024**3)
            return DEFAULT_CPU_KV_CACHE_BYTES
        with self._on_device():
            budget = self._profile_cuda_kv_budget()
        if local_decision(self.config, self.device, self.model).captures:
            graphs = self.graph_reserve_bytes
            logger.info("%.3f GiB of the KV budget set aside for CUDA graphs", graphs / 1024**3)
            budget = max(budget - graphs, 0)
        return budget

    def _on_device(self):
        """NOTE: Triton launches on torch's current device, and a data-parallel replica steps in
        whichever pool thread is free: every GPU step first makes this worker's device current."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _profile_cuda_kv_budget(self) -> int:
        """Run the largest step the scheduler can issue, then give the KV cache what is left of
        total x gpu_memory_utilization after the peak."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.scheduler.max_num_batched_tokens
        num_tokens = min(num_tokens, self.config.model.max_model_len * self.config.scheduler.max_num_seqs)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.config.model.max_model_len
        state = self.parallel_state
        intermediate = None
        if not state.is_first_stage:  # what the previous stage would hand over (zeros; only its size matters)
            hidden_size = self.config.model.hf_config.hidden_size
            hidden = torch.zeros(num_tokens, hidden_size, dtype=self.config.model.dtype, device=self.device)
            intermediate = IntermediateTensors(hidden, hidden.clone())
        heads = self.drafter if isinstance(self.drafter, HeadRunner) else None  # (their states and forward too)
        capture = None if heads is None else heads.capture
        with torch.inference_mode(), forward_context(ForwardContext(None, self.backend, capture=capture)):
            hidden = self.model(input_ids, positions, intermediate)
            if state.is_last_stage and self.config.model.runner == "generate":  # (pooling: no head)
                num_rows = min(self.config.scheduler.max_num_seqs, num_tokens)
                if self.drafter is not None:  # a draft model or head: its forward, and a head's states
                    self.drafter.dry_run(input_ids, positions, hidden, num_rows)
                # compute_logits: every model family's method, which nn.Module's type does not declare
                self.model.compute_logits(hidden[:num_rows]).float().softmax(dim=-1)  # type: ignore[operator]
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        budget = int(total * self.config.cache.gpu_memory_utilization) - non_torch - peak
        self.memory_profile = {"total": total, "peak_torch": peak, "other": non_torch, "kv_budget": budget,
                               "profiled_tokens": num_tokens}
        logger.info("memory profile: total %.2f GiB, peak torch %.2f GiB, other %.2f GiB -> KV budget %.2f GiB",
                    total / 1024**3, peak / 1024**3, non_torch / 1024**3, budget / 1024**3)
        return max(budget, 0)

    @functools.cached_property
    def graph_reserve_bytes(self) -> int:
        """What the KV budget leaves for this rank's CUDA graphs (read from the checkpoint once)."""
        return reserved_graph_bytes(self.config, len(self.attention_layers))

    def initialize_kv_cache(self, num_blocks: int, num_offload_blocks: int = 0) -> None:
        """The pool of num_blocks blocks, plus one scratch block after them where CUDA graphs write
        the padding rows of a decode step (the block manager never hands it out), and this rank's
        share of the CPU tier's blocks."""
        decision = agreed_decision(self.config, self.device, self.model)  # a collective: every rank is here
        num_scratch = 1 if decision.captures else 0
        self.kv_cache = torch.zeros(self.kv_pool_shape(num_blocks + num_scratch), dtype=self.kv_cache_dtype,
                                    device=self.device)
        for attention, tensor in self.kv_tensors:
            attention.kv_cache = self.kv_cache[tensor]  # [planes, num_blocks, block_size, kv_heads, head_dim]
        if self.drafter is not None:
            self.drafter.bind(num_blocks + num_scratch, self.kv_cache_dtype, self.device)
        self._bind_states()
        if num_offload_blocks:
            self.offload_cache = host_tier(self.kv_cache, num_offload_blocks)
        if not decision.captures:
            logger.info("decode runs eagerly, without CUDA graphs: %s", decision.reason)
            return
        max_size, model = decision.sizes[-1], self.config.model
        intermediate = None if self.parallel_state.is_first_stage else \
            static_intermediate(max_size, model.hf_config.hidden_size, model.dtype, self.device)
        self.cuda_graphs = DecodeGraphRunner(self.model, self.backend, list(decision.sizes), model.max_model_len,
                                             self.config.cache.block_size, scratch_block=num_blocks,
                                             device=self.device, intermediate=intermediate,
                                             scratch_state=None if self.state_slots is None else self.state_slots.scratch,
                                             num_groups=self.config.model.kv_groups.num_groups)
        with self._on_device():
            measured = self.cuda_graphs.capture()
        log_graph_memory(measured, self.graph_reserve_bytes)

    def _bind_states(self) -> None:
        """Each recurrent layer's states, zeroed: [num_slots, *spec.shape] per spec."""
        if self.state_slots is None:
            return
        for layer in self.recurrent_layers:
            layer.states = tuple(torch.zeros((self.state_slots.num_slots, *spec.shape), dtype=spec.dtype,
                                             device=self.device) for spec in layer.state_specs())
        if self.rollback is not None:
            self.rollback.bind(self.state_slots.num_slots, self.device)
        logger.info("recurrent states: %d slots, %.3f GiB on this rank", self.state_slots.num_slots,
                    self.state_bytes / 1024**3)

    def release(self) -> None:
        """Drop the model, the KV pool (and the layers' views of it) and the graphs, then hand cached
        device memory back, so the next engine in this process starts from an empty device."""
        for attention in self.attention_layers:
            attention.kv_cache = None
        for layer in self.recurrent_layers:
            layer.states = None
        self.attention_layers, self.recurrent_layers, self.kv_tensors = [], [], []
        if self.drafter is not None:
            self.drafter.release()
        if self.rollback is not None:
            self.rollback.release()
        self.states.clear()
        self.kv_cache = self.cuda_graphs = self.offload_cache = None
        self.model = None  # type: ignore[assignment]  # released: no step runs after this
        self.last_sampled = None
        self.sampling_cache = SamplingCache()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Every rank runs every step; only the output rank returns a result (the others None)."""
        return self.collect(self.submit(output))

    @torch.inference_mode()
    def submit(self, output: SchedulerOutput) -> StepOutput | None:
        """Queue the step on the device; returns without waiting for its sampled ids (collect does)."""
        with self._on_device():
            return self._step(output)

    @staticmethod
    def collect(step: StepOutput | None) -> ModelRunnerOutput | None:
        return None if step is None else step.to_runner_output()

    def _step(self, output: SchedulerOutput) -> StepOutput | None:
        if output.kv_transfers:
            assert self.kv_cache is not None and self.offload_cache is not None  # the engine has a CPU tier
            run_transfers(self.kv_cache, self.offload_cache, output.kv_transfers)
        failed_loras: tuple[int, ...] = ()
        if output.lora_loads:  # before the step that first uses them (a collective: every rank is here)
            assert self.adapters is not None  # the engine has enable_lora
            failed_loras = self.adapters.load(output.lora_loads)
        batch = apply_scheduler_output(self.states, output, self.state_slots)
        if not batch:
            return StepOutput(failed_loras=failed_loras) if self.parallel_state.is_output_rank else None
        spec_ids = output.spec_token_ids if self.drafter is None else \
            self.drafter.propose(batch, output.num_scheduled_tokens, output.spec_token_ids)  # (fills placeholders)
        if spec_ids:  # (they leave the states again in draft_rows)
            add_drafts(self.states, spec_ids)
        host = build_host_inputs(batch, output.num_scheduled_tokens, self.config.cache.block_size)
        drafts = draft_rows(host, spec_ids) if spec_ids else {}
        if self.rollback is not None:  # recurrent layers keep each token's state for the drafts verified
            self.rollback.restore(batch, self.states)
            host.verifying = tuple(state.request_id in drafts for state in batch) if drafts else ()
            self.rollback.record(batch, list(host.verifying))
        result = self._run(host, batch, output.grammar_bitmask, drafts)
        count_samples(host)
        if result is not None:  # the output rank's
            result.failed_loras = failed_loras
        return result

    def _run(self, host: HostInputs, batch: list[RequestState], grammar: GrammarBitmask | None,
             drafts: dict[str, tuple[int, tuple[int, ...]]]) -> StepOutput | None:
        state = self.parallel_state
        # NOTE: laid out on the host before the forward is queued, so it overlaps the device's work
        sampled_ids = [s.request_id for s in host.sampled_states]
        bitmask = sampling_bitmask(grammar, sampled_ids, self.config.model.vocab_size) if state.is_output_rank else None
        lora = None if self.adapters is None else step_lora_batch(batch, host, self.adapters.num_slots, self.device)
        hidden, logits_indices = self._forward(host, lora)  # [num_tokens, hidden_size]
        if isinstance(self.drafter, HeadRunner):  # (every step runs eagerly: the head reads its hidden states)
            self.drafter.keep(batch, host, hidden)  # type: ignore[arg-type]  # one stage: the final states
        if not state.is_last_stage:
            assert isinstance(hidden, IntermediateTensors)  # the hand-off to the next stage
            send_intermediate(hidden)
            return None
        assert isinstance(hidden, torch.Tensor)  # the last stage's final hidden states
        if self.config.model.runner == "pooling":  # prompts are pooled, never sampled (the model has no head)
            return StepOutput(pooled=pool_step(hidden, host, batch)) if state.is_output_rank else None
        prompt_logprobs = (score_prompts(self.model, host, batch, hidden, state.is_output_rank)
                           if wants_prompt_logprobs(batch) else {})
        if not host.sampled_states:
            return StepOutput(prompt_logprobs=prompt_logprobs) if state.is_output_rank else None
        if not host.samples_every_token:
            hidden = hidden[logits_indices]
        # every TP rank of the last stage joins the logits gather; the output rank alone samples
        logits = self.model.compute_logits(hidden).float()  # type: ignore[operator]  # [num_sampled, vocab]
        if not state.is_output_rank:
            return None
        tokens = sample_on_device(logits, host.sampled_states, bitmask, self.sampling_cache)  # [num_sampled]
        self.last_sampled = tokens  # the next step's pending input ids
        # (any drafts are verified where the ids are read: StepOutput.to_runner_output)
        return StepOutput(sampled_ids, self.token_buffers.start_copy(tokens),
                          logprobs_by_row(logits, host.sampled_states, tokens, self.sampling_cache), prompt_logprobs,
                          drafts=drafts)

    def _forward(self, host: HostInputs,
                 lora: LoRABatch | None = None) -> tuple[torch.Tensor | IntermediateTensors, torch.Tensor | None]:
        """A captured graph for a decode step that has one (every row samples), the model run eagerly
        otherwise. Returns the hidden states (a later stage's hand-off before the last stage) and the
        rows that sample, on the device."""
        state = self.parallel_state
        if self.cuda_graphs is not None and self.cuda_graphs.can_replay(host):  # the same on every rank
            size, pending = self.cuda_graphs.load(host, self.staging)
            if pending is not None:
                assert self.last_sampled is not None  # pending ids are the last step's samples
                pending.fill(self.cuda_graphs.inputs.input_ids, self.last_sampled)
            if not state.is_first_stage:
                assert self.cuda_graphs.intermediate is not None  # made for every stage after the first
                recv_intermediate_into(self.cuda_graphs.intermediate, host.num_requests)
            return self.cuda_graphs.replay(size, host.num_requests), None
        inputs = to_device(host, self.staging)
        if inputs.pending is not None:
            assert self.last_sampled is not None  # pending ids are the last step's samples
            inputs.pending.fill(inputs.input_ids, self.last_sampled)
        intermediate = None if state.is_first_stage else recv_intermediate(self.config.model.dtype, self.device)
        capture = self.drafter.capture if isinstance(self.drafter, HeadRunner) else None
        with forward_context(ForwardContext(inputs.attn_metadata, self.backend, lora, capture)):
            return self.model(inputs.input_ids, inputs.positions, intermediate), inputs.logits_indices
