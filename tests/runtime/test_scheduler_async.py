"""Async scheduling with a stand-in model: step N+1 is scheduled before step N's tokens are back, and
finishes (max_tokens, EOS, aborts) and preemption are learned one step late without breaking budgets,
lengths or the block pool."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest

from shardserve.runtime.core.messages import ModelRunnerOutput, SchedulerOutput
from shardserve.runtime.core.request import Request, RequestStatus
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.core.scheduler import Scheduler
from test_scheduler import SAMPLED, make_requests, make_scheduler, sampled_by

EOS = 1


def make_async_scheduler(**kwargs) -> Scheduler:
    scheduler = make_scheduler(**kwargs)
    scheduler.config = replace(scheduler.config, async_scheduling=True)
    return scheduler


def run_async(scheduler: Scheduler, token_for=lambda request, index: SAMPLED, on_step=None,
              max_steps: int = 500) -> list[SchedulerOutput]:
    """The engine's loop with two steps in flight: schedule and submit N+1, then update from N. A
    step's tokens are decided when it is submitted (token_for(request, output index)), as a device would."""
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    outputs = []
    while scheduler.has_unfinished_requests or in_flight:
        output = scheduler.schedule()
        if not output.is_empty or output.finished_request_ids:
            result = sampled_by(scheduler, output)
            result.sampled_token_ids = {
                rid: token_for(scheduler.requests[rid], scheduler.requests[rid].num_output_tokens
                               + scheduler.requests[rid].num_pending_tokens - 1)
                for rid in result.sampled_token_ids}
            in_flight.append((output, result))
            outputs.append(output)
        if len(in_flight) == 2 or (in_flight and output.is_empty):
            scheduler.update_from_output(*in_flight.popleft())
        scheduler.block_manager.check_integrity()
        if on_step is not None:
            on_step(len(outputs))
        assert len(outputs) < max_steps, "scheduler stopped making progress"
    return outputs


def test_a_request_in_flight_is_scheduled_again_for_its_pending_token():
    scheduler = make_async_scheduler()
    requests = make_requests(3, prompt_len=5, max_tokens=4)
    for request in requests:
        scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()  # nothing is back yet: every request decodes its pending token
    assert second.num_scheduled_tokens == {r.request_id: 1 for r in requests}
    assert all(r.num_pending_tokens == 2 and r.num_output_tokens == 0 for r in requests)
    assert [d.new_token_ids for d in second.cached_requests] == [(), (), ()]  # the ids are on the device
    scheduler.update_from_output(first, ModelRunnerOutput({r.request_id: 40 + i for i, r in enumerate(requests)}))
    third = scheduler.schedule()
    assert [d.new_token_ids for d in third.cached_requests] == [(40,), (41,), (42,)]  # one step late
    assert all(r.num_pending_tokens == 2 and r.num_computed_tokens == 7 for r in requests)


def test_max_tokens_is_never_overrun_and_budgets_hold():
    scheduler = make_async_scheduler(max_num_batched_tokens=10, max_num_seqs=3)
    requests = [Request(f"r{i}", [10 + i] * (3 + 2 * i), SamplingParams(max_tokens=1 + i % 4), seed=i)
                for i in range(7)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run_async(scheduler)
    for output in outputs:
        assert output.total_num_scheduled_tokens <= 10 and len(output.num_scheduled_tokens) <= 3
    for request in requests:  # every token computed once: the last sampled token is never fed back
        scheduled = sum(o.num_scheduled_tokens.get(request.request_id, 0) for o in outputs)
        assert scheduled == request.num_prompt_tokens + request.sampling_params.max_tokens - 1
        assert request.output_token_ids == [SAMPLED] * request.sampling_params.max_tokens
        assert request.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_an_eos_learned_late_drops_the_token_sampled_after_it():
    scheduler = make_async_scheduler()
    early, late = Request("early", [5] * 6, SamplingParams(max_tokens=20), 0, frozenset({EOS})), \
        Request("late", [6] * 6, SamplingParams(max_tokens=5), 1, frozenset({EOS}))
    scheduler.add_request(early)
    scheduler.add_request(late)
    outputs = run_async(scheduler, token_for=lambda r, index: EOS if r is early and index == 2 else SAMPLED)
    assert early.output_token_ids == [SAMPLED, SAMPLED, EOS] and early.status is RequestStatus.FINISHED_STOPPED
    steps_with_early = [o for o in outputs if "early" in o.num_scheduled_tokens]
    assert len(steps_with_early) == 4  # prefill, 2 decodes, and one whose token was dropped
    assert late.output_token_ids == [SAMPLED] * 5
    finished = [o for o in outputs if "early" in o.finished_request_ids]
    assert len(finished) == 1 and outputs.index(finished[0]) > outputs.index(steps_with_early[-1])


def test_an_abort_mid_flight_frees_blocks_and_drops_its_tokens():
    scheduler = make_async_scheduler()
    requests = make_requests(3, prompt_len=6, max_tokens=12)
    for request in requests:
        scheduler.add_request(request)

    def abort_r1(num_steps):
        if num_steps == 4 and "r1" in scheduler.requests:
            scheduler.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)

    run_async(scheduler, on_step=abort_r1)
    assert requests[1].status is RequestStatus.FINISHED_ABORTED and 0 < requests[1].num_output_tokens < 12
    assert requests[0].num_output_tokens == requests[2].num_output_tokens == 12
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_requests_in_flight_may_be_preempted_and_finish_after_recompute():
    scheduler = make_async_scheduler(num_blocks=9, block_size=4)  # 36 slots for 3 x (8 + 10) tokens
    requests = make_requests(3, prompt_len=8, max_tokens=10)
    for request in requests:
        scheduler.add_request(request)
    # the i-th output token of every request is 20 + i, wherever (and however often) it is sampled
    run_async(scheduler, token_for=lambda request, index: 20 + index)
    assert scheduler.num_preemptions > 0
    for request in requests:
        assert request.output_token_ids == list(range(20, 30))
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_an_aborted_request_id_is_refused_until_its_step_is_back():
    scheduler = make_async_scheduler()
    (request,) = make_requests(1, prompt_len=5, max_tokens=4)
    scheduler.add_request(request)
    output = scheduler.schedule()
    result = sampled_by(scheduler, output)
    scheduler.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    again = Request("r0", [3] * 5, SamplingParams(max_tokens=4), seed=0)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(again)
    assert result.sampled_token_ids == {"r0": SAMPLED}
    assert scheduler.update_from_output(output, result) == []  # the token is dropped
    scheduler.add_request(again)
    scheduler.block_manager.check_integrity()
