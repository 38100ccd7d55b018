"""A trace replayed through the engine's own scheduler and block manager (runtime/core/replay.py), each step timed
by a replica's cycle: the times follow the scheduling decisions (chunked prefill, the prefix cache, queueing,
preemption). The replica here times a step as 10 ms plus 0.1 ms per prompt token and 1 ms per decoding request,
so each expectation is worked out by hand."""

from __future__ import annotations

import pytest

from shardserve.planner.operators import Chunk
from shardserve.planner.serving import Replica
from shardserve.planner.trace import TraceRequest
from shardserve.runtime.core.replay import EngineShape, replay
from shardserve.runtime.core.scheduler_config import SchedulerConfig


def cycle_ms(b: int, chunks: tuple[Chunk, ...], context: int, drafts: int = 0) -> float:
    return 10.0 + 0.1 * sum(c.tokens for c in chunks) + 1.0 * b + 0.1 * drafts


REPLICA = Replica(cycle_ms, max_num_seqs=8, max_num_batched_tokens=64, kv_cache_tokens=4096)


def shape(num_blocks: int = 256, max_num_seqs: int = 8, replicas: int = 1) -> EngineShape:
    return EngineShape(SchedulerConfig(max_num_seqs, 64), num_blocks, 16, True, 2048, replicas)


def test_one_request_prefills_in_chunks_then_decodes_a_token_a_step():
    """100 prompt tokens under a budget of 64: chunks of 64 and 36 (the second samples the first token), then a
    step per token."""
    (served,) = replay((TraceRequest(0.0, 100, 4),), REPLICA, shape())
    prefill = (10 + 6.4) + (10 + 3.6)
    assert served.ttft_s * 1000 == pytest.approx(prefill)
    assert [round((b - a) * 1000, 6) for a, b in zip(served.token_times, served.token_times[1:])] == [11.0] * 3
    assert served.tpot_s * 1000 == pytest.approx(11.0)
    assert served.e2e_s * 1000 == pytest.approx(prefill + 33)


def test_a_shared_prefix_is_not_computed_again():
    """The second request's first 48 tokens are the first's (three full blocks of 16): its prefill computes the
    other 16 only, where a request of the same lengths without the prefix computes all 64."""
    first, shared, alone = replay((TraceRequest(0.0, 64, 2, "sys", 48), TraceRequest(1.0, 64, 2, "sys", 48),
                                   TraceRequest(2.0, 64, 2)), REPLICA, shape())
    assert first.ttft_s * 1000 == pytest.approx(10 + 6.4)
    assert shared.ttft_s * 1000 == pytest.approx(10 + 1.6)
    assert alone.ttft_s * 1000 == pytest.approx(10 + 6.4)


def test_requests_past_max_num_seqs_queue():
    """Eight requests at once on a replica that runs two: the later ones wait for the earlier ones to end."""
    served = replay(tuple(TraceRequest(0.0, 16, 8) for _ in range(8)), REPLICA, shape(max_num_seqs=2))
    ttfts = [s.ttft_s for s in served]
    assert ttfts[0] == ttfts[1] < ttfts[2] == ttfts[3] < ttfts[4]
    assert ttfts[2] >= served[0].e2e_s  # they entered when the first two had left


def test_a_pool_too_small_for_everyone_preempts_and_still_serves_each_request_whole():
    served = replay(tuple(TraceRequest(0.0, 60, 40) for _ in range(6)), REPLICA, shape(num_blocks=16))
    assert [len(s.token_times) for s in served] == [40] * 6
    roomy = replay(tuple(TraceRequest(0.0, 60, 40) for _ in range(6)), REPLICA, shape())
    assert max(s.e2e_s for s in served) > max(s.e2e_s for s in roomy)


def test_replicas_share_the_requests_and_a_prefix_stays_on_one():
    requests = tuple(TraceRequest(0.0, 32, 4, "p" if i % 2 else None, 16 if i % 2 else 0) for i in range(8))
    one, two = replay(requests, REPLICA, shape()), replay(requests, REPLICA, shape(replicas=2))
    assert max(s.e2e_s for s in two) < max(s.e2e_s for s in one)
    assert len(two) == len(requests) and all(len(s.token_times) == 4 for s in two)


