"""Tensor and pipeline parallelism across local processes (mp executor, gloo): greedy tokens equal
transformers' on the same weights, and stages own the planner's layer split."""

from __future__ import annotations

import os

import pytest

from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.distributed.mp_executor import RANK_MODULE
from shardserve.runtime.worker.pipeline import plan_layer_split
from test_runtime_matches_transformers import random_prompts, reference, token_outputs
from tests.processes import children

PROMPTS = random_prompts(7, [1, 6, 17, 33])
MAX_TOKENS = 8

# (family, num_layers, tensor_parallel_size, pipeline_parallel_size)
LAYOUTS = [
    ("llama3", 2, 2, 1),
    ("qwen2", 2, 2, 1),  # qkv biases sharded with the output
    ("gpt2", 2, 2, 1),  # fused, transposed c_attn
    ("mixtral", 2, 2, 1),  # experts split by tensor parallel
    ("qwen2_moe", 2, 2, 1),  # experts and the shared expert split by tensor parallel
    ("qwen3_moe", 2, 2, 1),
    ("qwen2_moe", 2, 1, 2),  # the sparse layer and the dense one on different stages
    ("qwen3_moe", 2, 1, 2),
    ("mixtral", 2, 1, 2),
    ("mistral-window", 2, 2, 1),  # every layer's window
    ("qwen2-window", 2, 1, 2),  # the full-attention layer and the windowed one on different stages
    ("mistral", 2, 4, 1),  # 2 KV heads on 4 ranks: replicated
    ("qwen2", 2, 1, 2),
    ("llama3", 4, 1, 3),  # the plan's uneven split: (1, 2, 1)
    ("gpt2", 5, 2, 2),  # tp 2 x pp 2 with the plan's (2, 3)
    ("gemma2", 2, 2, 1),  # soft caps, sandwich norms, tied head over a split vocabulary
    ("gemma2", 2, 1, 2),  # the local layer and the global one on different stages; the last loads the head
    ("gemma3", 2, 2, 1),  # per-head q/k norms on split heads
    ("gemma3", 2, 1, 2),  # local rope base on stage 0, global on stage 1
    ("phi3", 2, 2, 1),  # the checkpoint's fused qkv_proj and gate_up_proj cut per rank
    ("phi3", 2, 1, 2),
    ("phi3", 2, 4, 1),  # 2 KV heads of the fused qkv_proj on 4 ranks: each cut out twice
    ("deepseek_v3", 2, 2, 1),  # MLA heads split, the latent cache whole per rank; shared experts split
    ("deepseek_v2_lite", 2, 2, 1),  # q_proj without q_lora_rank
    ("deepseek_v2", 2, 1, 2),  # the dense layer and the MoE layer on different stages
    ("gpt_oss", 2, 2, 1),  # sinks of split heads; interleaved gate | up and biases cut per rank
    ("gpt_oss", 2, 1, 2),  # the windowed layer and the full one on different stages
]


@pytest.mark.slow
@pytest.mark.parametrize("family, num_layers, tp, pp", LAYOUTS, ids=[f"{f}-L{n}-tp{t}-pp{p}" for f, n, t, p in LAYOUTS])
def test_parallel_greedy_matches_transformers(family, num_layers, tp, pp, checkpoint_factory):
    folder, hf_model = checkpoint_factory(family, num_layers=num_layers)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4, tensor_parallel_size=tp,
             pipeline_parallel_size=pp, distributed_executor_backend="mp") as llm:
        states = llm.engine.executor.states
        assert [(s.tp_rank, s.pp_rank) for s in states] == [(r % tp, r // tp) for r in range(tp * pp)]
        assert states[0].layer_split == plan_layer_split(folder, tp, pp, llm.engine.config.model.dtype)
        depths = spy_in_flight(llm)
        assert token_outputs(llm, PROMPTS, params) == reference(hf_model, PROMPTS, MAX_TOKENS)
        if pp > 1:
            abort_while_in_flight(llm)
    assert max(depths) == min(pp, 2)  # 4 requests over pp batches: stages do not wait for each other
    assert rank_pids() == []


EXPERT_PARALLEL = [("mixtral", 1), ("qwen2_moe", 1), ("qwen3_moe", 1), ("mixtral", 2), ("deepseek_v3", 1),
                   ("gpt_oss", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("family, pp", EXPERT_PARALLEL, ids=[f"{f}-tp2-pp{p}" for f, p in EXPERT_PARALLEL])
def test_expert_parallel_greedy_matches_transformers(family, pp, checkpoint_factory):
    """tp 2 with whole experts per rank (2 of the 4 each); attention and shared experts stay split."""
    folder, hf_model = checkpoint_factory(family, num_layers=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4, tensor_parallel_size=2,
             pipeline_parallel_size=pp, distributed_executor_backend="mp", enable_expert_parallel=True) as llm:
        assert [s.enable_expert_parallel for s in llm.engine.executor.states] == [True] * 2 * pp
        assert token_outputs(llm, PROMPTS, params) == reference(hf_model, PROMPTS, MAX_TOKENS)
    assert rank_pids() == []


def test_expert_parallel_needs_experts(checkpoint_factory):
    folder, _ = checkpoint_factory("llama3")
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM has no routed experts"):
        LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, tensor_parallel_size=2, enable_expert_parallel=True)
    assert rank_pids() == []


def rank_pids() -> list[int]:
    """Processes this one started that still run an mp rank."""
    return children(os.getpid(), RANK_MODULE)


def abort_while_in_flight(llm: LLM) -> None:
    """Aborting requests whose batch is still in flight frees their blocks once, and the rest finish."""
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"a{i}", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.step()
    assert engine.in_flight
    engine.abort_request("a0")
    engine.abort_request("a3")
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == llm.kv_cache_info.num_blocks


def spy_in_flight(llm: LLM) -> list[int]:
    """Record how many batches were in flight each time the engine collected one."""
    depths, collect = [], llm.engine.executor.collect_batch

    def collect_batch():
        depths.append(len(llm.engine.in_flight) + 1)  # the one being collected was just popped
        return collect()

    llm.engine.executor.collect_batch = collect_batch
    return depths


def test_plan_split_is_uneven_where_the_extras_tip_it(checkpoint_factory):
    import torch

    folder, _ = checkpoint_factory("llama3", num_layers=4)
    assert plan_layer_split(folder, 1, 3, torch.float32) == (1, 2, 1)  # embedding and head weigh a layer
