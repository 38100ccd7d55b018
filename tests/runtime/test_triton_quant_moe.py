"""The quantized fused MoE Triton kernels under TRITON_INTERPRET=1 on CPU, against FusedMoE's torch loop
over the dequantized experts (the reference), for every expert format, split and whole-expert ranks."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402

from quant_checkpoints import MOE_FORMATS, save_quantized_experts  # noqa: E402
from shardserve.runtime.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state  # noqa: E402
import shardserve.runtime.layers.quantization.triton_quant_moe  # noqa: E402,F401  (its kernels, interpreted)
from test_quantized_moe import loaded_experts  # noqa: E402


@pytest.fixture(autouse=True)
def restore_parallel_state():
    saved = get_parallel_state()
    yield
    set_parallel_state(saved)


@pytest.mark.parametrize("fmt", list(MOE_FORMATS))
@pytest.mark.parametrize("state", [ParallelState(), ParallelState(1, 2), ParallelState(1, 2, enable_expert_parallel=True)],
                         ids=["tp1", "tp2-rank1", "ep2-rank1"])
def test_kernel_matches_the_dequantized_loop_fp32(fmt, state, tmp_path):
    path = str(tmp_path / "experts.safetensors")
    save_quantized_experts(path, fmt, 4, 64, 32)
    moe = loaded_experts(path, fmt, state)
    torch.manual_seed(1)
    x = torch.randn(7, 64)
    weights, experts = moe.route(torch.randn(7, 4))
    expected = moe.forward_loop(x, weights, experts)
    for blocks in ((16, 32, 32), (4, 16, 16)):  # a K tile over two scale groups or blocks, and within one
        actual = moe.kernels(x, weights, experts, blocks)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["awq", "fp8-block"])
def test_kernel_matches_the_dequantized_loop_fp16(fmt, tmp_path):
    """NOTE: half precision as fp16: the interpreter computes bf16 wrongly (numpy has no bf16)."""
    path = str(tmp_path / "experts.safetensors")
    save_quantized_experts(path, fmt, 4, 64, 32)
    torch.set_default_dtype(torch.float16)
    try:
        moe = loaded_experts(path, fmt, ParallelState())
    finally:
        torch.set_default_dtype(torch.float32)
    x = torch.randn(5, 64).to(torch.float16)
    weights, experts = moe.route(torch.randn(5, 4))
    expected = moe.forward_loop(x.float(), weights, experts)
    actual = moe.kernels(x, weights, experts, (16, 32, 32))
    assert actual.dtype == torch.float16
    torch.testing.assert_close(actual.float(), expected, atol=5e-3, rtol=5e-3)


def test_no_tokens(tmp_path):
    path = str(tmp_path / "experts.safetensors")
    save_quantized_experts(path, "gptq4", 4, 64, 32)
    moe = loaded_experts(path, "gptq4", ParallelState())
    weights, experts = moe.route(torch.randn(0, 4))
    assert moe.kernels(torch.randn(0, 64), weights, experts).shape == (0, 64)