def test_the_replay_schedules_as_the_engine_does():
    """plan = launch down to the scheduling decisions: the demo engine on the CPU and the replay, given the same
    requests (a shared prefix among them), the same budgets and the same KV pool (small enough to preempt), put
    each request's every token in the same step."""
    from shardserve.launch.demo import DEMO_MODEL_DIR
    from shardserve.runtime.llm import LLM
    from shardserve.runtime.sampling_params import SamplingParams

    requests = tuple(TraceRequest(0.0, 20 + 7 * i, 6 + 3 * (i % 4), "sys" if i % 3 == 0 else None,
                                  16 if i % 3 == 0 else 0) for i in range(10))
    llm = LLM(str(DEMO_MODEL_DIR), device="cpu", max_num_seqs=4, max_num_batched_tokens=48, max_model_len=128,
              kv_cache_memory_bytes=12 * 65536, async_scheduling=False, enable_prefix_caching=True)
    try:
        info = llm.kv_cache_info
        for i, r in enumerate(requests):
            shared = [7] * r.prefix_len  # in the demo's vocabulary: what matters is which requests share what
            own = [100 + i] * (r.input_len - r.prefix_len)
            llm.add_request(str(i), {"prompt_token_ids": shared + own},
                            SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0))
        engine_steps: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
        step = 0
        while llm.has_unfinished_requests():
            step += 1
            for delta in llm.step():
                engine_steps[delta.prompt_id].extend([step] * sum(len(s.new_token_ids) for s in delta.samples))
        preemptions = llm.engine.scheduler.num_preemptions
    finally:
        llm.shutdown()
    one_ms_a_step = Replica(lambda b, chunks, context, drafts=0: 1.0, 4, 48, info.num_blocks * info.block_size)
    shape_ = EngineShape(SchedulerConfig(4, 48), info.num_blocks, info.block_size, True, 128)
    replayed = [[round(t * 1000) for t in s.token_times] for s in replay(requests, one_ms_a_step, shape_)]
    assert preemptions > 0  # (the pool is small enough that the test covers preemption)
    assert replayed == [engine_steps[str(i)] for i in range(len(requests))]


def test_a_closed_loop_sends_the_next_request_as_one_finishes():
    """Two in flight (vLLM's --max-concurrency 2) over six like requests: pairs one after another, each sent when
    the one before it finished, its TTFT counted from then. One step prefills both (10 + 3.2 ms), then three decode
    steps of 12 ms: a pair takes 49.2 ms."""
    requests = tuple(TraceRequest(5.0, 16, 4) for _ in range(6))  # (a closed loop reads no arrival times)
    served = replay(requests, REPLICA, shape(), concurrency=2)
    assert [round(s.arrival_s * 1000, 6) for s in served] == [0, 0, 49.2, 49.2, 98.4, 98.4]
    assert all(s.ttft_s * 1000 == pytest.approx(13.2) and s.e2e_s * 1000 == pytest.approx(49.2) for s in served)
    assert replay(requests, REPLICA, shape(), concurrency=10)[-1].arrival_s == 0  # more than the list: all at once


def test_a_closed_loop_keeps_its_count_in_flight_across_replicas():
    """Requests go to the replicas in turn and the next is sent whichever replica finished one: never more than
    the loop's count in flight at once."""
    requests = tuple(TraceRequest(0.0, 16 + 8 * (i % 3), 2 + i % 5) for i in range(12))
    served = replay(requests, REPLICA, shape(replicas=2), concurrency=3)
    assert all(len(s.token_times) == r.output_len for s, r in zip(served, requests))
    for s in served:
        in_flight = sum(1 for o in served if o.arrival_s <= s.arrival_s < o.token_times[-1])
        assert in_flight <= 3
    assert sorted(s.arrival_s for s in served)[:3] == [0.0] * 3 and served[3].arrival_s > 0
    with pytest.raises(ValueError, match="at least 1"):
        replay(requests, REPLICA, shape(), concurrency=0)
