"""async_scheduling on the GPU: with CUDA graphs and eagerly, the same tokens as without it (greedy and
seeded), and the host queues step N+1 before it waits for step N's sampled ids."""

from __future__ import annotations

import pytest
import torch

from shardserve.runtime import LLM, SamplingParams
from test_gpu_model import PROMPTS, count_syncs

PARAMS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True)]


def make_llm(folder: str, enforce_eager: bool, is_async: bool, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 256 << 20)
    return LLM(folder, dtype="bfloat16", device="cuda", max_model_len=1024, max_num_seqs=8, block_size=16,
               enforce_eager=enforce_eager, skip_tokenizer_init=True, enable_prefix_caching=False,
               async_scheduling=is_async, **kwargs)


def tokens_of(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_overlap_decodes_the_same_tokens(enforce_eager, params, gpu_checkpoint):
    folder = gpu_checkpoint("llama")[0]
    with make_llm(folder, enforce_eager, False) as llm:
        expected = tokens_of(llm, params)
    with make_llm(folder, enforce_eager, True) as llm:
        assert (llm.engine.executor.worker.cuda_graphs is None) == enforce_eager
        assert tokens_of(llm, params) == expected
    torch.cuda.empty_cache()


def test_overlap_with_preemption_on_a_small_pool(gpu_checkpoint):
    folder = gpu_checkpoint("llama")[0]
    with make_llm(folder, False, False) as llm:
        expected = tokens_of(llm, PARAMS[0])
        bytes_per_block = llm.engine.executor.bytes_per_block()
    small = {"kv_cache_memory_bytes": 48 * bytes_per_block}  # 768 slots for 6 requests up to 624 tokens
    with make_llm(folder, False, True, **small) as llm:
        assert tokens_of(llm, PARAMS[0]) == expected
        assert llm.engine.get_stats().num_preemptions > 0


def test_submitting_a_step_does_not_wait_for_the_device(gpu_checkpoint):
    """Queueing step N+1 makes no synchronizing call: the host is free while the device runs."""
    with make_llm(gpu_checkpoint("llama")[0], False, True) as llm:
        engine, worker = llm.engine, llm.engine.executor.worker
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, PARAMS[0])
        for _ in range(4):  # prefills, then decodes with one step in flight
            engine.step()
        syncs, submit = [], worker.submit

        def counted_submit(output):
            results = []
            syncs.append(count_syncs(lambda: results.append(submit(output))))
            return results[0]

        worker.submit = counted_submit
        for _ in range(6):
            engine.step()
        worker.submit = submit
        assert syncs and max(syncs) == 0
        while engine.has_unfinished_requests():
            engine.step()
