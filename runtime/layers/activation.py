"""Activation functions by their config.json names, and the gated SiLU of Llama-style MLPs."""

from __future__ import annotations

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
