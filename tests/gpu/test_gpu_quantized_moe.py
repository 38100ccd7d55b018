"""The quantized fused MoE Triton kernels compiled on the GPU in bf16 at Qwen3-30B-A3B's layer shape (fp8
in 128x128 blocks and per channel, AWQ and GPTQ int4 in groups of 128) and at gpt-oss-120b's (MXFP4 with
biases and swigluoai), against FusedMoE's torch loop in float32 over the same dequantized experts.
Written without a GPU at hand: run them on one."""

from __future__ import annotations

import pytest
import torch

from shardserve.runtime.layers.activation import GatedActivation
from shardserve.runtime.layers.moe import FusedMoE
from shardserve.runtime.layers.quantization.config import QuantConfig
from shardserve.runtime.layers.quantization.methods import quantized_layers
from shardserve.runtime.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state
from test_gpu_moe import assert_bf16_close, inputs

CUDA = torch.device("cuda")
NUM_EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
FORMATS = {"fp8-block": {"quant_method": "fp8", "weight_block_size": [128, 128]},
           "fp8-channel": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
               "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
           "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
           "gptq4": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}}


@pytest.fixture(autouse=True)
def restore_parallel_state():
    saved = get_parallel_state()
    yield
    set_parallel_state(saved)


def random_quantized_moe(fmt: str, state=ParallelState()) -> FusedMoE:
    """Random packed experts whose dequantized outputs are of order one (scales ~ 1 / (spread * sqrt(K)))."""
    set_parallel_state(state)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(CUDA), quantized_layers(QuantConfig.from_dict(FORMATS[fmt])):
            moe = FusedMoE(NUM_EXPERTS, TOP_K, HIDDEN, INTER, renormalize=True)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    with torch.no_grad():
        for name, param in moe.named_parameters():
            num_in = HIDDEN if name.startswith("w13") else INTER
            if param.dtype == torch.int32:
                param.copy_(torch.randint(-2**31, 2**31 - 1, param.shape, generator=generator, device=CUDA))
            elif param.dtype == torch.float8_e4m3fn:
                param.copy_(torch.randn(param.shape, generator=generator, device=CUDA).to(torch.float8_e4m3fn))
            else:  # scales
                spread = 1.0 if fmt.startswith("fp8") else 6.0
                scale = torch.rand(param.shape, generator=generator, device=CUDA) + 0.5
                param.copy_(scale / (spread * num_in ** 0.5))
    return moe


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 1000])
def test_quantized_kernel_matches_the_dequantized_loop_bf16(fmt, num_tokens):
    moe = random_quantized_moe(fmt)
    x, logits = inputs(num_tokens, HIDDEN, NUM_EXPERTS)
    weights, experts = moe.route(logits)
    expected = moe.forward_loop(x.float(), weights, experts)
    assert_bf16_close(moe(x, logits), expected)


@pytest.mark.parametrize("fmt", ["fp8-block", "awq"])
def test_expert_parallel_shards_run_the_kernel(fmt):
    """Rank 1 of 2 with whole experts: its kernel output equals its loop over experts 64..127."""
    moe = random_quantized_moe(fmt, ParallelState(1, 2, enable_expert_parallel=True))
    assert moe.first_expert == 64
    x, logits = inputs(300, HIDDEN, NUM_EXPERTS)
    weights, experts = moe.route(logits)
    expected = moe.forward_loop(x.float(), weights, experts)
    assert_bf16_close(moe.kernels(x, weights, experts), expected)


def random_gpt_oss_moe(state=ParallelState()) -> FusedMoE:
    """gpt-oss-120b's layer: 128 MXFP4 experts of 2880 x 2880, top 4, biases, swigluoai (limit 7). Random
    bytes, scales 2^-9..2^-6 (outputs of order one over 2880 inputs of e2m1 values up to 6)."""
    set_parallel_state(state)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(CUDA), quantized_layers(QuantConfig.from_dict({"quant_method": "mxfp4"})):
            moe = FusedMoE(128, 4, 2880, 2880, activation=GatedActivation("swigluoai", 1.702, 7.0), has_bias=True)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    with torch.no_grad():
        for name, param in moe.named_parameters():
            if name.endswith("_blocks"):
                param.copy_(torch.randint(0, 256, param.shape, generator=generator, device=CUDA))
            elif name.endswith("_scales"):
                param.copy_(torch.randint(118, 122, param.shape, generator=generator, device=CUDA))
            else:  # biases
                param.copy_(torch.randn(param.shape, generator=generator, device=CUDA) * 0.1)
    return moe


@pytest.mark.parametrize("state", [ParallelState(), ParallelState(1, 2, enable_expert_parallel=True)],
                         ids=["tp1", "ep2-rank1"])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 1000])
def test_mxfp4_kernel_matches_the_dequantized_loop_bf16(state, num_tokens):
    moe = random_gpt_oss_moe(state)
    x, logits = inputs(num_tokens, 2880, 128)
    weights, experts = moe.route(logits)
    expected = moe.forward_loop(x.float(), weights, experts)
    assert_bf16_close(moe.kernels(x, weights, experts), expected)
