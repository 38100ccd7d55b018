"""The recurrent layers' state slots: one per running request, freed on finish or preemption, carried in
a step's inputs and, padded with the scratch slot, in a CUDA graph's static inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve.runtime.core.messages import CachedRequestData, NewRequestData, SchedulerOutput
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.worker.cuda_graphs import StaticDecodeInputs, pad_decode_batch
from shardserve.runtime.worker.inputs import RequestState, apply_scheduler_output, build_host_inputs, to_device
from shardserve.runtime.worker.staging import StagingBuffer
from shardserve.runtime.worker.state_slots import StateSlots


def new(request_id: str, num_tokens: int = 3) -> NewRequestData:
    return NewRequestData(request_id, tuple(range(1, num_tokens + 1)), num_tokens, SamplingParams(), 0, frozenset(),
                          (0,), 0)


def step(new_requests=(), cached=(), finished=()) -> SchedulerOutput:
    scheduled = {d.request_id: 3 for d in new_requests} | {d.request_id: 1 for d in cached}
    return SchedulerOutput(tuple(new_requests), tuple(cached), scheduled, frozenset(finished))


def test_a_slot_per_running_request_freed_when_it_finishes_or_is_preempted():
    slots, states = StateSlots(max_num_seqs=3), {}
    batch = apply_scheduler_output(states, step([new("a"), new("b")]), slots)
    assert [s.state_slot for s in batch] == [0, 1] and slots.num_held == 2
    # "a" preempted and back as new in the same step: its old slot is freed before it takes one again
    batch = apply_scheduler_output(states, step([new("a"), new("c")], finished=["a"]), slots)
    assert sorted(s.state_slot for s in batch) == [0, 2] and slots.num_held == 3
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        apply_scheduler_output(states, step([new("d")]), slots)
    apply_scheduler_output(states, step(finished=["a", "b", "c", "never-seen"]), slots)
    assert slots.num_held == 0 and slots.scratch == 3 and slots.num_slots == 4


def test_without_slots_no_request_holds_one():
    states: dict = {}
    batch = apply_scheduler_output(states, step([new("a")]))
    assert batch[0].state_slot == -1
    assert build_host_inputs(batch, {"a": 3}, 4).state_slots is None


def test_the_step_inputs_carry_each_requests_slot():
    slots, states = StateSlots(max_num_seqs=4), {}
    apply_scheduler_output(states, step([new("a"), new("b"), new("c")]), slots)
    apply_scheduler_output(states, step(finished=["b"]), slots)
    cached = [CachedRequestData(r, (), (), 3) for r in ("a", "c")]
    for state in states.values():
        state.token_ids.append(9)
    batch = apply_scheduler_output(states, step(cached=cached), slots)
    host = build_host_inputs(batch, {"a": 1, "c": 1}, 4)
    assert host.state_slots is not None and host.state_slots.tolist() == [0, 2]
    meta = to_device(host, StagingBuffer(torch.device("cpu"))).attn_metadata
    assert meta.state_slots is not None and meta.state_slots.tolist() == [0, 2]


def test_a_graphs_padding_rows_use_the_scratch_slot():
    batch = [RequestState(f"r{i}", [1, 2, 3], 2, SamplingParams(), 0, frozenset(), [i], 2, state_slot=5 - i)
             for i in range(3)]
    host = build_host_inputs(batch, {s.request_id: 1 for s in batch}, 4)
    padded = pad_decode_batch(host, 4, scratch_block=10, block_size=4, scratch_state=8)
    assert padded.state_slots is not None and padded.state_slots.tolist() == [5, 4, 3, 8]
    static = StaticDecodeInputs(8, 32, 4, 10, torch.device("cpu"), scratch_state=8)
    static.load(padded, StagingBuffer(torch.device("cpu")))
    meta = static.metadata(4)
    assert meta.state_slots is not None and meta.state_slots.tolist() == [5, 4, 3, 8]
    assert static.state_slots is not None and static.state_slots[4:].tolist() == [8] * 4
    plain = StaticDecodeInputs(8, 32, 4, 10, torch.device("cpu"))
    plain.load(pad_decode_batch(build_host_inputs([RequestState("x", [1, 2], 1, SamplingParams(), 0, frozenset(),
                                                                [0], 1)], {"x": 1}, 4), 2, 10, 4),
               StagingBuffer(torch.device("cpu")))
    assert plain.metadata(2).state_slots is None and np.array_equal(plain.seq_lens[:2].numpy(), [2, 1])


def test_a_hybrid_of_layers_not_served_is_refused_by_their_kind(tmp_path):
    """At launch as at plan: the kind of layer the runtime lacks is named, before anything loads."""
    import json

    from shardserve.runtime import LLM

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NemotronHForCausalLM"]}))
    with pytest.raises(ValueError, match="architecture NemotronHForCausalLM is not served: Mamba-2 layers"):
        LLM(str(tmp_path), device="cpu")
