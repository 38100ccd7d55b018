"""The worker's view of its requests and the flat model inputs built from them each step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Iterator, Sequence
from itertools import chain, islice
from typing import cast, overload

import numpy as np
import torch

from shardserve.runtime.worker.forward_context import AttentionMetadata
from shardserve.runtime.core.messages import NewRequestData, SchedulerOutput
from shardserve.runtime.pooling_params import PoolingParams
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.worker.staging import StagingBuffer
from shardserve.runtime.worker.state_slots import StateSlots


@dataclass(slots=True)
class RequestState:
    """What the worker keeps for a request between steps."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int]
    block_ids: np.ndarray  # [num_blocks] int32, this request's block table (a list is converted)
    num_computed_tokens: int
    # sampled by steps that ran here, not yet in token_ids (the scheduler sends them one step late
    # with async scheduling); the last one is row sampled_row of the worker's last sampled ids
    num_pending_tokens: int = 0
    sampled_row: int = 0
    pooling_params: PoolingParams | None = None  # a pooling request's (resolved): pooled, never sampled
    # the output rank's pooling so far, over the chunks computed: the sum of rows (MEAN) or row 0 (CLS)
    pooled: torch.Tensor | None = None
    lora_slot: int = -1  # the adapter slot its tokens use (enable_lora); -1: the base model
    state_slot: int = -1  # its row of the recurrent layers' states (worker/state_slots.py); -1: none
    group_block_ids: list[np.ndarray] = field(default_factory=list)  # the other KV groups' tables, as block_ids
    draft_computed: int = 0  # a draft model's (worker/draft_model.py): the tokens its KV holds for the request

    def __post_init__(self) -> None:
        self.block_ids = np.asarray(self.block_ids, dtype=np.int32)
        self.group_block_ids = [np.asarray(t, dtype=np.int32) for t in self.group_block_ids]

    @classmethod
    def from_new(cls, data: NewRequestData) -> RequestState:
        return cls(data.request_id, list(data.token_ids), data.num_prompt_tokens, data.sampling_params,
                   data.seed, data.stop_token_ids, np.asarray(data.block_ids, dtype=np.int32), data.num_computed_tokens,
                   pooling_params=data.pooling_params, lora_slot=data.lora_slot,
                   group_block_ids=[np.asarray(t, dtype=np.int32) for t in data.group_block_ids],
                   draft_computed=data.num_computed_tokens)  # (a cached prefix's blocks hold the draft's KV too)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_prompt_tokens


class TokenView(Sequence[int]):
    """A request's token ids from `start` on, then `extra`, without copying the request's list: the token ids of a
    view of it (a draft forward's, a draft row's), read by their length, slices and iteration. A copy would cost a
    request's whole history per view per step."""

    __slots__ = ("tokens", "start", "extra")

    def __init__(self, tokens: Sequence[int], start: int = 0, extra: Sequence[int] = ()):
        self.tokens, self.start, self.extra = tokens, start, extra

    def __len__(self) -> int:
        return len(self.tokens) - self.start + len(self.extra)

    def __iter__(self) -> Iterator[int]:
        return chain(islice(self.tokens, self.start, None), self.extra)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        known = len(self.tokens) - self.start
        if not isinstance(index, slice):
            at = range(len(self))[index]
            return self.tokens[self.start + at] if at < known else self.extra[at - known]
        first, stop, step = index.indices(len(self))
        assert step == 1, "a view's tokens are read in order"
        head = list(self.tokens[self.start + first:self.start + min(stop, known)]) if first < known else []
        return head + list(self.extra[max(first - known, 0):max(stop - known, 0)])


def token_view(tokens: Sequence[int], start: int = 0, extra: Sequence[int] = ()) -> list[int]:
    """A TokenView where RequestState takes a list (it is read as one, never changed)."""
    return cast(list[int], TokenView(tokens, start, extra))


