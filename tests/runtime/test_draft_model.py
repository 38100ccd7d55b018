"""Speculative decoding with a draft model (method draft_model): the tokens are those without speculation, and a
draft model that is the target itself has every draft kept (its KV, catch-up and rounds line up with the target's)."""

from __future__ import annotations

import json
import shutil

import pytest

from runtime_checkpoints import save_checkpoint
from shardserve.planner.settings import SettingError
from shardserve.planner.speculative import SpeculativeConfig
from shardserve.runtime import LLM, SamplingParams
from test_spec_decode import PROMPTS, generate, same_logprobs


def draft_config(folder: str, k: int = 3) -> str:
    return SpeculativeConfig("draft_model", k, model=folder).to_json()


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A one-layer model of the same vocabulary, other weights: its drafts are mostly wrong."""
    folder = str(tmp_path_factory.mktemp("draft"))
    save_checkpoint(folder, "llama3", num_layers=1, seed=5)
    return folder


def test_the_target_as_its_own_draft_has_every_draft_kept(target):
    """Greedy drafts of the same weights are the target's own greedy tokens: each is kept only if the draft's KV
    holds every earlier token at its position (catch-up after prompts, after all-kept steps, rounds)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _, _ = generate(target, params)
    tokens, _, stats = generate(target, params, draft_config(target))
    spec = stats.spec_decode
    assert tokens == plain
    assert spec.num_draft_tokens > 100 and spec.num_accepted_tokens == spec.num_draft_tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, max_tokens=40, ignore_eos=True, seed=7, logprobs=1),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=40, ignore_eos=True, repetition_penalty=1.2),
], ids=["greedy", "seeded", "penalties"])
def test_tokens_are_those_without_speculation(target, other_draft, params):
    plain, plain_logprobs, _ = generate(target, params)
    for draft in (other_draft, target):
        tokens, logprobs, stats = generate(target, params, draft_config(draft, 4))
        assert tokens == plain and stats.spec_decode.num_drafts > 0
        if params.logprobs:
            assert same_logprobs(logprobs, plain_logprobs, tokens)


def test_preemption_and_the_prefix_cache_keep_the_tokens(target, kv_bytes_for):
    """A pool too small for every request: the newest are preempted and come back, partly from the prefix cache
    (whose blocks hold the draft's KV beside the target's)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    plain, _, _ = generate(target, params, prompts=prompts)
    tight = 2 * kv_bytes_for(target, 40, 4)  # 40 blocks of the target's and the draft's (the same model) layers
    tokens, _, stats = generate(target, params, draft_config(target), prompts=prompts, kv_cache_memory_bytes=tight,
                                enable_prefix_caching=True, max_model_len=80)
    assert tokens == plain and stats.num_preemptions > 0
    assert stats.spec_decode.num_accepted_tokens >= 0.9 * stats.spec_decode.num_draft_tokens


def test_the_plan_sizes_the_pool_the_engine_makes(target, other_draft):
    """plan = launch: the pages hold the draft's layers beside the model's, in both."""
    from shardserve.planner import PlanOptions, load_model, make_plan, parse_declared

    pool = 1 << 22
    plan = make_plan(load_model(target), parse_declared("cpu"), PlanOptions(
        kv_cache_memory_bytes=pool, block_size=4, max_model_len=256, speculative_config=draft_config(other_draft),
        draft_acceptance_rate=0.5)).record()
    plain = make_plan(load_model(target), parse_declared("cpu"), PlanOptions(
        kv_cache_memory_bytes=pool, block_size=4, max_model_len=256)).record()
    with LLM(target, device="cpu", kv_cache_memory_bytes=pool, block_size=4, max_model_len=256,
             speculative_config=draft_config(other_draft)) as llm:
        assert llm.kv_cache_info.num_blocks == plan.memory.num_blocks < plain.memory.num_blocks


def test_a_draft_model_that_cannot_draft_here_is_refused_by_name(target, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(target, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    settings = dict(device="cpu", kv_cache_memory_bytes=1 << 22)
    with pytest.raises(SettingError, match=r"the draft model .*odd cannot draft here: its vocabulary has 384 tokens"):
        LLM(target, speculative_config=draft_config(str(odd)), **settings)
    with pytest.raises(SettingError, match="the draft model /no/such/folder: model folder /no/such/folder does not"):
        LLM(target, speculative_config=draft_config("/no/such/folder"), **settings)
    with pytest.raises(SettingError, match="pipeline_parallel_size above 1 is not served with it"):
        LLM(target, speculative_config=draft_config(target), pipeline_parallel_size=2, **settings)
    with pytest.raises(SettingError, match="method draft_model with kv_offloading_size: the CPU tier keeps"):
        LLM(target, speculative_config=draft_config(target), kv_offloading_size=0.01, **settings)


@pytest.mark.parametrize("value, message", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, "method draft_model needs model"),
    ({"method": "draft_model", "model": "m", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
     "prompt_lookup_max applies to method ngram, not draft_model"),
    ({"method": "ngram", "model": "m", "num_speculative_tokens": 3}, "model applies to method draft_model or eagle3, not ngram"),
])
def test_each_method_takes_its_own_keys(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
    assert SpeculativeConfig.parse({"model": "m", "num_speculative_tokens": 2}) == SpeculativeConfig(
        "draft_model", 2, model="m")  # vLLM's inference of the method from the keys
    assert json.loads(SpeculativeConfig("draft_model", 2, model="m").to_json()) == {
        "method": "draft_model", "num_speculative_tokens": 2, "model": "m"}


@pytest.mark.slow
def test_tensor_parallel_ranks_draft_alike(target):
    """tp 2 over mp ranks: each rank runs its shard of the draft and gathers its logits, so all draft alike."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _, _ = generate(target, params)
    tokens, _, stats = generate(target, params, draft_config(target), tensor_parallel_size=2,
                                distributed_executor_backend="mp")
    assert tokens == plain and stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens > 0


def test_the_memory_profile_runs_the_draft_beside_the_model(target, other_draft):
    """A GPU's KV budget is what the profile's forward leaves: the draft's forward runs in it (here on the CPU)."""
    import torch

    from shardserve.runtime.worker.forward_context import ForwardContext, forward_context

    with LLM(target, device="cpu", kv_cache_memory_bytes=1 << 22, speculative_config=draft_config(other_draft)) as llm:
        worker = llm.engine.executor.worker
        ids, positions = torch.arange(16) + 3, torch.arange(16)
        with torch.inference_mode(), forward_context(ForwardContext(None, worker.backend)):
            hidden = worker.model(ids, positions, None)
            worker.drafter.dry_run(ids, positions, hidden, 4)
        assert not worker.drafter.kv_cache.any()  # a dry run writes no page
