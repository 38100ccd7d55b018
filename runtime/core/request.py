"""One request as the scheduler sees it (one sample of a prompt): its tokens, progress and status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from shardserve.runtime.lora_request import LoRARequest
from shardserve.runtime.outputs import SampleTimes
from shardserve.runtime.pooling_params import PoolingParams
from shardserve.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shardserve.runtime.core.spec_decode import TokenHistory


def sample_request_ids(prompt_id: str, params: SamplingParams | PoolingParams) -> list[str]:
    """The scheduler requests a prompt fans out to, one per sample (a pooling prompt: one), as the engine
    core names them and its client expects them."""
    n = params.n if isinstance(params, SamplingParams) else 1
    return [prompt_id] if n == 1 else [f"{prompt_id}#{i}" for i in range(n)]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class Request:
    """Token state of one request. Invariants: the prompt is not empty (the input processor checked
    it) and num_computed_tokens <= num_tokens + num_pending_tokens. The scheduler counts a step's work
    as done when it schedules it, and a token the step samples as pending until its output is back:

        known tokens:  | prompt ............ | outputs ... |
        pending:                                          | p |        (sampled on the device)
        computed:      |<------------------------------------->|       (after the step in flight)
    """

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling_params", "seed",
                 "eos_token_ids", "stop_token_ids", "status", "stop_reason", "num_computed_tokens",
                 "num_pending_tokens", "num_synced_tokens", "num_synced_blocks", "block_hashes", "num_preemptions",
                 "arrival_time", "first_scheduled_time", "num_prompt_logprobs_sent", "grammar_matcher",
                 "pooling_params", "num_cached_tokens", "lora", "lora_slot", "token_history", "spec_counts")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 seed: int, eos_token_ids: frozenset[int] = frozenset(),
                 pooling_params: PoolingParams | None = None, lora: LoRARequest | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.seed = seed  # every sample draws from (seed, output index); see sampler.py
        self.eos_token_ids = eos_token_ids
        # tokens that end the request once min_tokens are out (EOS unless ignore_eos); fixed, so
        # made once rather than at every sampled token's stop check
        self.stop_token_ids: frozenset[int] = frozenset(sampling_params.stop_token_ids) | (
            frozenset() if sampling_params.ignore_eos else eos_token_ids)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0  # tokens whose KV is in the cache once the steps scheduled so far ran
        self.num_pending_tokens = 0  # sampled by steps scheduled so far, not yet known here (at most 2)
        self.num_synced_tokens = 0  # tokens the worker has been told about
        self.num_synced_blocks = 0  # blocks the worker has been told about
        self.block_hashes: list[bytes] = []  # one per full block of all_token_ids, filled lazily
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None  # set when first admitted to a batch
        self.num_cached_tokens: int | None = None  # prompt tokens the prefix cache served when first admitted
        # speculative decoding's, vLLM's counters for this request alone: (verify steps, drafts, drafts kept)
        self.spec_counts: tuple[int, int, int] = (0, 0, 0)
        self.num_prompt_logprobs_sent = 1  # prompt tokens scored and handed on (token 0 has no score)
        self.grammar_matcher = None  # xgrammar's, under a grammar: made when first scheduled (structured_output.py)
        # resolved (every field set) for a pooling request: its prompt's vector comes back instead of a token
        self.pooling_params = pooling_params
        self.lora = lora  # the adapter it is served with; None: the base model
        self.lora_slot = -1  # its adapter's slot while running (the scheduler's LoRASlots)
        self.token_history: TokenHistory | None = None  # speculative decoding: its tokens as an array, for lookup

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_every_prompt_token(self) -> bool:
        """Its prompt is recomputed whole, never taken from the prefix cache: the positions it would
        skip must be scored (prompt logprobs) or pooled (MEAN, CLS)."""
        return self.sampling_params.prompt_logprobs is not None or (
            self.pooling_params is not None and self.pooling_params.needs_every_prompt_token)

    @property
    def max_total_tokens(self) -> int | None:
        max_tokens = self.sampling_params.max_tokens
        return None if max_tokens is None else self.num_prompt_tokens + max_tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole history."""
        prompt, num_prompt = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= num_prompt:
            return prompt[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return prompt[start:] + self.output_token_ids[:end - num_prompt]


def first_token_times(request: Request) -> SampleTimes | None:
    """Queue and prefill time, on the update that carries the request's first output token."""
    if request.num_output_tokens != 1 or request.first_scheduled_time is None:
        return None
    scheduled = request.first_scheduled_time
    return SampleTimes(queue_s=scheduled - request.arrival_time, prefill_s=time.monotonic() - scheduled)


def unsent_prompt_logprobs(request: Request, scored) -> tuple:
    """The entries of (first token index, entries) not yet handed on: a preempted request scores its
    prompt again when it is recomputed, and those repeats are dropped here."""
    start, entries = scored
    fresh = entries[max(0, request.num_prompt_logprobs_sent - start):]
    request.num_prompt_logprobs_sent = max(request.num_prompt_logprobs_sent, start + len(entries))
    return fresh
