"""Triton RMSNorm with the residual add fused in: one read of x and the residual, one write of each output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_stride, residual_stride,
                     hidden_size, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row. Rounding follows the torch reference step for step: the sum in the input dtype,
    the statistics in fp32, the normalized row back to the input dtype, then times the weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * hidden_size + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden_size + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden_size + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., hidden] -> [rows, hidden] with unit stride along hidden (a view where possible)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(rows, residual_rows, weight, out, residual_out, eps: float) -> None:
    hidden_size = rows.shape[1]
    if rows.shape[0] == 0:
        return
    block = triton.next_power_of_2(hidden_size)
    has_residual = residual_rows is not None
    residual_rows = residual_rows if has_residual else rows  # unread when HAS_RESIDUAL is False
    _rms_norm_kernel[(rows.shape[0],)](rows, residual_rows, weight, out, residual_out if has_residual else out,
                                       rows.stride(0), residual_rows.stride(0), hidden_size, eps,
                                       HAS_RESIDUAL=has_residual, BLOCK=block,
                                       num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden], weight: [hidden] -> norm(x) * weight, contiguous, x's shape and dtype."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch(rows, None, weight, out, None, eps)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., hidden] -> (norm(x + residual) * weight, x + residual)."""
    rows, residual_rows = _rows(x), _rows(residual)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    _launch(rows, residual_rows, weight, out, residual_out, eps)
    return out.view(x.shape), residual_out.view(x.shape)
