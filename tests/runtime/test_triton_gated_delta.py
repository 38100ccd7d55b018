"""Gated DeltaNet's varlen kernels under TRITON_INTERPRET=1 on CPU against the torch references: a decode
step (against the batched steps) and a mixed step (against the per-request causal conv and chunked rule)
over state slots, a stale row for a request at token 0, rows of other slots untouched; and the layer's
forward through the kernels against its torch path."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the import below

import pytest  # noqa: E402
import torch  # noqa: E402

from shardserve.runtime.layers import gated_delta_net, triton_gated_delta  # noqa: E402
from shardserve.runtime.layers.gated_delta_ops import (causal_conv1d, causal_conv1d_step,  # noqa: E402
                                                       chunk_gated_delta_rule, recurrent_gated_delta_step)
from tests.runtime.test_gated_delta_ops import make_layer, metadata, run  # noqa: E402

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
    out = triton_gated_delta.causal_conv1d_varlen(x, weight, states, *index_tensors())
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
    out = triton_gated_delta.gated_delta_rule_varlen(*inputs, states, *index_tensors())
    assert out.dtype == dtype and out.shape == expected_out.shape
    torch.testing.assert_close(out, expected_out, **TOLERANCE[dtype])
    torch.testing.assert_close(states, expected_states, atol=1e-5, rtol=1e-5)  # float32 in both
    assert torch.equal(states[[1, 4]], expected_states[[1, 4]]), "rows of other slots are untouched"


def test_empty_batch_launches_nothing():
    (q, k, v, g, beta), states = delta_inputs(2, 4, 16, 8, torch.float32)
    empty = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    before = states.clone()
    assert triton_gated_delta.gated_delta_rule_varlen(q[:0], k[:0], v[:0], g[:0], beta[:0], states, *empty).shape == (0, 4, 8)
    assert triton_gated_delta.causal_conv1d_varlen(torch.zeros(0, 12), torch.ones(12, 4), torch.zeros(2, 12, 3),
                                                   *empty).shape == (0, 12)
    assert torch.equal(states, before)


# ---- a mixed step: (query_len, seq_len, slot) per request

MIXED = [(5, 5, 3),  # a fresh prompt
         (4, 10, 0),  # a continuing chunk of a prompt, from its state
         (1, 8, 5),  # a decode
         (1, 1, 2),  # a 1-token prompt: its slot's row is stale
         (2, 3, 6),  # a chunk shorter than the conv window: the new conv state is old state | x
         (1, 4, 1)]  # a decode
MIXED_SLOTS = 8  # slots 4 and 7 belong to no request


def mixed_index() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    starts = torch.tensor([0] + [n for n, _, _ in MIXED], dtype=torch.int32).cumsum(0).to(torch.int32)
    return (torch.tensor([slot for _, _, slot in MIXED]), torch.tensor([n for _, n, _ in MIXED], dtype=torch.int32),
            starts)


def reference_mixed(run_one, states: torch.Tensor, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request alone through run_one(*its inputs, its state row or None) -> (out, state), as
    GatedDeltaNet.prefill does; the outputs concatenated, the states written to a copy of `states`."""
    states, outs, start = states.clone(), [], 0
    for num_tokens, seq_len, slot in MIXED:
        part = [x[start:start + num_tokens] for x in inputs]
        out, row = run_one(*part, states[slot] if seq_len > num_tokens else None)
        states[slot] = row.to(states.dtype)
        outs.append(out)
        start += num_tokens
    return torch.cat(outs), states


