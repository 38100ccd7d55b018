"""runner='pooling': LLM.embed and AsyncEngine.embed give transformers' last hidden state (AutoModel on the
same weights) pooled LAST, MEAN or CLS and L2-normalized, through chunked prefill, the prefix cache,
tensor and pipeline parallel ranks; the defaults come from a sentence-transformers checkpoint's files."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shardserve.planner.settings import SettingError
from shardserve.runtime import LLM, AsyncEngine, InvalidPromptError, PoolingParams, SamplingParams
from shardserve.runtime.pooling_params import pooler_config, sentence_transformers_pooling
from runtime_checkpoints import pooled_reference, save_sentence_transformers_model
from test_runtime_matches_transformers import random_prompts

# lengths around the block size (4) and the step budget (16 tokens): whole prompts and chunked ones
PROMPTS = random_prompts(11, [1, 3, 4, 9, 16, 17, 30])
SMALL = dict(device="cpu", kv_cache_memory_bytes=2**22, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)


def embeddings(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


@pytest.fixture(scope="module")
def qwen3(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3")
    with LLM(folder, runner="pooling", **SMALL) as llm:
        yield folder, llm


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_pooled_hidden_states_match_transformers(qwen3, pooling_type):
    folder, llm = qwen3
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(pooling_type=pooling_type))
    assert [o.prompt_token_ids for o in outputs] == PROMPTS and all(o.finished for o in outputs)
    torch.testing.assert_close(embeddings(outputs), pooled_reference(folder, PROMPTS, pooling_type), atol=2e-5, rtol=1e-4)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks  # all freed


def test_unnormalized_mean_and_the_prefix_cache(qwen3):
    """The same prompts twice: LAST reuses cached blocks, MEAN recomputes them, both stay exact."""
    folder, llm = qwen3
    shared = [PROMPTS[-1] + p for p in PROMPTS[:3]]  # 30 shared tokens: 7 full blocks
    for _ in range(2):
        last = embeddings(llm.embed(shared))
        mean = embeddings(llm.embed(shared, PoolingParams(pooling_type="MEAN", normalize=False)))
        torch.testing.assert_close(last, pooled_reference(folder, shared, "LAST"), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(mean, pooled_reference(folder, shared, "MEAN", normalize=False), atol=1e-4, rtol=1e-4)
    assert llm.engine.scheduler.num_prefix_hit_tokens > 0


def test_each_runner_refuses_the_other_kind_of_request_by_its_flag(qwen3, checkpoint_factory):
    _, llm = qwen3
    with pytest.raises(InvalidPromptError, match="--runner generate"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    folder, _ = checkpoint_factory("qwen3")
    with LLM(folder, device="cpu", kv_cache_memory_bytes=2**22) as generating:
        with pytest.raises(InvalidPromptError, match="--runner pooling"):
            generating.embed([[5, 6, 7]])
        with pytest.raises(ValueError, match="--runner pooling"):  # a processed prompt is checked too
            generating.engine.add_request("x", generating.engine.input_processor.process([5], SamplingParams()),
                                          PoolingParams())
    with pytest.raises(SettingError, match="pooling_type applies to runner='pooling'"):
        LLM(folder, device="cpu", pooling_type="MEAN")
    with pytest.raises(ValueError, match="pooling_type='MAX' must be one of LAST, MEAN, CLS"):
        PoolingParams(pooling_type="MAX")


def test_a_prompt_may_fill_max_model_len(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3")
    with LLM(folder, runner="pooling", max_model_len=16, **SMALL) as llm:
        (output,) = llm.embed([PROMPTS[4]])  # 16 tokens: no room to generate, enough to pool
        with pytest.raises(InvalidPromptError, match="17 tokens, more than max_model_len=16"):
            llm.embed([PROMPTS[5]])
    torch.testing.assert_close(embeddings([output]), pooled_reference(folder, [PROMPTS[4]], "LAST"), atol=2e-5, rtol=1e-4)


def test_a_sentence_transformers_checkpoint_gives_the_defaults(tmp_path):
    folder = str(tmp_path / "embedding")
    save_sentence_transformers_model(folder, "lasttoken", with_normalize=True)
    assert sentence_transformers_pooling(folder) == ("LAST", True)
    with LLM(folder, runner="pooling", **SMALL) as llm:
        assert llm.engine.config.model.pooler == pooler_config(folder, None, None)
        outputs = llm.embed(["The quick brown fox", "Paged attention stores keys"])
        prompts = [o.prompt_token_ids for o in outputs]
    torch.testing.assert_close(embeddings(outputs), pooled_reference(folder, prompts, "LAST"), atol=2e-5, rtol=1e-4)
    other = str(tmp_path / "mean")
    save_sentence_transformers_model(other, "mean", with_normalize=False)
    assert pooler_config(other, None, None).pooling_type == "MEAN" and not pooler_config(other, None, None).normalize
    assert pooler_config(other, "LAST", True).pooling_type == "LAST"  # the settings win
    assert sentence_transformers_pooling(str(tmp_path)) == (None, False)


def test_async_engine_embed(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3")

    async def run():
        engine = AsyncEngine(folder, runner="pooling", **SMALL)
        try:
            return await asyncio.gather(*(engine.embed({"prompt_token_ids": p}, PoolingParams(pooling_type="MEAN"),
                                                       f"p{i}") for i, p in enumerate(PROMPTS)))
        finally:
            await engine.shutdown()

    outputs = asyncio.run(run())
    assert [o.request_id for o in outputs] == [f"p{i}" for i in range(len(PROMPTS))]
    torch.testing.assert_close(embeddings(outputs), pooled_reference(folder, PROMPTS, "MEAN"), atol=2e-5, rtol=1e-4)


def test_async_scheduling_pools_chunked_prompts(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3")
    with LLM(folder, runner="pooling", async_scheduling=True, **SMALL) as llm:
        outputs = llm.embed(PROMPTS, PoolingParams(pooling_type="MEAN"))
    torch.testing.assert_close(embeddings(outputs), pooled_reference(folder, PROMPTS, "MEAN"), atol=2e-5, rtol=1e-4)


LAYOUTS = [("qwen3", 2, 1), ("qwen3", 1, 2), ("llama3", 2, 2)]  # (family, tensor_parallel_size, pipeline_parallel_size)


@pytest.mark.slow
@pytest.mark.parametrize("family, tp, pp", LAYOUTS, ids=[f"{f}-tp{t}-pp{p}" for f, t, p in LAYOUTS])
def test_parallel_ranks_pool_like_transformers(family, tp, pp, checkpoint_factory):
    folder, _ = checkpoint_factory(family, num_layers=3 if pp > 1 else 2)
    with LLM(folder, runner="pooling", tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed_executor_backend="mp", **SMALL) as llm:
        last = embeddings(llm.embed(PROMPTS))
        mean = embeddings(llm.embed(PROMPTS, PoolingParams(pooling_type="MEAN", normalize=False)))
    torch.testing.assert_close(last, pooled_reference(folder, PROMPTS, "LAST"), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(mean, pooled_reference(folder, PROMPTS, "MEAN", normalize=False), atol=1e-4, rtol=1e-4)
