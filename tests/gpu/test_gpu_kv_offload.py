"""The CPU tier of the KV cache on a GPU: pinned host slots, copies on the stream, CUDA graphs and async
scheduling around them; the same tokens as a pool large enough to never evict, with prefixes loaded back."""

from __future__ import annotations

import pytest

from shardserve.runtime import LLM, SamplingParams
from test_gpu_model import PROMPTS

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def one_at_a_time(llm, rounds: int = 2) -> list[list[int]]:
    """Each prompt alone, every prompt twice: a small pool has evicted a prompt's blocks by its second turn."""
    return [llm.generate([{"prompt_token_ids": p}], PARAMS)[0].outputs[0].token_ids
            for _ in range(rounds) for p in PROMPTS]


def llm_for(folder: str, enforce_eager: bool, is_async: bool, max_model_len: int, **kwargs) -> LLM:
    return LLM(folder, dtype="bfloat16", device="cuda", max_model_len=max_model_len, max_num_seqs=8, block_size=16,
               enforce_eager=enforce_eager, skip_tokenizer_init=True, async_scheduling=is_async, **kwargs)


@pytest.mark.parametrize("enforce_eager, is_async", [(True, False), (False, False), (False, True)])
def test_loaded_prefixes_decode_the_same_tokens(enforce_eager, is_async, gpu_checkpoint):
    """Against a pool that never evicts: its second round hits the same blocks in GPU memory that the
    small pool's loads bring back, so both compute exactly the same tokens."""
    folder = gpu_checkpoint("llama")[0]
    longest = max(len(p) for p in PROMPTS) + PARAMS.max_tokens
    with llm_for(folder, enforce_eager, is_async, longest, kv_cache_memory_bytes=256 << 20) as llm:
        expected = one_at_a_time(llm)
        bytes_per_block = llm.engine.executor.bytes_per_block()
        hits = llm.engine.get_stats().num_prefix_hit_tokens
    small = (longest // 16 + 2) * bytes_per_block
    with llm_for(folder, enforce_eager, is_async, longest, kv_cache_memory_bytes=small, kv_offloading_size=0.25) as llm:
        assert llm.engine.executor.worker.offload_cache.is_pinned()
        assert one_at_a_time(llm) == expected
        stats = llm.engine.get_stats()
        assert stats.num_offload_hit_tokens >= 16 * len(PROMPTS)  # every prompt's second turn loads blocks
        assert stats.num_prefix_hit_tokens + stats.num_offload_hit_tokens == hits
        llm.engine.block_manager.check_integrity()