@pytest.mark.parametrize("dim,kernel", [(12, 4), (200, 4), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_over_a_mixed_step_matches_reference(dim, kernel, dtype):
    gen = torch.Generator().manual_seed(dim + kernel)
    num_tokens = sum(n for n, _, _ in MIXED)
    x = torch.randn(num_tokens, dim + 8, generator=gen).to(dtype)[:, 8:]  # strided rows
    weight = torch.randn(dim, 1, kernel, generator=gen).to(dtype)[:, 0]
    states = torch.randn(MIXED_SLOTS, dim, kernel - 1, generator=gen).to(dtype)
    expected_out, expected_states = reference_mixed(lambda x, state: causal_conv1d(x, weight, state), states, (x,))
    out = triton_gated_delta.causal_conv1d_varlen(x, weight, states, *mixed_index())
    torch.testing.assert_close(out, expected_out, **TOLERANCE[dtype])
    torch.testing.assert_close(states, expected_states, atol=0, rtol=0)  # copies of inputs: exact


@pytest.mark.parametrize("heads", [(2, 4, 16, 8), (1, 2, 24, 40)])  # 24, 40: masked; 40: 2 blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_rule_over_a_mixed_step_matches_the_chunked_rule(heads, dtype):
    num_k_heads, num_v_heads, head_k_dim, head_v_dim = heads
    gen = torch.Generator().manual_seed(head_k_dim + head_v_dim)
    num_tokens, key = sum(n for n, _, _ in MIXED), num_k_heads * head_k_dim
    mixed = torch.randn(num_tokens, 2 * key + num_v_heads * head_v_dim, generator=gen).to(dtype)
    q, k, v = mixed.split([key, key, num_v_heads * head_v_dim], dim=-1)  # strided views, as split_heads gives
    q, k, v = q.unflatten(-1, (num_k_heads, -1)), k.unflatten(-1, (num_k_heads, -1)), v.unflatten(-1, (num_v_heads, -1))
    g = -2 * torch.rand(num_tokens, num_v_heads, generator=gen)
    beta = torch.rand(num_tokens, num_v_heads, generator=gen).to(dtype)
    states = torch.randn(MIXED_SLOTS, num_v_heads, head_k_dim, head_v_dim, generator=gen)
    expected_out, expected_states = reference_mixed(chunk_gated_delta_rule, states, (q, k, v, g, beta))
    out = triton_gated_delta.gated_delta_rule_varlen(q, k, v, g, beta, states, *mixed_index())
    assert out.dtype == dtype and out.shape == expected_out.shape
    torch.testing.assert_close(out, expected_out, **TOLERANCE[dtype])
    torch.testing.assert_close(states, expected_states, atol=2e-5, rtol=1e-5)  # float32 in both
    assert torch.equal(states[[4, 7]], expected_states[[4, 7]]), "rows of other slots are untouched"


def test_layer_forward_through_the_kernels_matches_its_torch_path(monkeypatch):
    """Requests a (slot 2), b (slot 0) and c (slot 1) through a prefill step, a mixed step (c a 1-token
    prompt) and a decode step as inside a CUDA graph: the layer with its kernels forced and the layer on its
    torch path give equal outputs and states after every step."""
    triton_layer, torch_layer = make_layer(), make_layer()
    torch.manual_seed(2)
    steps = [([7, 5], [7, 5], [2, 0], False), ([4, 1, 1], [11, 6, 1], [2, 0, 1], False),
             ([1, 1, 1], [12, 7, 2], [2, 0, 1], True)]
    for query_lens, seq_lens, slots, in_graph in steps:
        meta = metadata(query_lens, seq_lens, slots, in_graph)
        through_both_paths(monkeypatch, triton_layer, torch_layer, torch.randn(sum(query_lens), 64), meta)


def through_both_paths(monkeypatch, triton_layer, torch_layer, hidden: torch.Tensor, meta) -> None:
    """The step through the layer with its kernels forced and through the other on its torch path: equal
    outputs and slot states."""
    expected = run(torch_layer, hidden, meta)
    with monkeypatch.context() as patch:
        patch.setattr(gated_delta_net, "uses_kernels", lambda x: True)
        out = run(triton_layer, hidden, meta)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    for mine, theirs in zip(triton_layer.states or (), torch_layer.states or ()):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)


def test_a_step_verifying_drafts_keeps_each_tokens_states_as_the_torch_path_does(monkeypatch):
    """A mixed step where a (slot 2) verifies 4 tokens (its last and 3 drafts), b (slot 0) runs a prompt chunk and
    c (slot 1) decodes: through the kernels and through the torch path (verify_tokens), the outputs, the slots'
    states and a's state after each of its tokens agree; the rows of requests that verify nothing stay as they were."""
    triton_layer, torch_layer = make_layer(), make_layer()
    for layer in (triton_layer, torch_layer):
        layer.verify_states = tuple(torch.full((5, 4, *spec.shape), 7.0).to(spec.dtype) for spec in layer.state_specs())
    torch.manual_seed(3)
    meta = metadata([4, 3, 1], [10, 3, 6], [2, 0, 1])
    meta.verifying, meta.verifying_flags = (True, False, False), torch.tensor([1, 0, 0], dtype=torch.int32)
    through_both_paths(monkeypatch, triton_layer, torch_layer, torch.randn(8, 64), meta)
    for mine, theirs in zip(triton_layer.verify_states or (), torch_layer.verify_states or ()):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-4)
        assert not torch.equal(mine[2], torch.full_like(mine[2], 7.0)) and torch.equal(mine[[0, 1, 3, 4]], theirs[
            [0, 1, 3, 4]]) and bool((mine[[0, 1, 3, 4]] == 7.0).all())
        torch.testing.assert_close(mine[2, 3], (triton_layer.states or ())[len(mine.shape) - 4][2].to(mine.dtype))
