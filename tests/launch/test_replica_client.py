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
