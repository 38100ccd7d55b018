"""The batched LoRA gathered matmul: lora_batch's sorted layout, the torch reference against a per-token
loop, and the Triton kernel under TRITON_INTERPRET=1 on CPU against the reference (shrink and expand,
strided views, tokens without an adapter, sizes that are not multiples of the tiles)."""

from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from shardserve.runtime.layers import triton_lora  # noqa: E402
from shardserve.runtime.layers.lora_batch import lora_batch  # noqa: E402
from shardserve.runtime.layers.lora_ops import gathered_matmul, gathered_matmul_reference  # noqa: E402

SLOTS = [1, -1, 0, 1, 2, -1, 1]  # 7 tokens, 4 slots: slot 3 unused, two tokens without an adapter
# NOTE: the interpreter converts float32 -> bf16 by truncation: one bf16 step from torch's rounding at most
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def exact_bf16_dot(monkeypatch):
    """NOTE: Triton's interpreter hands bf16 tl.dot operands to numpy as their raw uint16 bits (numpy has no
    bf16), so every bf16 product is garbage (test_triton_moe.py tests fp16 for that reason). Widening them to
    float32 first computes what the GPU does: bf16 products are exact in float32. Other dtypes pass as
    they are, and loads, masks, casts and stores stay the interpreter's own."""
    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(builder, a, b, *rest):
        if a.dtype.scalar == tl.bfloat16:
            a, b = builder.cast_impl(a, tl.float32), builder.cast_impl(b, tl.float32)
        return original(builder, a, b, *rest)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def per_token_loop(x, w, out, slots, add: bool) -> torch.Tensor:
    """What the operation means, one token at a time: a copy of out with every adapter row computed."""
    result = out.clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            result[t] = result[t] if add else 0
            continue
        row = x[t].float() @ w[slot].float().T
        result[t] = (row + out[t].float() if add else row).to(out.dtype)
    return result


def assert_slots_matter(x, w, out, slots, add: bool) -> None:
    """Control: every token on slot 0 gives another answer, so a kernel reading the wrong slot fails."""
    one_slot = [0 if s >= 0 else s for s in slots]
    assert not torch.allclose(per_token_loop(x, w, out, one_slot, add).float(),
                              per_token_loop(x, w, out, slots, add).float(), atol=1e-2)


def test_lora_batch_sorts_tokens_by_slot():
    batch = lora_batch(np.array(SLOTS), num_slots=4, device="cpu")
    assert batch.token_slots.tolist() == SLOTS
    assert batch.sorted_tokens.tolist() == [2, 0, 3, 6, 4, 1, 5]  # stable within a slot, no slot last
    assert batch.slot_starts.tolist() == [0, 1, 4, 5, 5]
    assert batch.active_slots == (0, 1, 2)
    assert batch.max_tokens_per_slot == 3
    assert {t.dtype for t in (batch.token_slots, batch.sorted_tokens, batch.slot_starts)} == {torch.int32}
    empty = lora_batch(np.zeros(0, dtype=np.int64), num_slots=2, device="cpu")
    assert empty.slot_starts.tolist() == [0, 0, 0] and empty.active_slots == () and empty.max_tokens_per_slot == 0
    with pytest.raises(ValueError, match="token slots"):
        lora_batch(np.array([0, 4]), num_slots=4, device="cpu")


@pytest.mark.parametrize("add", [False, True])
def test_reference_matches_per_token_loop(add):
    x, w = randn(7, 40, seed=0), randn(4, 24, 40, seed=1)
    out = randn(7, 24, seed=2)
    expected = per_token_loop(x, w, out, SLOTS, add)
    assert_slots_matter(x, w, out, SLOTS, add)
    batch = lora_batch(np.array(SLOTS), num_slots=4, device="cpu")
    for op in (gathered_matmul_reference, gathered_matmul):  # on CPU gathered_matmul is the reference
        result = out.clone()
        op(x, w, result, batch, add)
        torch.testing.assert_close(result, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(result[1], out[1] if add else torch.zeros(24))  # a token without an adapter


def run_both(x, w, out, slots, num_slots: int, add: bool, max_tokens_per_slot: int | None = None):
    """(kernel's out, reference's out), each on its own copy of out's base tensor."""
    batch = lora_batch(np.array(slots), num_slots=num_slots, device="cpu")
    if max_tokens_per_slot is not None:
        batch = dataclasses.replace(batch, max_tokens_per_slot=max_tokens_per_slot)
    base = out._base if out._base is not None else out
    kernel_base, reference_base = base.clone(), base.clone()
    offset, size, strides = out.storage_offset(), out.shape, out.stride()
    triton_lora.lora_gathered_matmul(x, w, kernel_base.as_strided(size, strides, offset), batch, add)
    gathered_matmul_reference(x, w, reference_base.as_strided(size, strides, offset), batch, add)
    return kernel_base, reference_base


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 16])
def test_shrink_matches_reference(dtype, rank):
    """x [7, 40] @ lora_a^T with lora_a = a[:, 1] of an [L, S, rank, K] buffer: N = rank < 16 at rank 8."""
    a = randn(4, 2, rank, 40, seed=rank, dtype=dtype)
    x, w = randn(7, 40, seed=3, dtype=dtype), a[:, 1]
    out = randn(7, rank, seed=4, dtype=dtype)  # garbage a shrink must overwrite, zeros where no slot
    kernel, reference = run_both(x, w, out, SLOTS, 4, add=False)
    torch.testing.assert_close(kernel, reference, **TOLERANCE[dtype])
    assert torch.equal(kernel[[1, 5]], torch.zeros(2, rank, dtype=dtype))
    assert_slots_matter(x, w, out, SLOTS, add=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 16])
