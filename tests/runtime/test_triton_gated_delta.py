"""Gated DeltaNet's decode kernels under TRITON_INTERPRET=1 on CPU against the torch references: the conv
update and the delta-rule step over state slots (a stale row for a request at token 0, rows of other slots
untouched), and the layer's decode_in_place against its torch decode."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402

from shardserve.runtime.layers import triton_gated_delta  # noqa: E402
from shardserve.runtime.layers.gated_delta_ops import causal_conv1d_step, recurrent_gated_delta_step  # noqa: E402
from tests.runtime.test_gated_delta_ops import make_layer, metadata  # noqa: E402

NUM_SLOTS = 5
SLOTS = [3, 0, 2]  # request 1 starts at token 0: its slot's row is stale
SEQ_LENS = [9, 1, 4]


def index_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots int64, seq_lens int32, query_start_loc int32) of a decode step over the three requests."""
    return (torch.tensor(SLOTS), torch.tensor(SEQ_LENS, dtype=torch.int32),
            torch.arange(len(SLOTS) + 1, dtype=torch.int32))


def reference_step(step, states: torch.Tensor, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch decode around a reference step: gather by slot, zero at token 0, step, scatter."""
    slots = torch.tensor(SLOTS)
    has_context = torch.tensor([n > 1 for n in SEQ_LENS])
    rows = states.index_select(0, slots)
    rows = torch.where(has_context.view(-1, *[1] * (rows.dim() - 1)), rows, 0)
    out, rows = step(*inputs, rows)
    states = states.clone()
    states.index_copy_(0, slots, rows.to(states.dtype))
    return out, states


TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dim,kernel", [(12, 4), (200, 4), (16, 2)])  # 200: two blocks, a masked tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_matches_reference(dim, kernel, dtype):
    gen = torch.Generator().manual_seed(dim + kernel)
    x = torch.randn(len(SLOTS), dim + 8, generator=gen).to(dtype)[:, 8:]  # strided rows
    weight = torch.randn(dim, 1, kernel, generator=gen).to(dtype)[:, 0]
    states = torch.randn(NUM_SLOTS, dim, kernel - 1, generator=gen).to(dtype)
    expected_out, expected_states = reference_step(causal_conv1d_step, states, (x, weight))
    stale_out = causal_conv1d_step(x[1:2], weight, states[SLOTS[1]][None])[0]
    out = triton_gated_delta.conv1d_decode(x, weight, states, *index_tensors())
    torch.testing.assert_close(out, expected_out, **TOLERANCE[dtype])
    torch.testing.assert_close(states, expected_states, atol=0, rtol=0)  # a shift: exact
    assert not torch.allclose(out[1:2].float(), stale_out.float(), atol=1e-2), "control: the stale row matters"


def delta_inputs(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, dtype: torch.dtype):
    """q, k, v as strided views of one mixed row per request (q | k | v, as the layer's split_heads gives),
    g <= 0 and beta [requests, num_v_heads], states [NUM_SLOTS, num_v_heads, head_k_dim, head_v_dim]."""
    gen = torch.Generator().manual_seed(num_v_heads * head_k_dim + head_v_dim)
    num_requests, key = len(SLOTS), num_k_heads * head_k_dim
    mixed = torch.randn(num_requests, 2 * key + num_v_heads * head_v_dim, generator=gen).to(dtype)
    q, k, v = mixed.split([key, key, num_v_heads * head_v_dim], dim=-1)
    q, k, v = q.unflatten(-1, (num_k_heads, -1)), k.unflatten(-1, (num_k_heads, -1)), v.unflatten(-1, (num_v_heads, -1))
    g = -2 * torch.rand(num_requests, num_v_heads, generator=gen)
    beta = torch.rand(num_requests, num_v_heads, generator=gen).to(dtype)
    states = torch.randn(NUM_SLOTS, num_v_heads, head_k_dim, head_v_dim, generator=gen)
    return (q, k, v, g, beta), states


@pytest.mark.parametrize("heads", [(2, 4, 16, 8), (1, 1, 16, 16), (1, 2, 24, 40)])  # 24, 40: masked; 40: 2 blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_step_matches_reference(heads, dtype):
    inputs, states = delta_inputs(*heads, dtype)
    expected_out, expected_states = reference_step(recurrent_gated_delta_step, states, inputs)
    out = triton_gated_delta.gated_delta_decode(*inputs, states, *index_tensors())
    assert out.dtype == dtype and out.shape == expected_out.shape
    torch.testing.assert_close(out, expected_out, **TOLERANCE[dtype])
    torch.testing.assert_close(states, expected_states, atol=1e-5, rtol=1e-5)  # float32 in both
    assert torch.equal(states[[1, 4]], expected_states[[1, 4]]), "rows of other slots are untouched"


def test_empty_batch_launches_nothing():
    (q, k, v, g, beta), states = delta_inputs(2, 4, 16, 8, torch.float32)
    empty = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    before = states.clone()
    assert triton_gated_delta.gated_delta_decode(q[:0], k[:0], v[:0], g[:0], beta[:0], states, *empty).shape == (0, 4, 8)
    assert triton_gated_delta.conv1d_decode(torch.zeros(0, 12), torch.ones(12, 4), torch.zeros(2, 12, 3),
                                            *empty).shape == (0, 12)
    assert torch.equal(states, before)


def test_layer_decode_in_place_matches_its_torch_decode():
    """Two decode steps of three requests (the middle one at token 0 in the first) through the layer's
    Triton path and its torch path, from the same slots: equal outputs and states."""
    triton_layer, torch_layer = make_layer(), make_layer()
    torch.manual_seed(2)
    for step, seq_lens in enumerate(([6, 1, 3], [7, 2, 4])):
        meta = metadata([1, 1, 1], seq_lens, [2, 0, 1], in_graph=step == 1)
        hidden = torch.randn(3, 64)
        projected = triton_layer.project(hidden)
        beta = projected[2].sigmoid()
        g = -triton_layer.A_log.float().exp() * torch.nn.functional.softplus(projected[3] + triton_layer.dt_bias)
        expected = torch_layer.decode(projected[0], g, beta, meta)
        out = triton_layer.decode_in_place(projected[0], g, beta, meta)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        for mine, theirs in zip(triton_layer.states or (), torch_layer.states or ()):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
