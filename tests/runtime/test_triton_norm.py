"""The fused RMSNorm (+ residual) Triton kernel under TRITON_INTERPRET=1 on CPU, against the torch reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402

from shardserve.runtime.layers import triton_norm  # noqa: E402
from shardserve.runtime.layers.norm import RMSNorm, add_rms_norm_reference, rms_norm_reference  # noqa: E402


def inputs(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=generator) * 3).to(dtype)
    residual = torch.randn(shape, generator=generator).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=generator)).to(dtype)
    return x, residual, weight


TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("shape", [(5, 64), (3, 100), (1, 48)])  # 100 and 48: masked tail of the block
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_matches_reference(shape, dtype):
    x, residual, weight = inputs(shape, dtype)
    out, new_residual = triton_norm.add_rms_norm(x, residual, weight, 1e-6)
    expected, expected_residual = add_rms_norm_reference(x, residual, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(new_residual, expected_residual)  # the sum is rounded to the input dtype, as in torch
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert not torch.allclose(out.float(), (x + residual).float(), atol=1e-2), "control: the norm did something"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_of_strided_heads_matches_reference(dtype):
    """Qwen3's q/k norm: [tokens, heads, head_dim] views of a wider qkv row, normed per head."""
    qkv, _, _ = inputs((4, 3 * 32 + 16), dtype, seed=1)
    weight = inputs((1, 16), dtype, seed=2)[2]
    q = qkv[:, :96].view(4, 6, 16)  # strides (112, 16, 1): not viewable as rows
    out = triton_norm.rms_norm(q, weight, 1e-5)
    torch.testing.assert_close(out, rms_norm_reference(q, weight, 1e-5), **TOLERANCE[dtype])
    assert out.shape == q.shape


def test_empty_batch_and_module_path_on_cpu():
    x, residual, weight = inputs((0, 32), torch.float32)
    out, new_residual = triton_norm.add_rms_norm(x, residual, weight, 1e-6)
    assert out.shape == (0, 32) and new_residual.shape == (0, 32)
    norm = RMSNorm(32, eps=1e-6)
    x, residual, _ = inputs((3, 32), torch.float32)
    normed, summed = norm(x, residual)  # CPU: the torch reference
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, triton_norm.rms_norm(x + residual, norm.weight, 1e-6), atol=1e-5, rtol=1e-5)
