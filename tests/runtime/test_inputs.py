"""build_host_inputs (array operations) against a plain per-token loop, on random mixed batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve.runtime.worker.inputs import (RequestState, apply_scheduler_output, build_host_inputs, prepare_inputs,
                                       to_device)
from shardserve.runtime.core.messages import CachedRequestData, NewRequestData, SchedulerOutput
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.worker.staging import StagingBuffer


def reference_inputs(batch: list[RequestState], num_scheduled: dict[str, int], block_size: int) -> dict:
    """The obvious loop over requests and tokens."""
    ids, positions, slots, seq_lens, query_start, logits_indices = [], [], [], [], [0], []
    for state in batch:
        start = state.num_computed_tokens
        end = start + num_scheduled[state.request_id]
        for pos in range(start, end):
            ids.append(state.token_ids[pos])
            positions.append(pos)
            slots.append(int(state.block_ids[pos // block_size]) * block_size + pos % block_size)
        seq_lens.append(end)
        query_start.append(query_start[-1] + end - start)
        if end == len(state.token_ids):
            logits_indices.append(query_start[-1] - 1)
    width = max(len(s.block_ids) for s in batch)
    tables = [list(s.block_ids) + [0] * (width - len(s.block_ids)) for s in batch]
    return dict(input_ids=ids, positions=positions, slot_mapping=slots, seq_lens=seq_lens,
                query_start_loc=query_start, block_tables=tables, logits_indices=logits_indices)


def random_batch(rng: np.random.Generator, num_requests: int, block_size: int):
    """Prefills from scratch, chunks over a cached prefix, decodes and mid-prompt chunks, with
    block tables drawn without repeats from one pool (as the block manager hands them out)."""
    free = rng.permutation(4096).tolist()
    batch, scheduled = [], {}
    for i in range(num_requests):
        num_tokens = int(rng.integers(1, 80))
        num_computed = int(rng.integers(0, num_tokens))
        num_new = int(rng.integers(1, num_tokens - num_computed + 1))
        if rng.random() < 0.5:  # a decode: everything but the last token is cached
            num_computed, num_new = num_tokens - 1, 1
        blocks = [free.pop() for _ in range(-(-num_tokens // block_size) + int(rng.integers(0, 2)))]
        tokens = rng.integers(0, 50_000, num_tokens).tolist()
        batch.append(RequestState(f"r{i}", tokens, max(1, num_tokens - 3), SamplingParams(), i, frozenset(),
                                  blocks, num_computed))
        scheduled[f"r{i}"] = num_new
    return batch, scheduled


@pytest.mark.parametrize("seed, num_requests, block_size", [(0, 1, 4), (1, 7, 4), (2, 33, 16), (3, 64, 1)])
def test_host_inputs_match_the_per_token_loop(seed, num_requests, block_size):
    batch, scheduled = random_batch(np.random.default_rng(seed), num_requests, block_size)
    host = build_host_inputs(batch, scheduled, block_size)
    expected = reference_inputs(batch, scheduled, block_size)
    for name, values in expected.items():
        array = getattr(host, name)
        assert array.tolist() == values, name
    assert [host.input_ids.dtype, host.slot_mapping.dtype, host.seq_lens.dtype, host.block_tables.dtype] == \
        [np.int64, np.int64, np.int32, np.int32]
    assert [s.request_id for s in host.sampled_states] == \
        [s.request_id for s in batch if s.num_computed_tokens + scheduled[s.request_id] == len(s.token_ids)]
    assert host.is_decode_only == all(n == 1 for n in scheduled.values())


def test_decode_step_samples_every_token_and_meta_matches():
    batch = [RequestState(f"r{i}", list(range(10 + i)), 5, SamplingParams(), 0, frozenset(), [3 * i, 3 * i + 1,
                          3 * i + 2], 9 + i) for i in range(3)]
    host = build_host_inputs(batch, {s.request_id: 1 for s in batch}, 4)
    assert host.is_decode_only and host.samples_every_token
    meta = prepare_inputs(batch, {s.request_id: 1 for s in batch}, 4, torch.device("cpu")).attn_metadata
    assert meta.is_decode_only and meta.num_requests == 3 and meta.max_seq_len == 12
    assert meta.seq_lens_cpu == [10, 11, 12] and meta.query_start_loc_cpu == [0, 1, 2, 3]
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 5 * 4 + 2, 8 * 4 + 3]  # third block of each


def test_scheduler_diffs_extend_the_block_table():
    params = SamplingParams()
    new = NewRequestData("a", (1, 2, 3), 3, params, 0, frozenset(), (7,), 0)
    states: dict[str, RequestState] = {}
    apply_scheduler_output(states, SchedulerOutput((new,), (), {"a": 3}, frozenset()))
    assert states["a"].block_ids.tolist() == [7] and states["a"].block_ids.dtype == np.int32
    diff = CachedRequestData("a", (4,), (9, 2), 3)
    (state,) = apply_scheduler_output(states, SchedulerOutput((), (diff,), {"a": 1}, frozenset()))
    assert state.block_ids.tolist() == [7, 9, 2] and state.token_ids == [1, 2, 3, 4]
    apply_scheduler_output(states, SchedulerOutput((), (), {}, frozenset({"a"})))
    assert states == {}


@pytest.mark.parametrize("seed, num_requests, block_size", [(4, 9, 4), (5, 40, 16)])
def test_pending_tokens_are_filled_on_the_device_from_the_last_samples(seed, num_requests, block_size):
    """With async scheduling a request's last token may still be on the device (sampled by the last
    step, at some row of its sampled ids): the host leaves 0 there and the device copies it in."""
    rng = np.random.default_rng(seed)
    batch, scheduled = random_batch(rng, num_requests, block_size)
    expected = reference_inputs(batch, scheduled, block_size)
    expected_sampled = [s.request_id for s in batch if s.num_computed_tokens + scheduled[s.request_id] == len(s.token_ids)]
    last_sampled = torch.from_numpy(rng.integers(0, 50_000, 64))  # the last step's ids (unrelated rows too)
    hidden, rows = [], iter(rng.permutation(64).tolist())
    for state in batch:
        if state.num_computed_tokens + scheduled[state.request_id] == len(state.token_ids) and rng.random() < 0.7:
            state.sampled_row = next(rows)
            last_sampled[state.sampled_row] = state.token_ids.pop()  # its last token is pending
            state.num_pending_tokens = 1
            hidden.append(state.request_id)
    assert hidden
    host = build_host_inputs(batch, scheduled, block_size)
    assert [s.request_id for s in host.sampled_states] == expected_sampled
    assert len(host.pending_rows) == len(hidden) and host.input_ids[host.pending_rows].tolist() == [0] * len(hidden)
    assert set(host.pending_rows.tolist()) <= set(host.logits_indices.tolist())  # a pending token is a last one
    inputs = to_device(host, StagingBuffer(torch.device("cpu")))
    inputs.pending.fill(inputs.input_ids, last_sampled)
    assert inputs.input_ids.tolist() == expected["input_ids"]
    assert inputs.positions.tolist() == expected["positions"] and inputs.logits_indices.tolist() == host.logits_indices.tolist()
    assert inputs.attn_metadata.block_tables.tolist() == expected["block_tables"]


def test_a_token_view_reads_as_the_copy_it_stands_for():
    """A view of a request's tokens from a start on, then extra ones: every length, index, slice and iteration is
    the list it saves copying."""
    from shardserve.runtime.worker.inputs import TokenView

    tokens = list(range(10, 30))
    for start, extra in ((0, ()), (1, ()), (1, (7, 8, 9)), (0, (5,)), (20, (1, 2))):
        copy, view = tokens[start:] + list(extra), TokenView(tokens, start, extra)
        assert len(view) == len(copy) and list(view) == copy
        assert [view[i] for i in range(-len(copy), len(copy))] == copy + copy
        assert all(view[a:b] == copy[a:b] for a in range(-3, len(copy) + 2) for b in range(-3, len(copy) + 2))
