"""Phi-3 (Phi3ForCausalLM): a Llama-style decoder whose checkpoint fuses q|k|v into `qkv_proj` and
gate|up into `gate_up_proj`, with longrope scaling, a window on every layer and partial rotary."""

from __future__ import annotations

from shardserve.runtime.config import ModelConfig
from shardserve.runtime.models.llama import LlamaForCausalLM, LlamaVariant

PHI3 = LlamaVariant(qkv_bias=False, has_sliding_window=True, has_partial_rotary=True)


def phi3(model_config: ModelConfig) -> LlamaForCausalLM:
    """NOTE: the fused checkpoint tensors are named as our fused parameters, so they load with no shard
    id: QKVParallelLinear and MergedColumnParallelLinear cut this rank's q, k, v (or gate, up) rows out
    of the fused tensor, and tensor parallelism splits each part rather than the fused whole."""
    return LlamaForCausalLM(model_config, PHI3)
