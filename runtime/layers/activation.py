"""Activation functions by their config.json names, the gated SiLU of Llama-style MLPs, and the gated
activations of routed experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """[n, 2 * d] (gate | up) -> [n, d] silu(gate) * up.
    NOTE: on CUDA one Triton kernel (runtime/layers/triton_activation.py) where torch launches two and
    writes the silu to memory in between."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from shardserve.runtime.layers import triton_activation  # triton is needed only on CUDA
            return triton_activation.silu_and_mul(x)
        return silu_and_mul_reference(x)


GATED_ACTIVATIONS = ("silu", "swigluoai")  # vLLM's names; the fused MoE kernels' ACTIVATION is the index


@dataclass(frozen=True)
class GatedActivation:
    """How an expert combines its gate and up features: silu(gate) * up, or gpt-oss's swigluoai,
    gate * sigmoid(alpha * gate) * (up + 1) with gate clamped to at most `limit` and up to [-limit, limit]."""

    kind: str = "silu"  # one of GATED_ACTIVATIONS
    alpha: float = 1.0
    limit: float = 0.0

    @property
    def code(self) -> int:
        return GATED_ACTIVATIONS.index(self.kind)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


_ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def get_activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; known: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]
