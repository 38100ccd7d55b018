"""Triton SiLU-and-mul: [n, 2d] (gate | up) -> [n, d] in one pass, one read of each input and one write."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, size, BLOCK: tl.constexpr):
    """One row, BLOCK columns per program. Rounding follows the torch reference (SiluAndMul): silu in
    fp32 rounded to the input dtype, then the product in fp32 rounded once more."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * size + cols, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] -> [..., d] silu(gate) * up, contiguous."""
    size = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], size), dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(*x.shape[:-1], size)
    block = min(1024, triton.next_power_of_2(size))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, block))](rows, out, rows.stride(0), size, BLOCK=block,
                                                                    num_warps=4)
    return out.view(*x.shape[:-1], size)
