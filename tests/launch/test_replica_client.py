"""One replica process seen through its EngineCoreClient, without the HTTP server: the deltas match an
in-process engine's, an abandoned prompt is aborted in the replica, a rank dying inside the replica
marks it dead, and shutdown leaves no process behind."""

import asyncio
import os
import signal
import time

import pytest

from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.runtime.core.client import start_replicas
from shardserve.launch.server.replicas import ReplicaSet
from shardserve.runtime import AsyncEngine, EngineArgs, SamplingParams
from shardserve.runtime.errors import EngineDeadError

from tests.processes import children, wait_gone

pytestmark = pytest.mark.slow  # every test here starts a process

KWARGS = {"device": "cpu", "kv_cache_memory_bytes": 32 << 20, "max_model_len": 512}
PROMPTS = ["The function returns", "Once upon a time", "def main():"]


async def _tokens(engine, processor, prompt_id: str, prompt: str, max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    processed = processor.process(prompt, params)
    tokens = []
    async for delta in engine.generate(processed, params, prompt_id):
        tokens += delta.samples[0].new_token_ids
    return tokens


async def _serve_and_abort(replica) -> tuple[list[list[int]], int]:
    replica.start()
    processor = ReplicaSet([replica]).input_processor  # the server's one, as the server uses it
    outputs = await asyncio.gather(*(_tokens(replica, processor, f"p{i}", p, 12) for i, p in enumerate(PROMPTS)))
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    stream = replica.generate(processor.process("Long", params), params, "long")
    await stream.__anext__()
    await stream.aclose()  # the consumer goes away
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and replica.get_stats().num_running:
        await asyncio.sleep(0.1)
    num_running = replica.get_stats().num_running
    await replica.shutdown()
    return outputs, num_running


async def _in_process() -> list[list[int]]:
    engine = AsyncEngine(str(DEMO_MODEL_DIR), **KWARGS)
    try:
        return await asyncio.gather(*(_tokens(engine, engine.input_processor, f"p{i}", p, 12)
                                      for i, p in enumerate(PROMPTS)))
    finally:
        await engine.shutdown()


def test_a_replica_process_gives_the_in_process_tokens_and_aborts_what_is_dropped():
    (replica,) = start_replicas(EngineArgs(str(DEMO_MODEL_DIR), **KWARGS), 1)
    outputs, num_running = asyncio.run(_serve_and_abort(replica))
    assert outputs == asyncio.run(_in_process())
    assert num_running == 0
    assert replica.core.process.wait(10) == 0 and replica.error is None


async def _until_dead(replica, seconds: float) -> BaseException | None:
    replica.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and replica.error is None:
        await asyncio.sleep(0.1)
    error = replica.error
    await replica.shutdown()
    return error


def test_a_rank_dying_inside_a_replica_marks_it_dead():
    kwargs = KWARGS | {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    (replica,) = start_replicas(EngineArgs(str(DEMO_MODEL_DIR), **kwargs), 1)
    ranks = children(replica.pid, "shardserve.runtime.distributed.worker_process")
    assert len(ranks) == 2, ranks
    os.kill(ranks[1], signal.SIGKILL)
    error = asyncio.run(_until_dead(replica, 30))
    assert isinstance(error, EngineDeadError) and str(error).startswith("replica 0: "), error
    assert wait_gone([replica.pid, *ranks], 15) == [], "a process outlived its replica"


async def _stopped_by_a_stop_string(replica) -> tuple[str, str, float]:
    """Greedy text, then the same prompt with a stop string from early in it and room for 450 tokens:
    (the text, the stopped text, the tokens the core scheduled for the stopped one)."""
    replica.start()
    processor = ReplicaSet([replica]).input_processor
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = "".join([s.new_text async for d in replica.generate(processor.process(PROMPTS[0], greedy), greedy, "full")
                    for s in d.samples])
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip() == text[i:i + 3])
    params = SamplingParams(temperature=0.0, max_tokens=450, ignore_eos=True, stop=stop)
    before = await _idle_stats(replica)
    stopped = "".join([s.new_text async for d in replica.generate(processor.process(PROMPTS[0], params), params,
                                                                   "stopped") for s in d.samples])
    scheduled = (await _idle_stats(replica)).iteration_tokens.total - before.iteration_tokens.total
    await replica.shutdown()
    return text[:text.find(stop)], stopped, scheduled


async def _idle_stats(replica):
    """The core's stats once it reports itself idle (a report comes every half second, and when it turns idle)."""
    deadline = time.monotonic() + 30
    while True:
        await asyncio.sleep(0.6)
        stats = replica.get_stats()
        if not (stats.num_running or stats.num_waiting) or time.monotonic() > deadline:
            return stats


def test_a_stop_string_the_client_finds_stops_the_sample_in_its_core():
    """Text, and so stop strings, are the client's: it tells the core, which stops the sample a step or two
    later, not after its 450 tokens."""
    (replica,) = start_replicas(EngineArgs(str(DEMO_MODEL_DIR), **KWARGS), 1)
    expected, stopped, scheduled = asyncio.run(_stopped_by_a_stop_string(replica))
    assert stopped == expected
    assert scheduled < 100, f"the core scheduled {scheduled:.0f} tokens for a sample stopped after a few"
