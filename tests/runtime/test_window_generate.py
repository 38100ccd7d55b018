"""Generation with KV blocks freed behind the window: greedy tokens equal transformers' while freed
blocks are reused by other requests, with prefix caching and preemption in play."""

from __future__ import annotations

import pytest
import torch

from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.worker.worker import kv_tensor_of_layers
from shardserve.planner.kv_groups import kv_groups
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
        assert pool.windows == (8,) and llm.kv_cache_info.blocks_per_request == 5
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


@pytest.mark.parametrize("family, windows", [("qwen2-window", (None, 8)), ("gemma3", (None, 8)),
                                             ("gemma2", (None, 8)), ("gpt_oss", (None, 8))])
def test_windowed_layers_hold_only_their_window(family, windows, checkpoint_factory, kv_bytes_for):
    """Full and windowed layers mixed: a block table per kind, the windowed one freed behind its window, in a
    pool too small for every layer to keep every token; greedy tokens still transformers'."""
    folder, hf_model = checkpoint_factory(family)
    expected = reference(hf_model, PROMPTS, MAX_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(folder, device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
             kv_cache_memory_bytes=kv_bytes_for(folder, 30, 4)) as llm:
        pool, scheduler = llm.engine.block_manager, llm.engine.scheduler
        # a request of 64 tokens: 16 pages of the full layers and 5 of the windowed (14 + 2 without freeing)
        assert pool.windows == windows and llm.kv_cache_info.blocks_per_request == 16 + 5
        outputs = token_outputs(llm, PROMPTS, params)
        assert [out[:len(ref)] for out, ref in zip(outputs, expected)] == expected
        pool.check_integrity()
        assert pool.num_free_blocks == 30 and scheduler.num_prefix_hit_tokens > 0


def test_a_model_that_would_read_freed_blocks_is_refused():
    layers = torch.nn.ModuleList([Attention(2, 8, 0.3, 2, sliding_window=8), Attention(2, 8, 0.3, 2, sliding_window=None)])
    model = torch.nn.Module()
    model.layers = layers
    with pytest.raises(ValueError, match=r"gives attention layer layers.1 a window of 8, but the model's layer uses None"):
        kv_tensor_of_layers(model, kv_groups([8, 8]))
    placed = kv_tensor_of_layers(model, kv_groups([8, None]))
    assert [(a.kv_group, tensor) for a, tensor in placed] == [(1, 0), (0, 0)]  # full attention is group 0
    # (a layer with a window where config.json has none reads no freed block: nothing is freed for it)
    assert [tensor for _, tensor in kv_tensor_of_layers(model, kv_groups([None, None]))] == [0, 1]


@pytest.mark.parametrize("family, max_model_len, per_request", [
    ("mistral-window", 64, 5), ("mistral-window", "auto", 5), ("gemma3", 64, 16 + 5), ("gpt_oss", "auto", 64 + 5)])
def test_plan_predicts_the_runtimes_blocks_and_concurrency(family, max_model_len, per_request, checkpoint_factory,
                                                         kv_bytes_for):
    """plan = launch with windows, on every layer or on some (a block table per kind): the planner's blocks per
    request, concurrency, KV tokens and auto length are the engine's, for the same settings on CPU."""
    from tests.planner.factories import plan_for

    folder, _ = checkpoint_factory(family)
    num_blocks = 9 if family == "mistral-window" else 3 * per_request
    settings = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=max_model_len,
                    kv_cache_memory_bytes=kv_bytes_for(folder, num_blocks, 4))
    plan = plan_for(folder, "cpu", **settings).record()
    with LLM(folder, device="cpu", **settings) as llm:
        info = llm.kv_cache_info
    assert plan.memory.num_blocks == info.num_blocks == num_blocks
    assert plan.runtime.max_model_len == info.max_model_len == (64 if max_model_len == 64 else 256)
    assert info.blocks_per_request == per_request and plan.memory.kv_cache_tokens == info.num_tokens
    assert plan.memory.max_concurrency == round(info.max_concurrency, 2) == round(num_blocks / per_request, 2)


def test_the_cpu_tier_is_refused_for_a_table_per_kind(checkpoint_factory):
    from shardserve.planner.settings import SettingError

    folder, _ = checkpoint_factory("gemma3")
    with pytest.raises(SettingError, match="kv_offloading_size is not served for this model"):
        LLM(folder, device="cpu", kv_offloading_size=0.01)
