"""The fused MoE Triton kernel under TRITON_INTERPRET=1 on CPU against FusedMoE's torch loop, its align
step's layout, and expert-parallel shards summing to the whole layer."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from shardserve.runtime.worker.checkpoint import CheckpointTensor  # noqa: E402
from shardserve.runtime.layers.moe import FusedMoE  # noqa: E402
from shardserve.runtime.layers.triton_moe import fused_moe, moe_align  # noqa: E402
from shardserve.runtime.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state  # noqa: E402


@pytest.fixture(autouse=True)
def restore_parallel_state():
    saved = get_parallel_state()
    yield
    set_parallel_state(saved)


def random_moe(num_experts: int, top_k: int, hidden: int, inter: int, dtype=torch.float32, seed: int = 0,
               state: ParallelState = ParallelState()) -> FusedMoE:
    set_parallel_state(state)
    torch.manual_seed(seed)
    moe = FusedMoE(num_experts, top_k, hidden, inter)
    with torch.no_grad():
        moe.w13.copy_(torch.randn_like(moe.w13) * hidden ** -0.5)
        moe.w2.copy_(torch.randn_like(moe.w2) * inter ** -0.5)
    return moe.to(dtype)


@pytest.mark.parametrize("num_experts, top_k, num_tokens, block_m, first, num_local", [
    (8, 2, 5, 4, 0, 8), (8, 2, 13, 4, 4, 4), (4, 1, 1, 16, 0, 4), (6, 3, 9, 2, 2, 2)])
def test_align_groups_pairs_by_local_expert(num_experts, top_k, num_tokens, block_m, first, num_local):
    torch.manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    sorted_pairs, block_experts = moe_align(ids, num_local, first, block_m)
    num_pairs = ids.numel()
    flat = ids.reshape(-1)
    seen = []
    for block, expert in enumerate(block_experts.tolist()):
        rows = sorted_pairs[block * block_m:(block + 1) * block_m].tolist()
        if expert == num_local:
            continue  # nothing to do in this block
        real = [p for p in rows if p < num_pairs]
        assert real and all(flat[p] == first + expert for p in real)
        assert rows[:len(real)] == real  # padding only at a run's end
        seen += real
    local = [p for p in range(num_pairs) if first <= flat[p] < first + num_local]
    assert sorted(seen) == local  # every local pair exactly once, no other rank's pair
    assert block_experts.tolist() == sorted(block_experts.tolist())  # runs in expert order


CASES = [(4, 2, 32, 48, 1), (4, 2, 32, 48, 19), (8, 3, 64, 96, 7), (3, 1, 40, 24, 5)]


@pytest.mark.parametrize("num_experts, top_k, hidden, inter, num_tokens", CASES)
def test_kernel_matches_the_torch_loop_fp32(num_experts, top_k, hidden, inter, num_tokens):
    moe = random_moe(num_experts, top_k, hidden, inter)
    x = torch.randn(num_tokens, hidden)
    weights, experts = moe.route(torch.randn(num_tokens, num_experts))
    expected = moe.forward_loop(x, weights, experts)
    for blocks in ((16, 32, 32), (4, 16, 16)):  # decode-sized blocks and many padded runs
        actual = fused_moe(x, moe.w13, moe.w2, weights, experts, blocks=blocks)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 11])
def test_kernel_matches_the_torch_loop_fp16(num_tokens):
    """NOTE: half precision as fp16: the interpreter computes bf16 wrongly (numpy has no bf16); bf16 is
    checked on a GPU (tests/gpu/test_gpu_moe.py)."""
    moe = random_moe(4, 2, 64, 64, dtype=torch.float16)
    x = torch.randn(num_tokens, 64).to(torch.float16)
    weights, experts = moe.route(torch.randn(num_tokens, 4))
    expected = moe.forward_loop(x, weights, experts).float()
    actual = fused_moe(x, moe.w13, moe.w2, weights, experts, blocks=(16, 32, 32))
    assert actual.dtype == torch.float16
    torch.testing.assert_close(actual.float(), expected, atol=5e-3, rtol=5e-3)


def test_no_tokens():
    moe = random_moe(4, 2, 32, 32)
    weights, experts = moe.route(torch.randn(0, 4))
    assert fused_moe(torch.randn(0, 32), moe.w13, moe.w2, weights, experts).shape == (0, 32)


def checkpoint_experts(folder, num_experts: int, hidden: int, inter: int) -> dict[str, CheckpointTensor]:
    """Per-expert w1/w3/w2 in a real safetensors file, read back lazily."""
    torch.manual_seed(3)
    data = {f"{e}.{kind}": torch.randn(*(shape)) * 0.2 for e in range(num_experts)
            for kind, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter)))}
    save_file(data, str(folder / "experts.safetensors"))
    handle = safe_open(str(folder / "experts.safetensors"), framework="pt")
    return {name: CheckpointTensor(handle.get_slice(name)) for name in data}


def loaded_moe(lazy, state: ParallelState, num_experts=4, hidden=16, inter=8) -> FusedMoE:
    set_parallel_state(state)
    moe = FusedMoE(num_experts, 2, hidden, inter)
    for name, tensor in lazy.items():
        expert, kind = name.split(".")
        moe.weight_loader(moe.w2 if kind == "w2" else moe.w13, tensor, (int(expert), kind))
    return moe


@pytest.mark.parametrize("is_expert_parallel", [False, True])
def test_rank_shares_sum_to_the_whole_layer(tmp_path, is_expert_parallel):
    """Both layouts: the ranks' partial outputs (what the all-reduce adds) equal the one-rank layer, and
    under expert parallel each rank holds E / tp whole experts, in the kernel as in the loop."""
    lazy = checkpoint_experts(tmp_path, 4, 16, 8)
    whole = loaded_moe(lazy, ParallelState())
    x, logits = torch.randn(9, 16), torch.randn(9, 4)
    weights, experts = whole.route(logits)
    expected = whole.forward_loop(x, weights, experts)
    total = torch.zeros_like(expected)
    for rank in range(2):
        moe = loaded_moe(lazy, ParallelState(rank, 2, enable_expert_parallel=is_expert_parallel))
        if is_expert_parallel:
            assert moe.w13.shape == (2, 16, 16) and moe.first_expert == 2 * rank
            assert torch.equal(moe.w13, whole.w13[2 * rank:2 * rank + 2])
            kernel = fused_moe(x, moe.w13, moe.w2, weights, experts, moe.first_expert, blocks=(4, 16, 16))
            torch.testing.assert_close(kernel, moe.forward_loop(x, weights, experts), atol=1e-5, rtol=1e-5)
        else:
            assert moe.w13.shape == (4, 8, 16)
        total += moe.forward_loop(x, weights, experts)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_expert_parallel_never_reads_another_ranks_experts():
    set_parallel_state(ParallelState(0, 2, enable_expert_parallel=True))
    moe = FusedMoE(4, 2, 16, 8)
    untouchable = object()  # any attribute read (shape, narrow, load) would raise
    for expert in (2, 3):
        for kind in ("w1", "w3", "w2"):
            moe.weight_loader(moe.w2 if kind == "w2" else moe.w13, untouchable, (expert, kind))
