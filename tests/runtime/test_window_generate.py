"""Generation with KV blocks freed behind the window: greedy tokens equal transformers' while freed
blocks are reused by other requests, with prefix caching and preemption in play."""

from __future__ import annotations

import pytest

from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.worker.worker import check_uniform_window
from test_runtime_matches_transformers import SHARED, random_prompts, reference, token_outputs

MAX_TOKENS = 24
PROMPTS = random_prompts(11, [3, 9, 17, 30, 6, 22]) + SHARED[:4]


@pytest.mark.parametrize("num_blocks, prefix_caching", [(12, True), (7, False)])
def test_window_freeing_matches_transformers(num_blocks, prefix_caching, checkpoint_factory, kv_bytes_for):
    """10 requests of up to 31 + 24 tokens (14 blocks each without freeing) in a pool of 12 or 7 blocks;
    the window is 8 tokens, 2 or 3 blocks of 4."""
    folder, hf_model = checkpoint_factory("mistral-window")
    expected = reference(hf_model, PROMPTS, MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(folder, device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
             enable_prefix_caching=prefix_caching, kv_cache_memory_bytes=kv_bytes_for(folder, num_blocks, 4)) as llm:
        pool, scheduler = llm.engine.block_manager, llm.engine.scheduler
        assert pool.sliding_window == 8 and llm.kv_cache_info.blocks_per_request == 5
        reused = spy_reuse(llm)
        outputs = token_outputs(llm, PROMPTS, params)
        assert reused, "no freed block was ever taken by another running request"
        assert [out[:len(ref)] for out, ref in zip(outputs, expected)] == expected
        pool.check_integrity()
        assert pool.num_free_blocks == num_blocks
        if prefix_caching:
            assert scheduler.num_prefix_hit_tokens > 0
        else:
            assert scheduler.num_preemptions > 0


def spy_reuse(llm: LLM) -> list[str]:
    """After every step, note a request whose table still names a block it freed that another running
    request now holds (the stale entry the kernels must never read)."""
    engine, found = llm.engine, []
    step = engine.step

    def spying_step():
        deltas = step()
        pool = engine.block_manager
        running = [r.request_id for r in engine.scheduler.running]
        for request_id in running:
            table, held = pool.block_ids(request_id), pool.held_block_ids(request_id)
            stale = set(table[:len(table) - len(held)])
            if any(stale & set(pool.held_block_ids(other)) for other in running if other != request_id):
                found.append(request_id)
        return deltas

    engine.step = spying_step
    return found


def test_a_window_on_some_layers_frees_nothing(checkpoint_factory, kv_bytes_for):
    folder, _ = checkpoint_factory("qwen2-window")  # layer 0 attends over everything
    with LLM(folder, device="cpu", block_size=4, kv_cache_memory_bytes=kv_bytes_for(folder, 80, 4)) as llm:
        assert llm.engine.block_manager.sliding_window is None


def test_a_model_that_would_read_freed_blocks_is_refused():
    layers = [Attention(2, 8, 0.3, 2, sliding_window=8), Attention(2, 8, 0.3, 2, sliding_window=None)]
    with pytest.raises(ValueError, match=r"sliding window of 8 tokens, but this model's attention layers use \[None\]"):
        check_uniform_window(layers, 8)
    check_uniform_window(layers[:1], 8)
    check_uniform_window(layers, None)


@pytest.mark.parametrize("max_model_len", [64, "auto"])
def test_plan_predicts_the_runtimes_blocks_and_concurrency(max_model_len, checkpoint_factory, kv_bytes_for):
    """plan = launch with a window: the planner's blocks per request, concurrency and auto length
    are the engine's, for the same settings on CPU."""
    from tests.planner.factories import plan_for

    folder, _ = checkpoint_factory("mistral-window")
    settings = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=max_model_len,
                    kv_cache_memory_bytes=kv_bytes_for(folder, 9, 4))
    plan = plan_for(folder, "cpu", **settings).record()
    with LLM(folder, device="cpu", **settings) as llm:
        info = llm.kv_cache_info
    assert plan.memory.num_blocks == info.num_blocks == 9
    assert plan.runtime.max_model_len == info.max_model_len == (64 if max_model_len == 64 else 256)
    assert plan.memory.max_concurrency == round(info.max_concurrency, 2) == round(9 / 5, 2)