@dataclass(slots=True)
class HostInputs:
    """One step's inputs on the host, built with array operations (no loop over tokens):

        requests:         | r0: 3 new      | r1: 1 new | r2: 2 new    |
        query_start_loc:  0                3           4              6
        token rows:       0    0    0      1           2    2
        positions:        c0   c0+1 c0+2   c1          c2   c2+1        (c = num_computed_tokens)
        slot of a token:  block_tables[row, pos // block_size] * block_size + pos % block_size

    A token whose id is pending (sampled by the last step, still on the device) gets 0 here; its
    row is in pending_rows and the last step's sampled ids hold it at pending_sources."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_requests + 1] int32
    seq_lens: np.ndarray  # [num_requests] int32, cached + new tokens
    block_tables: np.ndarray  # [num_requests, max_blocks_per_request] int32, padded with 0
    logits_indices: np.ndarray  # [num_sampled] int64, the last token of each request that samples
    sampled_states: list[RequestState]  # same order as logits_indices
    pending_rows: np.ndarray  # [num_pending] int64, token rows whose id is on the device
    pending_sources: np.ndarray  # [num_pending] int64, their rows in the last step's sampled ids
    state_slots: np.ndarray | None = None  # [num_requests] int64, each request's state row; None: no states
    # the other KV groups' slot_mapping and block_tables (planner/kv_groups.py), as the two above
    group_tables: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    verifying: tuple[bool, ...] = ()  # per request: its step verifies drafts (AttentionMetadata's); () none

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == self.num_requests  # one new token per request

    @property
    def samples_every_token(self) -> bool:
        """Every token is its request's last (a decode step): the logits rows are all the rows."""
        return len(self.logits_indices) == self.num_tokens


@dataclass(slots=True)
class PendingTokens:
    """Input ids sampled by the previous step, on the device: copied in before the forward."""

    rows: torch.Tensor  # [num_pending] int64, rows of this step's input_ids
    sources: torch.Tensor  # [num_pending] int64, rows of the previous step's sampled ids

    def fill(self, input_ids: torch.Tensor, last_sampled: torch.Tensor) -> None:
        input_ids.index_copy_(0, self.rows, last_sampled.index_select(0, self.sources))


