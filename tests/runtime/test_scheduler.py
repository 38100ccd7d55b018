"""Scheduler invariants with small factories: budgets, FCFS, chunked prefill, preemption, rejection."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardserve.runtime.core.block_manager import BlockManager
from shardserve.runtime.config import SchedulerConfig
from shardserve.runtime.core.messages import ModelRunnerOutput, SchedulerOutput
from shardserve.runtime.core.request import Request, RequestStatus
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.core.scheduler import Scheduler

SAMPLED = 7  # the token every simulated step samples


def make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128,
                   enable_prefix_caching=False) -> Scheduler:
    pool = BlockManager(num_blocks, block_size, enable_prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, pool, max_model_len)


def make_requests(n: int, prompt_len: int, max_tokens: int = 4, first_token: int = 10) -> list[Request]:
    return [Request(f"r{i}", [first_token + i] * prompt_len, SamplingParams(max_tokens=max_tokens), seed=i)
            for i in range(n)]


def sampled_by(scheduler: Scheduler, output: SchedulerOutput, token: int = SAMPLED) -> ModelRunnerOutput:
    """A stand-in model's output for a step just scheduled: every request the step runs to its end
    (its computed tokens reach the token it samples, pending since the schedule) samples `token`."""
    requests = (scheduler.requests[request_id] for request_id in output.num_scheduled_tokens)
    return ModelRunnerOutput(sampled_token_ids={
        r.request_id: token for r in requests if r.num_computed_tokens == r.num_tokens + r.num_pending_tokens - 1})


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """One step with a stand-in model: every request whose tokens are all computed samples SAMPLED."""
    output = scheduler.schedule()
    scheduler.update_from_output(output, sampled_by(scheduler, output))
    scheduler.block_manager.check_integrity()
    return output


def run_to_completion(scheduler: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests:
        outputs.append(run_step(scheduler))
        assert len(outputs) < max_steps, "scheduler stopped making progress"
    return outputs


def test_budgets_are_respected_every_step():
    scheduler = make_scheduler(max_num_batched_tokens=10, max_num_seqs=3)
    requests = make_requests(6, prompt_len=7)
    for request in requests:
        scheduler.add_request(request)
    for output in run_to_completion(scheduler):
        assert output.total_num_scheduled_tokens <= 10
        assert len(output.num_scheduled_tokens) <= 3
    assert all(r.num_output_tokens == 4 for r in requests)
    assert scheduler.block_manager.num_free_blocks == 64


def test_first_come_first_served_admission():
    scheduler = make_scheduler(max_num_seqs=2)
    for request in make_requests(4, prompt_len=3):
        scheduler.add_request(request)
    first = run_step(scheduler)
    assert [d.request_id for d in first.new_requests] == ["r0", "r1"]
    admitted = []
    for output in run_to_completion(scheduler):
        admitted += [d.request_id for d in output.new_requests]
    assert admitted == ["r2", "r3"]


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_the_end():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    (request,) = make_requests(1, prompt_len=20, max_tokens=2)
    scheduler.add_request(request)
    chunks = []
    while request.num_output_tokens == 0:
        chunks.append(run_step(scheduler).num_scheduled_tokens["r0"])
    assert chunks == [8, 8, 4]
    assert request.num_computed_tokens == 20


def test_decode_shares_the_step_with_a_prefill_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    short, long = make_requests(2, prompt_len=3, max_tokens=8)[0], make_requests(2, prompt_len=30)[1]
    scheduler.add_request(short)
    run_step(scheduler)
    scheduler.add_request(long)
    output = run_step(scheduler)
    assert output.num_scheduled_tokens == {"r0": 1, "r1": 5}


def test_newest_request_is_preempted_and_recomputed():
    # 6 blocks of 4 tokens; each request grows to 8 + 8 = 16 tokens = 4 blocks, so two cannot both finish.
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=4, max_model_len=16)
    requests = make_requests(2, prompt_len=8, max_tokens=8)
    for request in requests:
        scheduler.add_request(request)
    outputs = run_to_completion(scheduler)
    assert scheduler.num_preemptions >= 1
    assert requests[1].num_preemptions >= 1 and requests[0].num_preemptions == 0  # the newer one yields
    assert all(r.output_token_ids == [SAMPLED] * 8 for r in requests)
    resumed = [d for o in outputs for d in o.new_requests if d.request_id == "r1" and len(d.token_ids) > 8]
    assert resumed and resumed[0].num_prompt_tokens == 8  # recomputed with its outputs so far
    assert any("r1" in o.finished_request_ids for o in outputs[:-1])  # the worker was told to drop it
    assert scheduler.block_manager.num_free_blocks == 6


def test_requests_the_pool_can_never_hold_are_rejected_up_front():
    scheduler = make_scheduler(num_blocks=4, max_model_len=32)  # max_model_len is the input processor's check
    too_big = Request("big", [1] * 20, SamplingParams(max_tokens=10), seed=0)
    with pytest.raises(ValueError, match="pool has 4"):
        scheduler.add_request(too_big)
    assert not scheduler.has_unfinished_requests


def test_stop_token_and_min_tokens():
    scheduler = make_scheduler()
    params = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[SAMPLED])
    request = Request("r", [1, 2, 3], params, seed=0)
    scheduler.add_request(request)
    run_to_completion(scheduler)
    assert request.num_output_tokens == 3 and request.status is RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == SAMPLED


def test_abort_frees_everything():
    scheduler = make_scheduler(num_blocks=16, max_num_seqs=2)
    requests = make_requests(3, prompt_len=9, max_tokens=20)
    for request in requests:
        scheduler.add_request(request)
    run_step(scheduler)
    scheduler.finish_requests(["r0", "r2"], RequestStatus.FINISHED_ABORTED)  # one running, one waiting
    assert [r.request_id for r in scheduler.running] == ["r1"] and not scheduler.waiting
    output = run_step(scheduler)
    assert {"r0", "r2"} <= output.finished_request_ids
    scheduler.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.block_manager.num_free_blocks == 16
    scheduler.block_manager.check_integrity()


def test_prefix_cache_hits_skip_computation():
    scheduler = make_scheduler(enable_prefix_caching=True)
    (first,) = make_requests(1, prompt_len=13)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    second = Request("again", [10] * 13, SamplingParams(max_tokens=1), seed=0)
    scheduler.add_request(second)
    output = run_step(scheduler)
    assert output.new_requests[0].num_computed_tokens == 12
    assert output.num_scheduled_tokens == {"again": 1}


@settings(max_examples=40, deadline=None)
@given(num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4]), budget=st.integers(1, 24),
       max_num_seqs=st.integers(1, 6), caching=st.booleans(),
       requests=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=8))
def test_random_workloads_finish_within_budgets(num_blocks, block_size, budget, max_num_seqs, caching, requests):
    """Any workload that passes admission finishes, every step stays within budget and the pool
    stays consistent, whatever the pool size, budget and arrival pattern."""
    max_model_len = min(num_blocks * block_size, 18)
    scheduler = make_scheduler(num_blocks, block_size, budget, max_num_seqs, max_model_len, caching)
    accepted, arrivals = [], {}
    for i, (prompt_len, max_tokens, arrival_step) in enumerate(requests):
        if prompt_len + max_tokens <= max_model_len:
            request = Request(f"r{i}", [i % 2 + 3] * prompt_len, SamplingParams(max_tokens=max_tokens), seed=i)
            arrivals.setdefault(arrival_step, []).append(request)
            accepted.append(request)
    step = 0
    while step <= max(arrivals, default=0) or scheduler.has_unfinished_requests:
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        if scheduler.has_unfinished_requests:
            output = run_step(scheduler)  # checks pool integrity
            assert not output.is_empty, "no progress"
            assert output.total_num_scheduled_tokens <= budget
            assert len(scheduler.running) <= max_num_seqs
        step += 1
        assert step < 2000
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in accepted)
    assert scheduler.block_manager.num_free_blocks == num_blocks
