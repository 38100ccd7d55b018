"""gpt-oss's experts: tensors of every expert (gate and up interleaved, biases) loaded per rank, float or
MXFP4 (packed in quant_checkpoints.py from the format's public description), against a token-by-token
reference on the checkpoint's weights; and the fused MoE Triton kernels with biases, swigluoai and MXFP4
dequantization under TRITON_INTERPRET=1 on CPU against FusedMoE's torch loop."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from quant_checkpoints import MXFP4, mxfp4_tensors  # noqa: E402
from shardserve.runtime.worker.checkpoint import CheckpointTensor  # noqa: E402
from shardserve.runtime.layers.activation import GatedActivation  # noqa: E402
from shardserve.runtime.layers.moe import FusedMoE  # noqa: E402
from shardserve.runtime.layers.moe_stacked import stacked_expert_weight  # noqa: E402
from shardserve.runtime.layers.quantization.config import QuantConfig  # noqa: E402
from shardserve.runtime.layers.quantization.methods import quantized_layers  # noqa: E402
from shardserve.runtime.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state  # noqa: E402
import shardserve.runtime.layers.quantization.triton_quant_moe  # noqa: E402,F401  (its kernels, interpreted)

EXPERTS, HIDDEN, INTER = 4, 64, 64
SWIGLU = GatedActivation("swigluoai", 1.702, 1.5)
STATES = [ParallelState(), ParallelState(1, 2), ParallelState(1, 2, enable_expert_parallel=True)]


@pytest.fixture(autouse=True)
def restore_parallel_state():
    saved = get_parallel_state()
    yield
    set_parallel_state(saved)


def save_stacked(path: str, is_mxfp4: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """gpt-oss's expert tensors in one file; returns the float weights they hold (dequantized for MXFP4)."""
    torch.manual_seed(seed)
    weights = {"gate_up_proj": torch.randn(EXPERTS, HIDDEN, 2 * INTER) * 0.2,
               "down_proj": torch.randn(EXPERTS, INTER, HIDDEN) * 0.2,
               "gate_up_proj_bias": torch.randn(EXPERTS, 2 * INTER) * 0.3, "down_proj_bias": torch.randn(EXPERTS, HIDDEN)}
    tensors = dict(weights)
    if is_mxfp4:
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales, rows = mxfp4_tensors(tensors.pop(name).transpose(1, 2))
            tensors |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
            weights[name] = rows.transpose(1, 2)
    save_file({f"mlp.experts.{k}": v.contiguous() for k, v in tensors.items()}, path)
    return weights


def loaded_stacked(path: str, is_mxfp4: bool, state: ParallelState) -> FusedMoE:
    set_parallel_state(state)
    with quantized_layers(QuantConfig.from_dict(MXFP4) if is_mxfp4 else None):
        moe = FusedMoE(EXPERTS, 2, HIDDEN, INTER, activation=SWIGLU, has_bias=True)
    params = dict(moe.named_parameters())
    handle = safe_open(path, framework="pt")
    for name in handle.keys():
        target = stacked_expert_weight(name)
        assert target is not None
        moe.weight_loader(params[target[0].rpartition(".")[2]], CheckpointTensor(handle.get_slice(name)), target[1])
    return moe


def reference(weights: dict, x: torch.Tensor, routing: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss experts, token by token: interleaved gate/up, clamped, biased."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, e in enumerate(experts[t].tolist()):
            gate_up = x[t] @ weights["gate_up_proj"][e] + weights["gate_up_proj_bias"][e]
            gate, up = gate_up[0::2].clamp(max=1.5), gate_up[1::2].clamp(-1.5, 1.5)
            h = (up + 1) * gate * torch.sigmoid(gate * 1.702)
            out[t] += routing[t, slot] * (h @ weights["down_proj"][e] + weights["down_proj_bias"][e])
    return out


@pytest.mark.parametrize("is_mxfp4", [False, True], ids=["float", "mxfp4"])
def test_rank_shares_sum_to_the_checkpoint_layer(is_mxfp4, tmp_path):
    path = str(tmp_path / "experts.safetensors")
    weights = save_stacked(path, is_mxfp4)
    torch.manual_seed(1)
    x = torch.randn(9, HIDDEN)
    routing, experts = loaded_stacked(path, is_mxfp4, ParallelState()).route(torch.randn(9, EXPERTS))
    expected = reference(weights, x, routing, experts)
    assert (x @ weights["gate_up_proj"][0])[0::2].abs().max() > 1.5  # the clamp bites
    for is_expert_parallel in (False, True):
        total = torch.zeros_like(expected)
        for rank in range(2):
            moe = loaded_stacked(path, is_mxfp4, ParallelState(rank, 2, enable_expert_parallel=is_expert_parallel))
            total += moe.forward_loop(x, routing, experts)
        torch.testing.assert_close(total, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("is_mxfp4", [False, True], ids=["float", "mxfp4"])
@pytest.mark.parametrize("state", STATES, ids=["tp1", "tp2-rank1", "ep2-rank1"])
def test_kernels_match_the_loop(is_mxfp4, state, tmp_path):
    path = str(tmp_path / "experts.safetensors")
    save_stacked(path, is_mxfp4)
    moe = loaded_stacked(path, is_mxfp4, state)
    torch.manual_seed(2)
    x = torch.randn(7, HIDDEN)
    routing, experts = moe.route(torch.randn(7, EXPERTS))
    expected = moe.forward_loop(x, routing, experts)
    for blocks in ((16, 32, 64), (4, 16, 16)):  # a K tile over two scale groups, and within one
        actual = moe.kernels(x, routing, experts, blocks)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_mxfp4_needs_whole_groups_per_rank():
    set_parallel_state(ParallelState(0, 4))
    with quantized_layers(QuantConfig.from_dict(MXFP4)), pytest.raises(ValueError, match="whole groups of 32"):
        FusedMoE(EXPERTS, 2, HIDDEN, INTER, activation=SWIGLU, has_bias=True)