@dataclass(slots=True)
class ModelInputs:
    """What the model's forward takes, on the worker's device."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled]
    pending: PendingTokens | None


def apply_scheduler_output(states: dict[str, RequestState], output: SchedulerOutput,
                           slots: StateSlots | None = None) -> list[RequestState]:
    """Update the worker's request states from the step's diff; returns them in batch order. With
    `slots` (a model with recurrent layers), a new request takes a state slot and a finished one frees it."""
    for request_id in output.finished_request_ids:
        if states.pop(request_id, None) is not None and slots is not None:
            slots.release(request_id)
    for data in output.new_requests:
        state = states[data.request_id] = RequestState.from_new(data)
        if slots is not None:
            state.state_slot = slots.take(data.request_id)
    for diff in output.cached_requests:
        state = states[diff.request_id]
        state.token_ids.extend(diff.new_token_ids)
        # only sampled tokens come as a diff; accepted drafts come with them, never counted as pending
        state.num_pending_tokens = max(0, state.num_pending_tokens - len(diff.new_token_ids))
        if diff.new_block_ids:  # once per block_size tokens, so the copy is rare
            state.block_ids = np.concatenate((state.block_ids, np.asarray(diff.new_block_ids, dtype=np.int32)))
            for g, new in enumerate(diff.new_group_block_ids):
                state.group_block_ids[g] = np.concatenate((state.group_block_ids[g], np.asarray(new, dtype=np.int32)))
        state.num_computed_tokens = diff.num_computed_tokens
    order = [d.request_id for d in output.new_requests] + [d.request_id for d in output.cached_requests]
    return [states[request_id] for request_id in order]


def build_host_inputs(batch: list[RequestState], num_scheduled: dict[str, int], block_size: int) -> HostInputs:
    """NOTE: one pass over the requests gathers six integers each; everything per token or per
    block is a numpy operation. A decode step at batch 256 (64 blocks per request) took ~10 ms with
    a Python loop per request and takes ~1 ms this way on a busy CPU core."""
    num_requests = len(batch)
    counts = np.fromiter(chain.from_iterable((s.num_computed_tokens, num_scheduled[s.request_id], len(s.token_ids),
                                              len(s.block_ids), s.num_pending_tokens, s.sampled_row) for s in batch),
                         np.int64, 6 * num_requests).reshape(num_requests, 6)
    computed, query_lens, num_known, num_blocks, num_pending, sampled_rows = counts.T
    seq_lens = computed + query_lens
    query_start = np.zeros(num_requests + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    token_rows = np.repeat(np.arange(num_requests), query_lens)  # [num_tokens]
    positions = np.arange(num_tokens, dtype=np.int64) + (computed - query_start[:-1])[token_rows]
    known_ends = np.minimum(seq_lens, num_known)  # a pending token can only be the last of its range
    input_ids = np.zeros(num_tokens, dtype=np.int64)
    is_pending = positions >= num_known[token_rows]
    input_ids[~is_pending] = np.fromiter(chain.from_iterable(s.token_ids[a:b] for s, a, b in
                                                             zip(batch, computed.tolist(), known_ends.tolist())),
                                         np.int64, num_tokens - int(is_pending.sum()))
    pending_rows = np.flatnonzero(is_pending)
    has_block = np.arange(int(num_blocks.max()))[None, :] < num_blocks[:, None]

    def slots_and_table(tables_of) -> tuple[np.ndarray, np.ndarray]:
        tables = np.zeros(has_block.shape, dtype=np.int32)
        tables[has_block] = np.concatenate([tables_of(s) for s in batch])
        return tables[token_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size, tables

    slots, tables = slots_and_table(lambda s: s.block_ids)
    group_tables = [slots_and_table(lambda s, g=g: s.group_block_ids[g]) for g in range(len(batch[0].group_block_ids))]
    samples = seq_lens == num_known + num_pending  # the whole request is in the cache after this step
    has_states = batch[0].state_slot >= 0  # every request of a model with recurrent layers has one
    return HostInputs(input_ids=input_ids, positions=positions, slot_mapping=slots,
                      query_start_loc=query_start.astype(np.int32), seq_lens=seq_lens.astype(np.int32),
                      block_tables=tables, logits_indices=query_start[1:][samples] - 1,
                      sampled_states=[s for s, sampled in zip(batch, samples.tolist()) if sampled],
                      pending_rows=pending_rows, pending_sources=sampled_rows[token_rows[pending_rows]],
                      state_slots=np.fromiter((s.state_slot for s in batch), np.int64, num_requests)
                      if has_states else None, group_tables=group_tables)


def count_samples(host: HostInputs) -> None:
    """After a step: each request it sampled for has one more pending token, at its row of the
    step's sampled ids (every rank keeps the count, so the next step's inputs agree)."""
    for row, state in enumerate(host.sampled_states):
        state.num_pending_tokens += 1
        state.sampled_row = row


def to_device(host: HostInputs, staging: StagingBuffer) -> ModelInputs:
    """The step's arrays on the staging buffer's device, in one copy."""
    verifies = any(host.verifying)
    extra = tuple(a for pair in host.group_tables for a in pair)
    extra += () if host.state_slots is None else (host.state_slots,)
    extra += (np.asarray(host.verifying, dtype=np.int32),) if verifies else ()
    (input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, logits_indices, pending_rows,
     pending_sources, *rest) = staging.to_device(host.input_ids, host.positions, host.slot_mapping,
                                                 host.query_start_loc, host.seq_lens, host.block_tables,
                                                 host.logits_indices, host.pending_rows, host.pending_sources, *extra)
    num_groups = len(host.group_tables)
    group_arrays, state_slots = rest[:2 * num_groups], rest[2 * num_groups:2 * num_groups + 1]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
        max_query_len=int(np.diff(host.query_start_loc).max()),
        max_seq_len=int(host.seq_lens.max()),
        query_start_loc_cpu=host.query_start_loc.tolist(), seq_lens_cpu=host.seq_lens.tolist(),
        state_slots=state_slots[0] if host.state_slots is not None else None, verifying=host.verifying,
        verifying_flags=rest[-1] if verifies else None)
    meta.groups = tuple(dataclasses.replace(meta, slot_mapping=group_arrays[2 * g], block_tables=group_arrays[2 * g + 1])
                        for g in range(num_groups))
    pending = PendingTokens(pending_rows, pending_sources) if len(host.pending_rows) else None
    return ModelInputs(input_ids=input_ids, positions=positions, attn_metadata=meta, logits_indices=logits_indices,
                       pending=pending)


def prepare_inputs(batch: list[RequestState], num_scheduled: dict[str, int], block_size: int,
                   device: torch.device) -> ModelInputs:
    """One step's inputs outside a worker (tests): no token may be pending."""
    return to_device(build_host_inputs(batch, num_scheduled, block_size), StagingBuffer(device))


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array as a tensor on `device` (sharing its memory on the CPU).
    NOTE: a GPU gets it through pinned memory without waiting: a copy from pageable memory may
    wait for the stream, which would stall the host behind the GPU's queue every step."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
