"""Typed messages between the engine and the workers: what to run this step and what came back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardserve.runtime.core.kv_offload import KVTransfer
from shardserve.runtime.lora_request import LoRARequest
from shardserve.runtime.outputs import SampleTimes
from shardserve.runtime.pooling_params import PoolingParams
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.core.structured_output import GrammarBitmask

if TYPE_CHECKING:
    import numpy as np


@dataclass(slots=True, frozen=True)
class NewRequestData:
    """A request the worker has not seen (or must forget and rebuild after preemption), in full."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt followed by any outputs produced before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int]  # masked out until min_tokens outputs exist
    block_ids: tuple[int, ...]
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    pooling_params: PoolingParams | None = None  # resolved: the output rank pools the prompt, samples nothing
    lora_slot: int = -1  # the adapter slot it runs with (lora_loads fill slots); -1: the base model
    group_block_ids: tuple[tuple[int, ...], ...] = ()  # the other KV groups' tables (a model with several)


@dataclass(slots=True)
class CachedRequestData:
    """A request the worker already holds, as a diff since the last step it ran in.
    NOTE: made per request per step, so not frozen (a frozen dataclass's __init__ costs ~3x, one
    object.__setattr__ per field); nothing changes it after it is made, as with RequestUpdate."""

    request_id: str
    new_token_ids: tuple[int, ...]  # tokens sampled since the worker last saw it (usually one)
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    new_group_block_ids: tuple[tuple[int, ...], ...] = ()  # the other KV groups' (as many as new_block_ids each)


@dataclass(slots=True, frozen=True)
class SchedulerOutput:
    """One step of work. Requests run in the order new_requests then cached_requests."""

    new_requests: tuple[NewRequestData, ...]
    cached_requests: tuple[CachedRequestData, ...]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens computed this step
    finished_request_ids: frozenset[str]  # the worker drops these (finished, aborted, preempted)
    grammar_bitmask: GrammarBitmask | None = None  # the engine's, for the requests under a grammar
    kv_transfers: tuple[KVTransfer, ...] = ()  # copies to and from the CPU tier, run in order before the step
    lora_loads: tuple[tuple[int, LoRARequest], ...] = ()  # (slot, adapter) to fill before the step, in order
    # speculative decoding: request id -> the drafted tokens this step verifies after its last known one
    # (counted in num_scheduled_tokens; runtime/core/spec_decode.py)
    spec_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """Log-probabilities of one sampled position: the sampled token first, then the top-k."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    sampled_rank: int  # 1-based rank of the sampled token under the raw distribution


@dataclass(slots=True)
class ModelRunnerOutput:
    """Returned by the output rank only. Requests mid-prefill have no entry."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> (index of the first prompt token scored, its entries and the next ones'): this
    # step's share of the prompt logprobs of requests that ask for them
    prompt_logprobs: dict[str, tuple[int, tuple[TokenLogprobs, ...]]] = field(default_factory=dict)
    # request id -> its prompt's pooled vector ([hidden_size] float32), on the step that computed its last chunk
    pooled: dict[str, np.ndarray] = field(default_factory=dict)
    # lora_int_ids of this step's lora_loads that some rank could not read (their files changed or vanished
    # after the engine checked them): every rank left their slots empty, and their requests' tokens are void
    failed_loras: tuple[int, ...] = ()
    # speculative decoding: request id -> the drafts the target sampled too, which precede its sampled token,
    # and their logprobs where the request asks (sampled_token_ids holds the token at the first mismatch)
    accepted_drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    draft_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)


@dataclass(slots=True)
class RequestUpdate:
    """What the scheduler made of one step for one request, handed to the output processor."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None  # "stop", "length" or None while running
    stop_reason: int | str | None = None
    times: SampleTimes | None = None  # with the sample's first token only
    new_prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # prompt tokens scored since the last update
    num_cached_tokens: int | None = None  # with the first token: prompt tokens the prefix cache served
    pooled: np.ndarray | None = None  # a pooling request's vector: its one update, which finishes it
    spec_counts: tuple[int, int, int] | None = None  # with the last token, drafting: Request.spec_counts
