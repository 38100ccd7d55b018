"""Gated DeltaNet's torch ops against transformers' reference functions, and the layer's state slots
through prefill chunks, mixed steps and batched decode against one pass over each whole sequence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardserve.runtime.distributed import parallel_state
from shardserve.runtime.distributed.parallel_state import ParallelState
from shardserve.runtime.layers.gated_delta_net import GatedDeltaNet
from shardserve.runtime.layers.gated_delta_ops import (causal_conv1d, causal_conv1d_step, chunk_gated_delta_rule,
                                                       recurrent_gated_delta_step)
from shardserve.runtime.worker.forward_context import AttentionMetadata, ForwardContext, forward_context

NUM_K_HEADS, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM = 2, 4, 16, 8


def hf_ops():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    return hf


def delta_inputs(num_tokens: int, seed: int = 0):
    """q, k [T, k heads, 16], v [T, v heads, 8], g <= 0 and beta in (0, 1) [T, v heads], a state."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, NUM_K_HEADS, HEAD_K_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_K_HEADS, HEAD_K_DIM, generator=gen)
    v = torch.randn(num_tokens, NUM_V_HEADS, HEAD_V_DIM, generator=gen)
    g = -2 * torch.rand(num_tokens, NUM_V_HEADS, generator=gen)
    beta = torch.rand(num_tokens, NUM_V_HEADS, generator=gen)
    state = torch.randn(NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM, generator=gen)
    return q, k, v, g, beta, state


def hf_delta_rule(function, q, k, v, g, beta, state):
    out, final = function(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


@pytest.mark.parametrize("num_tokens", [1, 64, 150])
def test_chunked_rule_matches_transformers(num_tokens):
    q, k, v, g, beta, state = delta_inputs(num_tokens)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    expected_out, expected_final = hf_delta_rule(hf_ops().torch_chunk_gated_delta_rule, q, k, v, g, beta, state)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_final, atol=1e-5, rtol=1e-5)


def test_chunked_rule_from_zero_state_is_none_state():
    q, k, v, g, beta, state = delta_inputs(20)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, None)
    torch.testing.assert_close((out, final), chunk_gated_delta_rule(q, k, v, g, beta, torch.zeros_like(state)))


@pytest.mark.parametrize("split", [1, 64, 70])
def test_chunked_rule_split_in_two_carries_the_state(split):
    q, k, v, g, beta, state = delta_inputs(150)
    whole, whole_final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    first, middle = chunk_gated_delta_rule(q[:split], k[:split], v[:split], g[:split], beta[:split], state)
    second, final = chunk_gated_delta_rule(q[split:], k[split:], v[split:], g[split:], beta[split:], middle)
    torch.testing.assert_close(torch.cat((first, second)), whole, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, whole_final, atol=2e-5, rtol=1e-5)


