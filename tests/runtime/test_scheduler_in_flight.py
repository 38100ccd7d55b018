"""Pipelined scheduling: requests in a batch still in flight are neither rescheduled nor preempted."""

from __future__ import annotations

from shardserve.runtime.core.messages import ModelRunnerOutput, SchedulerOutput
from shardserve.runtime.core.scheduler import Scheduler
from test_scheduler import make_requests, make_scheduler, sampled_by


def sampled_for(scheduler: Scheduler, output: SchedulerOutput) -> ModelRunnerOutput:
    return sampled_by(scheduler, output)


def test_two_batches_in_flight_share_the_requests():
    scheduler = make_scheduler()
    for request in make_requests(4, prompt_len=5, max_tokens=3):
        scheduler.add_request(request)
    first = scheduler.schedule(max_num_requests=2)
    second = scheduler.schedule(max_num_requests=2)
    assert set(first.num_scheduled_tokens).isdisjoint(second.num_scheduled_tokens)
    assert len(first.num_scheduled_tokens) == len(second.num_scheduled_tokens) == 2
    assert scheduler.schedule().is_empty  # everything is in flight
    scheduler.update_from_output(first, sampled_for(scheduler, first))
    third = scheduler.schedule()
    assert set(third.num_scheduled_tokens) == set(first.num_scheduled_tokens)  # back from flight: decode
    scheduler.block_manager.check_integrity()


def test_in_flight_requests_are_never_preempted():
    scheduler = make_scheduler(num_blocks=7, block_size=4)  # 28 slots: not enough for both to finish
    for request in make_requests(2, prompt_len=8, max_tokens=20):
        scheduler.add_request(request)
    first = scheduler.schedule(max_num_requests=1)  # r0 (newest is r1) stays in flight throughout
    assert set(first.num_scheduled_tokens) == {"r0"}
    second = scheduler.schedule(max_num_requests=1)
    scheduler.update_from_output(second, sampled_for(scheduler, second))
    for _ in range(16):  # r1 decodes until blocks run out; the only victim allowed is r1 itself
        output = scheduler.schedule()
        assert "r0" not in output.num_scheduled_tokens
        scheduler.update_from_output(output, sampled_for(scheduler, output))
        scheduler.block_manager.check_integrity()
    assert scheduler.num_preemptions >= 1
    assert scheduler.requests["r0"].status.name == "RUNNING"
    assert scheduler.requests["r1"].status.name == "PREEMPTED"
    scheduler.update_from_output(first, sampled_for(scheduler, first))  # r0 lands: the rest can go on
    while scheduler.has_unfinished_requests:
        output = scheduler.schedule()
        scheduler.update_from_output(output, sampled_for(scheduler, output))
    assert scheduler.block_manager.num_free_blocks == 7
