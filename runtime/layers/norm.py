"""RMSNorm (with the residual add folded in) and LayerNorm."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.runtime.layers.weights import default_weight_loader


class RMSNorm(nn.Module):
    """Computed in float32 like the Llama reference. forward(x, residual) adds the residual first and
    returns (normed, new_residual) so decoder layers carry the residual stream without extra adds."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm(nn.LayerNorm):
    """torch LayerNorm whose parameters load whole on every rank."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, dtype: torch.dtype | None = None):
        super().__init__(hidden_size, eps=eps, bias=bias, dtype=dtype)
        for param in self.parameters():
            param.requires_grad_(False)
            param.weight_loader = default_weight_loader