def test_recurrent_steps_match_transformers_and_the_chunked_rule():
    """Two requests stepped together, token by token, each equal to transformers' recurrent rule alone."""
    requests = [delta_inputs(12, seed) for seed in (1, 2)]
    states = torch.stack([r[5] for r in requests])  # [2, heads, 16, 8]
    outs = []
    for t in range(12):
        step = [torch.stack([r[i][t] for r in requests]) for i in range(5)]  # q, k, v, g, beta of token t
        out, states = recurrent_gated_delta_step(*step, states)
        outs.append(out)
    for index, (q, k, v, g, beta, state) in enumerate(requests):
        expected_out, expected_final = hf_delta_rule(hf_ops().torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
        torch.testing.assert_close(torch.stack([o[index] for o in outs]), expected_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[index], expected_final, atol=1e-5, rtol=1e-5)
        chunked_out, chunked_final = chunk_gated_delta_rule(q, k, v, g, beta, state)
        torch.testing.assert_close(chunked_out, expected_out, atol=2e-5, rtol=1e-5)


def test_conv_matches_transformers_and_carries_its_state():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(20, 12, generator=gen), torch.randn(12, 4, generator=gen)
    out, state = causal_conv1d(x, weight, None)
    expected = hf_ops().causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(state, x[-3:].t())
    for split in (1, 2, 7):  # shorter than the window, and longer
        first, middle = causal_conv1d(x[:split], weight, None)
        second, final = causal_conv1d(x[split:], weight, middle)
        torch.testing.assert_close(torch.cat((first, second)), out)
        torch.testing.assert_close(final, state)


def test_conv_steps_match_transformers_update():
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(6, 2, 12, generator=gen), torch.randn(12, 4, generator=gen)  # [steps, requests, dim]
    state = torch.randn(2, 12, 3, generator=gen)
    expected_state = state.clone()
    for t in range(6):
        out, state = causal_conv1d_step(x[t], weight, state)
        expected = hf_ops().causal_conv1d_update(x[t][:, :, None], expected_state, weight, None, "silu")[:, :, 0]
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(state, expected_state)


# ---- the layer over state slots

NUM_SLOTS = 4  # 3 requests and scratch


def tiny_config(**overrides):
    return SimpleNamespace(**{"hidden_size": 64, "linear_num_key_heads": NUM_K_HEADS, "linear_num_value_heads":
                              NUM_V_HEADS, "linear_key_head_dim": HEAD_K_DIM, "linear_value_head_dim": HEAD_V_DIM,
                              "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, **overrides})


def make_layer() -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(tiny_config())
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.normal_(0.0, 0.2 if param.dim() >= 2 else 1.0)
        layer.A_log.uniform_(-1.0, 1.0)
    # rows that earlier requests left behind: a request starting at token 0 must never read them
    layer.states = tuple(torch.randn(NUM_SLOTS, *spec.shape).to(spec.dtype) for spec in layer.state_specs())
    return layer


def metadata(query_lens: list[int], seq_lens: list[int], slots: list[int], in_graph: bool = False) -> AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.zeros(len(slots), 1, dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=starts,
        seq_lens_cpu=None if in_graph else seq_lens, state_slots=torch.tensor(slots, dtype=torch.int64))


def run(layer: GatedDeltaNet, hidden: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
    with forward_context(ForwardContext(meta, backend=None)):  # type: ignore[arg-type]  # the layer reads none
        return layer(torch.zeros(hidden.shape[0], dtype=torch.int64), hidden)


def test_layer_over_prefill_chunks_and_batched_decode_matches_whole_sequences():
    """Requests a (13 tokens, slot 2), b (8, slot 0) and c (2, slot 1) through a prefill step, a mixed
    step, and two decode-only steps (c's first: a one-token prompt in a decode step; the last as inside a
    CUDA graph, without host seq_lens): each request's outputs equal one pass over its whole sequence."""
    layer = make_layer()
    torch.manual_seed(1)
    hidden = {"a": torch.randn(13, 64), "b": torch.randn(8, 64), "c": torch.randn(2, 64)}
    slot = {"a": 2, "b": 0, "c": 1}
    steps = [({"a": (0, 7), "b": (0, 5)}, False), ({"a": (7, 11), "b": (5, 6)}, False),
             ({"a": (11, 12), "b": (6, 7), "c": (0, 1)}, False), ({"a": (12, 13), "b": (7, 8), "c": (1, 2)}, True)]
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in hidden}
    for step, in_graph in steps:
        names = list(step)
        meta = metadata([step[n][1] - step[n][0] for n in names], [step[n][1] for n in names],
                        [slot[n] for n in names], in_graph)
        assert meta.is_decode_only == (len(names) == 3)
        out = run(layer, torch.cat([hidden[n][slice(*step[n])] for n in names]), meta)
        for name, part in zip(names, out.split([step[n][1] - step[n][0] for n in names])):
            outputs[name].append(part)
    for name, whole in hidden.items():
        expected = run(layer, whole, None)  # the dry run's path: one fresh sequence, no state
        torch.testing.assert_close(torch.cat(outputs[name]), expected, atol=1e-5, rtol=1e-4)


def test_layer_state_specs_follow_the_planner_formula():
    layer = make_layer()
    conv, recurrent = layer.state_specs()
    assert conv.shape == (2 * NUM_K_HEADS * HEAD_K_DIM + NUM_V_HEADS * HEAD_V_DIM, 3) and conv.dtype == torch.float32
    assert recurrent.shape == (NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM) and recurrent.dtype == torch.float32


def test_layer_heads_must_divide_over_tensor_parallel_ranks(monkeypatch):
    monkeypatch.setattr(parallel_state, "_STATE", ParallelState(tp_rank=0, tp_size=4))
    with pytest.raises(ValueError, match=r"linear_num_key_heads=2, linear_num_value_heads=4.*tensor_parallel_size=4"):
        GatedDeltaNet(tiny_config())
    monkeypatch.setattr(parallel_state, "_STATE", ParallelState(tp_rank=1, tp_size=2))
    layer = GatedDeltaNet(tiny_config())
    conv, recurrent = layer.state_specs()
    assert conv.shape == ((2 * NUM_K_HEADS * HEAD_K_DIM + NUM_V_HEADS * HEAD_V_DIM) // 2, 3)
    assert recurrent.shape == (NUM_V_HEADS // 2, HEAD_K_DIM, HEAD_V_DIM)