def test_expand_adds_into_output_slice(dtype, rank):
    """y[:, 3:27] += x [7, rank] @ lora_b^T, lora_b = b[:, 5:29] of a wider [L, 40, rank] buffer: K = rank."""
    b = randn(4, 40, rank, seed=10 + rank, dtype=dtype)
    x, w = randn(7, rank, seed=5, dtype=dtype), b[:, 5:29]
    y = randn(7, 40, seed=6, dtype=dtype)
    kernel, reference = run_both(x, w, y[:, 3:27], SLOTS, 4, add=True)
    torch.testing.assert_close(kernel, reference, **TOLERANCE[dtype])
    assert torch.equal(kernel[[1, 5]], y[[1, 5]])  # tokens without an adapter untouched
    assert torch.equal(kernel[:, :3], y[:, :3]) and torch.equal(kernel[:, 27:], y[:, 27:])  # outside the slice
    assert_slots_matter(x, w, y[:, 3:27], SLOTS, add=True)


@pytest.mark.parametrize("add", [False, True])
def test_weight_with_non_unit_inner_stride(add):
    """w [L, N, K] as the transpose of an [L, K, N] buffer (stride N along K), strided x rows, K = 40
    over two float32 K tiles of 32 (the second masked)."""
    w = randn(3, 40, 12, seed=7).transpose(1, 2)  # [3, 12, 40], strides (480, 1, 12)
    x = randn(5, 48, seed=8)[:, 4:44]  # row stride 48
    slots = [2, 0, -1, 2, 1]
    kernel, reference = run_both(x, w, randn(5, 12, seed=9), slots, 3, add)
    torch.testing.assert_close(kernel, reference, **TOLERANCE[torch.float32])
    assert_slots_matter(x, w, randn(5, 12, seed=9), slots, add)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_tokens_per_slot_and_upper_bound_grid(dtype):
    """70 tokens on slot 1 take two 64-row blocks; a grid sized for T (an upper bound) has programs past
    every slot's run, which must exit without writing. K = 100 spans several K tiles."""
    slots = [1] * 70 + [0, -1, 2, 0]
    x, w = randn(74, 100, seed=11, dtype=dtype), randn(3, 16, 100, seed=12, dtype=dtype)
    out = randn(74, 16, seed=13, dtype=dtype)
    for bound in (None, len(slots)):
        kernel, reference = run_both(x, w, out, slots, 3, add=True, max_tokens_per_slot=bound)
        torch.testing.assert_close(kernel, reference, **TOLERANCE[dtype])
        assert torch.equal(kernel[71], out[71])
    assert triton_lora.block_sizes(70, 16, 100, dtype == torch.float32)[0] == 64


def test_empty_batch_and_shape_errors():
    x, w = randn(0, 16, seed=14), randn(2, 8, 16, seed=15)
    out = torch.empty(0, 8)
    triton_lora.lora_gathered_matmul(x, w, out, lora_batch(np.zeros(0, dtype=np.int64), 2, "cpu"), add=False)
    batch = lora_batch(np.array([0, 1]), num_slots=2, device="cpu")
    with pytest.raises(ValueError, match="do not chain"):
        triton_lora.lora_gathered_matmul(randn(2, 16, seed=16), w, torch.empty(2, 9), batch, add=False)
    with pytest.raises(ValueError, match="unit stride"):
        triton_lora.lora_gathered_matmul(randn(16, 2, seed=17).T, w, torch.empty(2, 8), batch, add=False)


@pytest.mark.parametrize("add", [False, True])
def test_rows_past_the_batch_have_no_adapter(add):
    """A CUDA graph pads x and out past the step's tokens: those rows get zeros (shrink) or stay (expand)."""
    x, w, out = randn(9, 20, seed=18), randn(4, 8, 20, seed=19), randn(9, 8, seed=20)
    kernel, reference = run_both(x, w, out, SLOTS, 4, add)
    torch.testing.assert_close(kernel, reference, **TOLERANCE[torch.float32])
    assert torch.equal(kernel[7:], out[7:] if add else torch.zeros(2, 8))
    with pytest.raises(ValueError, match="batch has 7 tokens"):
        gathered_matmul_reference(x[:6], w, out[:6], lora_batch(np.array(SLOTS), 4, "cpu"), add)
