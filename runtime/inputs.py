"""The worker's view of its requests and the flat model inputs built from them each step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardserve.runtime.forward_context import AttentionMetadata
from shardserve.runtime.messages import NewRequestData, SchedulerOutput
from shardserve.runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    """What the worker keeps for a request between steps."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int

    @classmethod
    def from_new(cls, data: NewRequestData) -> RequestState:
        return cls(data.request_id, list(data.token_ids), data.num_prompt_tokens, data.sampling_params,
                   data.seed, data.stop_token_ids, list(data.block_ids), data.num_computed_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled], the last token of each request that samples
    sampled_states: list[RequestState]  # same order as logits_indices


def apply_scheduler_output(states: dict[str, RequestState], output: SchedulerOutput) -> list[RequestState]:
    """Update the worker's request states from the step's diff; returns them in batch order."""
    for request_id in output.finished_request_ids:
        states.pop(request_id, None)
    for data in output.new_requests:
        states[data.request_id] = RequestState.from_new(data)
    for diff in output.cached_requests:
        state = states[diff.request_id]
        state.token_ids.extend(diff.new_token_ids)
        state.block_ids.extend(diff.new_block_ids)
        state.num_computed_tokens = diff.num_computed_tokens
    order = [d.request_id for d in output.new_requests] + [d.request_id for d in output.cached_requests]
    return [states[request_id] for request_id in order]


def prepare_inputs(batch: list[RequestState], num_scheduled: dict[str, int], block_size: int,
                   device: torch.device) -> ModelInputs:
    ids, positions, slots, seq_lens, query_start, logits_indices, sampled = [], [], [], [], [0], [], []
    for state in batch:
        start = state.num_computed_tokens
        end = start + num_scheduled[state.request_id]
        ids.extend(state.token_ids[start:end])
        pos = np.arange(start, end)
        positions.append(pos)
        table = np.asarray(state.block_ids, dtype=np.int64)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(end)
        query_start.append(query_start[-1] + end - start)
        if end == len(state.token_ids):  # the whole request is in the cache after this step: sample
            logits_indices.append(query_start[-1] - 1)
            sampled.append(state)
    max_blocks = max(len(s.block_ids) for s in batch)
    tables = np.zeros((len(batch), max_blocks), dtype=np.int32)
    for row, state in enumerate(batch):
        tables[row, : len(state.block_ids)] = state.block_ids
    meta = AttentionMetadata(
        slot_mapping=_tensor(np.concatenate(slots), torch.int64, device),
        query_start_loc=_tensor(query_start, torch.int32, device),
        seq_lens=_tensor(seq_lens, torch.int32, device),
        block_tables=_tensor(tables, torch.int32, device),
        max_query_len=max(b - a for a, b in zip(query_start, query_start[1:])),
        max_seq_len=max(seq_lens), query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens)
    return ModelInputs(input_ids=_tensor(ids, torch.int64, device),
                       positions=_tensor(np.concatenate(positions), torch.int64, device),
                       attn_metadata=meta, logits_indices=_tensor(logits_indices, torch.int64, device),
                       sampled_states=sampled)


def _tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.as_tensor(np.asarray(values), dtype=dtype)
    return tensor.to(device, non_blocking=True) if device.type != "cpu" else tensor
