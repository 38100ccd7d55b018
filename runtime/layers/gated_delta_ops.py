"""Torch reference ops of Gated DeltaNet: the short causal convolution and the gated delta rule, chunked
(prefill) and one step at a time (decode, batched over requests), each carrying a state in and out.

The gated delta rule, per value head h (a key head serves num_v_heads / num_k_heads consecutive value
heads), with q and k l2-normalized and q scaled by head_k_dim ** -0.5, all in float32:

    S_t = exp(g_t) S_{t-1}                             S: [head_k_dim, head_v_dim], the state
    u_t = beta_t (v_t - S_t^T k_t)                     what the decayed state fails to recall of v_t
    S_t = S_t + k_t u_t^T                              the delta-rule write
    o_t = S_t^T q_t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
_L2_EPS = 1e-6


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through a depthwise causal convolution with SiLU.

        x:      [num_tokens, dim]             weight: [dim, kernel]
        state:  [dim, kernel - 1]             the inputs just before x (None: zeros, a fresh sequence)
        returns (out [num_tokens, dim] in x's dtype, new state [dim, kernel - 1]: the last kernel - 1
        inputs of state | x, in x's dtype)."""
    dim, kernel = weight.shape
    if state is None:
        state = x.new_zeros(dim, kernel - 1)
    window = torch.cat((state.to(x.dtype), x.t()), dim=1)  # [dim, kernel - 1 + num_tokens]
    out = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], bias, groups=dim)[0]  # [dim, num_tokens]
    return F.silu(out).t().to(x.dtype), window[:, window.shape[1] - (kernel - 1):].clone()


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                       bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per request: x [num_requests, dim], state [num_requests, dim, kernel - 1] ->
    (out [num_requests, dim], new state [num_requests, dim, kernel - 1]). Tensor ops only."""
    window = torch.cat((state.to(x.dtype), x[:, :, None]), dim=2)  # [num_requests, dim, kernel]
    out = (window.to(weight.dtype) * weight).sum(dim=-1)
    if bias is not None:
        out = out + bias
    return F.silu(out).to(x.dtype), window[:, :, 1:]


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2_EPS)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32, l2-normalized, q scaled; each key head repeated over the value heads it serves."""
    q, k = _l2_normalize(q.float()), _l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    group = num_v_heads // k.shape[-2]
    if group > 1:  # NOTE: expand, not repeat_interleave, whose CUDA path may read the repeats on the host
        q, k = (x.unsqueeze(-2).expand(*x.shape[:-1], group, x.shape[-1]).flatten(-3, -2) for x in (q, k))
    return q, k


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None,
                           chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunk by chunk.

        q, k:  [num_tokens, num_k_heads, head_k_dim]     v: [num_tokens, num_v_heads, head_v_dim]
        g, beta: [num_tokens, num_v_heads]               (g: log of the decay, <= 0)
        initial_state: [num_v_heads, head_k_dim, head_v_dim] (None: zeros)
        returns (out [num_tokens, num_v_heads, head_v_dim] in v's dtype, final state float32).

    NOTE: within a chunk of C tokens (G_t the cumulated g from the chunk's start, S_0 the state
    before it) the writes u solve the unit lower-triangular system
        u_t + beta_t sum_{j<t} exp(G_t - G_j) (k_t . k_j) u_j = beta_t (v_t - exp(G_t) S_0^T k_t)
    so C sequential steps become a few matmuls and one triangular solve; then
        o_t = exp(G_t) S_0^T q_t + sum_{j<=t} exp(G_t - G_j) (q_t . k_j) u_j
        S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T
    Only the scan over chunks is sequential."""
    num_tokens, num_v_heads, head_v_dim = v.shape
    dtype = v.dtype
    q, k = _prepare(q, k, num_v_heads)
    pad = -num_tokens % chunk_size  # zero tokens (no decay, no write) fill the last chunk
    # [num_v_heads, num_chunks, chunk_size, ...]
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, chunk_size)) for x in (q, k, v.float()))
    g, beta = (F.pad(x.float().t(), (0, pad)).unflatten(1, (-1, chunk_size)) for x in (g, beta))
    cum = g.cumsum(dim=-1)  # [heads, chunks, C]
    is_past = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()  # j <= t
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~is_past, float("-inf")).exp()  # [.., t, j]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # strictly-lower part used; the diagonal is 1
    solve = torch.linalg.solve_triangular
    writes = solve(system, v * beta[..., None], upper=False, unitriangular=True)  # u when S_0 = 0
    state_reads = solve(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    state = q.new_zeros(num_v_heads, q.shape[-1], head_v_dim) if initial_state is None else initial_state.float()
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        u = writes[:, c] - state_reads[:, c] @ state  # [heads, C, head_v_dim]
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ u
        state = state * cum[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    out = out.flatten(1, 2)[:, :num_tokens].transpose(0, 1)
    return out.to(dtype).contiguous(), state


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of a batch of requests; tensor ops only (a CUDA graph can capture it).

        q, k:  [num_requests, num_k_heads, head_k_dim]   v: [num_requests, num_v_heads, head_v_dim]
        g, beta: [num_requests, num_v_heads]             state: [num_requests, num_v_heads, head_k_dim, head_v_dim]
        returns (out [num_requests, num_v_heads, head_v_dim] in v's dtype, new state float32)."""
    q, k = _prepare(q, k, v.shape[1])
    state = state.float() * g.float().exp()[..., None, None]
    recalled = (state * k[..., None]).sum(dim=-2)  # S^T k: [requests, heads, head_v_dim]
    update = (v.float() - recalled) * beta.float()[..., None]
    state = state + k[..., None] * update[..., None, :]
    out = (state * q[..., None]).sum(dim=-2)
    return out.to(v.dtype), state
