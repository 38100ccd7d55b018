"""Impossible tensor/pipeline layouts are refused before any worker starts, each naming its rule."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig

from shardserve.runtime import LLM
from shardserve.runtime.config import ModelConfig, ParallelConfig
from shardserve.runtime.distributed.backend import resolve_backend
from shardserve.runtime.distributed.parallel_layout import check_parallel_layout
from test_parallel_generate import rank_pids


def model_config(heads=8, kv_heads=4, layers=4, intermediate=96, experts=None) -> ModelConfig:
    """A transformers config as the engine loads it; the planner reads the same one."""
    kw = dict(num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=layers,
              intermediate_size=intermediate, hidden_size=16 * heads, vocab_size=128, max_position_embeddings=256)
    hf = MixtralConfig(num_local_experts=experts, **kw) if experts else LlamaConfig(**kw)
    return ModelConfig("m", hf, "MixtralForCausalLM" if experts else "LlamaForCausalLM", torch.float32, 128)


@pytest.mark.parametrize("kwargs, tp, pp, devices, message", [
    ({}, 3, 1, None, "cannot shard this model: 8 attention heads are not divisible by tensor_parallel_size 3"),
    ({"heads": 12, "kv_heads": 4}, 6, 1, None, "4 KV heads neither divide by tensor_parallel_size 6 nor divide it"),
    ({"intermediate": 100}, 8, 1, None, "intermediate_size 100 is not divisible by tensor_parallel_size 8"),
    ({"layers": 2}, 1, 3, None, "more stages than the model's 2 layers"),
    ({}, 2, 2, 2, "4 ranks, more than the 2 devices available"),
    ({}, 0, 1, None, "must be at least 1"),
])
def test_refusals_name_the_rule(kwargs, tp, pp, devices, message):
    with pytest.raises(ValueError, match=message):
        check_parallel_layout(model_config(**kwargs), ParallelConfig(tp, pp), devices)


@pytest.mark.parametrize("experts, tp, message", [
    (None, 2, "enable_expert_parallel: LlamaForCausalLM has no routed experts"),
    (6, 4, "enable_expert_parallel: 6 experts do not divide evenly over tensor_parallel_size 4"),
])
def test_expert_parallel_refusals_name_the_setting(experts, tp, message):
    with pytest.raises(ValueError, match=message):
        check_parallel_layout(model_config(experts=experts), ParallelConfig(tp, 1, enable_expert_parallel=True), None)
    check_parallel_layout(model_config(experts=experts), ParallelConfig(tp, 1), None)  # fine without it


def test_expert_parallel_layouts_pass():
    check_parallel_layout(model_config(experts=8), ParallelConfig(4, 1, enable_expert_parallel=True), None)
    # Mixtral's experts are its intermediate_size: whole per rank, 90 features need not divide by 4
    with pytest.raises(ValueError, match="intermediate_size 90 is not divisible by tensor_parallel_size 4; "
                                         "enable_expert_parallel keeps experts whole"):
        check_parallel_layout(model_config(experts=8, intermediate=90), ParallelConfig(4, 1), None)
    check_parallel_layout(model_config(experts=8, intermediate=90), ParallelConfig(4, 1, enable_expert_parallel=True),
                          None)


@pytest.mark.parametrize("tp, pp", [(8, 1), (4, 1), (2, 2), (1, 4)])
def test_possible_layouts_pass(tp, pp):
    check_parallel_layout(model_config(kv_heads=2), ParallelConfig(tp, pp), 8)  # tp 4, 8 > 2 KV heads: replicated


def test_backend_follows_the_planners_rule():
    assert resolve_backend(ParallelConfig(1, 1), None) == "uni"
    assert resolve_backend(ParallelConfig(2, 2), None) == "mp"  # CPU ranks: this machine
    assert resolve_backend(ParallelConfig(2, 2), 4) == "mp"
    assert resolve_backend(ParallelConfig(4, 2), 4) == "ray"  # more ranks than local GPUs
    assert resolve_backend(ParallelConfig(2, 1, "ray"), 8) == "ray"


@pytest.mark.parametrize("engine_kwargs, message", [
    ({"tensor_parallel_size": 3}, "4 attention heads are not divisible by tensor_parallel_size 3"),
    ({"pipeline_parallel_size": 3}, "more stages than the model's 2 layers"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "runs one rank"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "threads"}, "must be one of"),
])
def test_engine_refuses_before_starting_workers(engine_kwargs, message, checkpoint_factory):
    folder, _ = checkpoint_factory("llama3")
    with pytest.raises(ValueError, match=message):
        LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, **engine_kwargs)
    assert rank_pids() == []


def test_device_names():
    from shardserve.runtime.config import first_device_index, resolve_device
    assert resolve_device("cpu") == "cpu" and first_device_index("cuda:3") == 3
    assert first_device_index("cuda") == 0
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device("tpu")
