"""The fused MoE Triton kernel compiled on the GPU in bf16, at Qwen3-30B-A3B and Mixtral-8x7B layer shapes,
against FusedMoE's torch loop in float32 on the same weights; expert-parallel shards; no host sync, so a
CUDA graph captures the layer."""

from __future__ import annotations

import copy

import pytest
import torch

import test_gpu_model as model_tests
from shardserve.runtime.layers.moe import FusedMoE
from shardserve.runtime.layers.triton_moe import fused_moe
from shardserve.runtime.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state

CUDA = torch.device("cuda")
# (name, num_experts, top_k, hidden_size, moe_intermediate_size, renormalize)
SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768, True), ("mixtral-8x7b", 8, 2, 4096, 14336, True)]


@pytest.fixture(autouse=True)
def restore_parallel_state():
    saved = get_parallel_state()
    yield
    set_parallel_state(saved)


def bf16_moe(num_experts, top_k, hidden, inter, renormalize, state=ParallelState()) -> FusedMoE:
    set_parallel_state(state)
    generator = torch.Generator(device=CUDA).manual_seed(0)
    with torch.device(CUDA):
        moe = FusedMoE(num_experts, top_k, hidden, inter, renormalize)
    with torch.no_grad():  # outputs of order one: gate, up ~ N(0, 1), down's rows scaled to match
        moe.w13.copy_(torch.randn(moe.w13.shape, generator=generator, device=CUDA) * hidden ** -0.5)
        moe.w2.copy_(torch.randn(moe.w2.shape, generator=generator, device=CUDA) * inter ** -0.5)
    return moe.to(torch.bfloat16)


def inputs(num_tokens, hidden, num_experts, seed=1):
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator, device=CUDA).to(torch.bfloat16)
    return x, torch.randn(num_tokens, num_experts, generator=generator, device=CUDA)


def loop_fp32(moe: FusedMoE, x, weights, experts) -> torch.Tensor:
    return copy.deepcopy(moe).float().forward_loop(x.float(), weights, experts)


def assert_bf16_close(actual, expected):
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), expected, atol=3e-2, rtol=3e-2)
    assert (actual.float() - expected).norm() <= 1e-2 * expected.norm()


@pytest.mark.parametrize("name, num_experts, top_k, hidden, inter, renormalize", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 1000])
def test_kernel_matches_the_torch_loop_bf16(name, num_experts, top_k, hidden, inter, renormalize, num_tokens):
    moe = bf16_moe(num_experts, top_k, hidden, inter, renormalize)
    x, logits = inputs(num_tokens, hidden, num_experts)
    weights, experts = moe.route(logits)
    assert_bf16_close(moe(x, logits), loop_fp32(moe, x, weights, experts))


def test_expert_parallel_shards_sum_to_the_whole_layer():
    """Each of 4 ranks' kernel output over its 32 whole experts; their sum is the one-rank layer."""
    whole = bf16_moe(128, 8, 2048, 768, True)
    x, logits = inputs(37, 2048, 128)
    weights, experts = whole.route(logits)
    total = torch.zeros(37, 2048, device=CUDA)
    for rank in range(4):
        set_parallel_state(ParallelState(rank, 4, enable_expert_parallel=True))
        with torch.device(CUDA):
            part = FusedMoE(128, 8, 2048, 768, True).to(torch.bfloat16)
        with torch.no_grad():
            part.w13.copy_(whole.w13[32 * rank:32 * (rank + 1)])
            part.w2.copy_(whole.w2[32 * rank:32 * (rank + 1)])
        total += fused_moe(x, part.w13, part.w2, weights, experts, part.first_expert).float()
    set_parallel_state(ParallelState())
    torch.testing.assert_close(total, loop_fp32(whole, x, weights, experts), atol=3e-2, rtol=3e-2)


def test_forward_has_no_host_sync_and_replays_in_a_cuda_graph():
    moe = bf16_moe(128, 8, 2048, 768, True)
    x, logits = inputs(16, 2048, 128)
    moe(x, logits)  # compile the kernels before capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host copy raises
    try:
        moe(x, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x, logits)
    new_x, new_logits = inputs(16, 2048, 128, seed=5)
    x.copy_(new_x)
    logits.copy_(new_logits)
    graph.replay()
    weights, experts = moe.route(new_logits)
    assert_bf16_close(out, loop_fp32(moe, new_x, weights, experts))


def test_moe_model_decodes_the_same_in_cuda_graphs(gpu_checkpoint):
    """A Qwen3-MoE model is captured (no host sync in its forward) and decodes as eagerly; the check is
    the dense models' (tests/gpu/test_gpu_model.py)."""
    model_tests.test_cuda_graphs_decode_the_same_greedy_tokens("qwen3_moe", gpu_checkpoint)
