"""The Ray executor (a local Ray): the same greedy tokens as transformers, and a dead actor kills the engine."""

from __future__ import annotations

import time

import pytest
import ray

from shardserve.runtime import LLM, EngineDeadError, SamplingParams
from test_parallel_generate import MAX_TOKENS, PROMPTS
from test_runtime_matches_transformers import reference, token_outputs


@pytest.fixture(scope="module")
def local_ray(monkeypatch_module):
    monkeypatch_module.delenv("RAY_ADDRESS", raising=False)
    monkeypatch_module.setenv("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def ray_llm(folder: str, tp: int, pp: int) -> LLM:
    return LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4, tensor_parallel_size=tp,
               pipeline_parallel_size=pp, distributed_executor_backend="ray")


@pytest.mark.slow
def test_ray_tp2_pp2_matches_transformers(local_ray, checkpoint_factory):
    folder, hf_model = checkpoint_factory("gpt2", num_layers=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with ray_llm(folder, 2, 2) as llm:
        assert token_outputs(llm, PROMPTS, params) == reference(hf_model, PROMPTS, MAX_TOKENS)
        assert llm.engine.executor.states[-1].layer_split == (2, 3)


@pytest.mark.slow
def test_ray_actor_killed_mid_generation(local_ray, checkpoint_factory):
    folder, hf_model = checkpoint_factory("qwen2")
    llm = ray_llm(folder, 2, 1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    assert token_outputs(llm, PROMPTS, params) == reference(hf_model, PROMPTS, MAX_TOKENS)
    for i in range(4):
        llm.engine.add_request(str(i), [5 + i] * 9, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    llm.engine.step()
    ray.kill(llm.engine.executor.handles[1].actor)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"ranks \[1\] exited"):
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert time.monotonic() - started < 10.0
    llm.shutdown()
    for handle in llm.engine.executor.handles:  # every actor is gone, not only the one killed
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handle.actor.ready.remote(), timeout=10)
