"""On the GPU in bf16 at Qwen3-Next-80B's per-rank shapes (tp 1: 16 key heads, 32 value heads, head dims 128,
conv kernel 4): Gated DeltaNet's varlen kernels against the torch references, on a decode step (also inside a
CUDA graph) and on a mixed step of long prompts, continuing chunks and decodes. Written without a GPU at hand;
their speed against the torch paths belongs in bench/."""

from __future__ import annotations

import torch

from shardserve.runtime.layers import triton_gated_delta as kernels
from shardserve.runtime.layers.gated_delta_ops import (causal_conv1d, causal_conv1d_step, chunk_gated_delta_rule,
                                                       recurrent_gated_delta_step)

K_HEADS, V_HEADS, HEAD, KERNEL, SLOTS = 16, 32, 128, 4, 130
DIM = 2 * K_HEADS * HEAD + V_HEADS * HEAD


def case(num_requests: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(num_requests, DIM, device="cuda", generator=gen).bfloat16()
    weight = (0.3 * torch.randn(DIM, KERNEL, device="cuda", generator=gen)).bfloat16()
    g = -2 * torch.rand(num_requests, V_HEADS, device="cuda", generator=gen)
    beta = torch.rand(num_requests, V_HEADS, device="cuda", generator=gen).bfloat16()
    conv = torch.randn(SLOTS, DIM, KERNEL - 1, device="cuda", generator=gen).bfloat16()
    rec = torch.randn(SLOTS, V_HEADS, HEAD, HEAD, device="cuda", generator=gen)
    slots = torch.randperm(SLOTS - 1, device="cuda", generator=gen)[:num_requests]
    seq_lens = torch.randint(1, 5000, (num_requests,), device="cuda", generator=gen, dtype=torch.int32)
    seq_lens[::7] = 1  # requests at token 0: their rows are stale
    starts = torch.arange(num_requests + 1, device="cuda", dtype=torch.int32)
    return qkv, weight, g, beta, conv, rec, (slots, seq_lens, starts)


def split(mixed):
    key = K_HEADS * HEAD
    q, k, v = mixed.split([key, key, V_HEADS * HEAD], dim=-1)
    return q.unflatten(-1, (K_HEADS, HEAD)), k.unflatten(-1, (K_HEADS, HEAD)), v.unflatten(-1, (V_HEADS, HEAD))


def torch_decode(qkv, weight, g, beta, conv, rec, index):
    slots, seq_lens, starts = index
    live = (seq_lens - (starts[1:] - starts[:-1])) > 0
    c = torch.where(live[:, None, None], conv.index_select(0, slots), 0)
    mixed, c = causal_conv1d_step(qkv, weight, c)
    r = torch.where(live[:, None, None, None], rec.index_select(0, slots), 0)
    out, r = recurrent_gated_delta_step(*split(mixed), g, beta, r)
    conv.index_copy_(0, slots, c.to(conv.dtype))
    rec.index_copy_(0, slots, r)
    return out


def triton_step(qkv, weight, g, beta, conv, rec, index):
    mixed = kernels.causal_conv1d_varlen(qkv, weight, conv, *index)
    return kernels.gated_delta_rule_varlen(*split(mixed), g, beta, rec, *index)


def test_decode_kernels_match_torch_and_replay_in_a_graph():
    for num_requests in (1, 7, 64, 128):
        qkv, weight, g, beta, conv, rec, index = case(num_requests)
        conv2, rec2 = conv.clone(), rec.clone()
        expected = torch_decode(qkv, weight, g, beta, conv, rec, index)
        out = triton_step(qkv, weight, g, beta, conv2, rec2, index)
        torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(rec2, rec, atol=3e-2, rtol=3e-2)  # q, k, v from a bf16 conv rounded once, not twice
        torch.testing.assert_close(conv2, conv, atol=0, rtol=0)
    qkv, weight, g, beta, conv, rec, index = case(64, seed=1)
    conv_ref, rec_ref = conv.clone(), rec.clone()
    expected = [torch_decode(qkv, weight, g, beta, conv_ref, rec_ref, index) for _ in range(3)]
    triton_step(qkv, weight, g, beta, conv.clone(), rec.clone(), index)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_step(qkv, weight, g, beta, conv, rec, index)
    for step in range(3):  # capturing ran nothing; each replay is one more decode step from the same rows
        graph.replay()
        torch.testing.assert_close(out, expected[step], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(rec, rec_ref, atol=3e-2, rtol=3e-2)  # q, k, v from a bf16 conv rounded once, not twice


# (query_len, context_len): fresh prompts across many 64-token chunks, continuing chunks, 1-token prompts, decodes
MIXED = [(700, 0), (1, 0), (300, 500), (64, 64), (1, 4000), (130, 0), (2, 1)] + [(1, 900)] * 9


def torch_prefill(qkv, weight, g, beta, conv, rec, index):
    """GatedDeltaNet.prefill's loop: each request alone from its rows (None at token 0), rows written back."""
    slots, seq_lens, starts = index
    outs = []
    for r, slot in enumerate(slots.tolist()):
        lo, hi = starts[r].item(), starts[r + 1].item()
        has_context = seq_lens[r].item() > hi - lo
        mixed, c = causal_conv1d(qkv[lo:hi], weight, conv[slot] if has_context else None)
        out, state = chunk_gated_delta_rule(*split(mixed), g[lo:hi], beta[lo:hi], rec[slot] if has_context else None)
        conv[slot], rec[slot] = c.to(conv.dtype), state
        outs.append(out)
    return torch.cat(outs)


def test_varlen_kernels_on_a_mixed_step_match_the_torch_prefill():
    query_lens, context_lens = zip(*MIXED)
    qkv, weight, g, beta, conv, rec, _ = case(sum(query_lens), seed=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    slots = torch.randperm(SLOTS - 1, device="cuda", generator=gen)[:len(MIXED)]
    seq_lens = torch.tensor([q + c for q, c in MIXED], dtype=torch.int32, device="cuda")
    starts = torch.tensor((0, *query_lens), device="cuda").cumsum(0).to(torch.int32)
    index = (slots, seq_lens, starts)
    conv2, rec2 = conv.clone(), rec.clone()
    expected = torch_prefill(qkv, weight, g, beta, conv, rec, index)
    out = triton_step(qkv, weight, g, beta, conv2, rec2, index)  # the same two launches serve every step
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(rec2, rec, atol=3e-2, rtol=3e-2)  # fp32 states from bf16 q, k, v
    torch.testing.assert_close(conv2, conv, atol=0, rtol=0)  # copies of inputs
