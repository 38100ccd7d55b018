"""RMSNorm (with the residual add folded in) and LayerNorm."""

from __future__ import annotations

import torch
from torch import nn



def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama reference: statistics in float32, the normalized row back in x's dtype, times weight."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return rms_norm_reference(x, weight, eps), x


class RMSNorm(nn.Module):
    """Computed in float32 like the Llama reference. forward(x, residual) adds the residual first and
    returns (normed, new_residual) so decoder layers carry the residual stream without extra adds.
    NOTE: on CUDA one Triton kernel does the add and the norm (runtime/layers/triton_norm.py): it
    reads and writes each element once where the torch ops make ~8 passes with float32 temporaries."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:
            from shardserve.runtime.layers import triton_norm  # triton is needed only on CUDA
            if residual is None:
                return triton_norm.rms_norm(x, self.weight, self.eps)
            return triton_norm.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm_reference(x, self.weight, self.eps)
        return add_rms_norm_reference(x, residual, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """torch LayerNorm whose parameters load whole on every rank."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, dtype: torch.dtype | None = None):
        super().__init__(hidden_size, eps=eps, bias=bias, dtype=dtype)
        for param in self.parameters():
            param.requires_grad_(False)
