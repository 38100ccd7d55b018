"""The asynchronous engine: concurrent streams of deltas, and abort freeing everything."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from shardserve.runtime import LLM, AsyncEngine, SamplingParams

PROMPTS = [{"prompt_token_ids": [7 + i, 30, 31 + i, 90] * (i + 1)} for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(checkpoint_factory):
    return checkpoint_factory("llama3")[0]


def make_engine(folder):
    return AsyncEngine(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4)


async def collect(engine, prompt, params, prompt_id):
    deltas = []
    async for delta in engine.generate(prompt, params, prompt_id):
        deltas.append(delta)
    return deltas


def test_concurrent_streams_match_offline_generate(folder):
    offline = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22).generate(PROMPTS, GREEDY)

    async def main():
        engine = make_engine(folder)
        try:
            return await asyncio.gather(*(collect(engine, p, GREEDY, f"req-{i}") for i, p in enumerate(PROMPTS)))
        finally:
            await engine.shutdown()

    streams = asyncio.run(main())
    for stream, expected in zip(streams, offline):
        samples = [delta.samples[0] for delta in stream]
        assert [len(s.new_token_ids) for s in samples] == [1] * 8  # one new token per step, nothing repeated
        assert [d.finished for d in stream] == [False] * 7 + [True]
        assert [t for s in samples for t in s.new_token_ids] == expected.outputs[0].token_ids
        assert "".join(s.new_text for s in samples) == expected.outputs[0].text


def test_text_prompts_are_processed_while_steps_detokenize_with_one_tokenizer(folder):
    """One tokenizer per process: prompts are tokenized on the loop while the step thread detokenizes
    with the same tokenizer, and every text is what offline generate gives."""
    texts = [f"Once upon a time {i}" for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    offline = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22).generate(texts, params)

    async def main():
        engine = make_engine(folder)
        assert engine.input_processor.tokenizer is engine.engine.tokenizer
        try:
            long = asyncio.ensure_future(collect(engine, "The function returns", GREEDY, "long"))
            streams = []
            for i, text in enumerate(texts):  # each one arrives while the others decode
                streams.append(asyncio.ensure_future(collect(engine, text, params, f"text-{i}")))
                await asyncio.sleep(0.01)
            return await asyncio.gather(*streams), await long
        finally:
            await engine.shutdown()

    streams, _ = asyncio.run(main())
    for stream, expected in zip(streams, offline):
        assert "".join(d.samples[0].new_text for d in stream) == expected.outputs[0].text


def test_abort_frees_every_block_and_ends_the_stream(folder):
    async def main():
        engine = make_engine(folder)
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        seen = []

        async def consume():
            async for output in engine.generate(PROMPTS[3], long, "victim"):
                seen.append(output)

        task = asyncio.create_task(consume())
        other = asyncio.create_task(collect(engine, PROMPTS[0], GREEDY, "bystander"))
        while len(seen) < 3:
            await asyncio.sleep(0.001)
        during = engine.engine.get_stats()
        assert during.num_running >= 1 and during.kv_cache_usage > 0
        await engine.abort("victim")
        await asyncio.wait_for(task, timeout=30)  # the stream ended instead of hanging
        bystander = await other
        pool = engine.engine.block_manager
        pool.check_integrity()
        assert engine.engine.get_stats().kv_cache_usage == 0.0
        state = (pool.num_free_blocks, engine.kv_cache_info.num_blocks, len(seen), bystander[-1].finished)
        await engine.shutdown()
        return state

    free, total, num_seen, bystander_finished = asyncio.run(main())
    assert free == total and 3 <= num_seen < 200 and bystander_finished


def test_consumer_leaving_early_aborts_the_request(folder):
    async def main():
        engine = make_engine(folder)
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        async with aclosing(engine.generate(PROMPTS[1], long, "leaver")) as stream:
            num_tokens = 0
            async for delta in stream:
                num_tokens += len(delta.samples[0].new_token_ids)
                if num_tokens == 2:
                    break
        await collect(engine, PROMPTS[0], GREEDY, "after")  # lets the loop apply the abort
        scheduler = engine.engine.scheduler
        state = (scheduler.has_unfinished_requests, engine.engine.block_manager.num_free_blocks,
                 engine.kv_cache_info.num_blocks)
        await engine.shutdown()
        return state

    unfinished, free, total = asyncio.run(main())
    assert not unfinished and free == total


def test_bad_request_fails_only_its_stream(folder):
    async def main():
        engine = make_engine(folder)
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, {"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=10**6), "bad")
        good = await collect(engine, PROMPTS[0], GREEDY, "good")
        await engine.shutdown()
        return good

    assert asyncio.run(main())[-1].finished
