"""Gated DeltaNet (Qwen3-Next, Qwen3.5): linear attention whose per-request memory is a short-convolution
window and a delta-rule matrix per value head, kept in state slots (layers/recurrent_state.py).

Tensor parallel by heads: a rank holds num_k_heads / tp key heads and num_v_heads / tp value heads (the
value heads its key heads serve). The convolution runs over q | k | v channels, so its weight and the
in_proj_qkv rows are cut as three parts:

    checkpoint rows:   | q: all key heads | k: all key heads | v: all value heads |
    rank r's rows:     | q: its key heads  | k: its key heads  | v: its value heads |   (conv_dim_local)

On CUDA every step (prefill, mixed, decode) runs triton_gated_delta's varlen kernels; on CPU the torch ops
of gated_delta_ops (a loop over requests for prefill, batched tensor ops for decode), which are their reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.runtime.distributed.parallel_state import get_parallel_state
from shardserve.runtime.layers.gated_delta_ops import (causal_conv1d, causal_conv1d_step, chunk_gated_delta_rule,
                                                       recurrent_gated_delta_step)
from shardserve.runtime.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from shardserve.runtime.layers.recurrent_state import RecurrentLayer, StateSpec, context_lens
from shardserve.runtime.layers.weights import copy_into, shard_range
from shardserve.runtime.worker.checkpoint import CheckpointTensor
from shardserve.runtime.worker.forward_context import AttentionMetadata, get_forward_context


def uses_kernels(x: torch.Tensor) -> bool:
    """Whether a step on x runs triton_gated_delta's kernels (CUDA) rather than the torch ops (CPU)."""
    return x.is_cuda


@dataclass(frozen=True)
class DeltaNetShape:
    """The layer's sizes from config.json (linear_* keys); the *_local counts are one rank's."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    tp_size: int

    @staticmethod
    def of(config) -> DeltaNetShape:
        shape = DeltaNetShape(config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                              config.linear_key_head_dim, config.linear_value_head_dim,
                              config.linear_conv_kernel_dim, get_parallel_state().tp_size)
        if shape.num_v_heads % shape.num_k_heads:
            raise ValueError(f"linear_num_value_heads={shape.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={shape.num_k_heads}")
        if shape.num_k_heads % shape.tp_size or shape.num_v_heads % shape.tp_size:
            raise ValueError(f"Gated DeltaNet heads (linear_num_key_heads={shape.num_k_heads}, linear_num_value_heads="
                             f"{shape.num_v_heads}) do not divide over tensor_parallel_size={shape.tp_size}")
        return shape

    @property
    def num_k_heads_local(self) -> int:
        return self.num_k_heads // self.tp_size

    @property
    def num_v_heads_local(self) -> int:
        return self.num_v_heads // self.tp_size

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim_local(self) -> int:
        return (2 * self.key_dim + self.value_dim) // self.tp_size


class ConvWeight(nn.Module):
    """The depthwise convolution's weight [conv_dim_local, 1, kernel], this rank's q, k and v channels."""

    def __init__(self, shape: DeltaNetShape):
        super().__init__()
        self.parts = (shape.key_dim, shape.key_dim, shape.value_dim)  # the checkpoint's q | k | v channels
        self.weight = nn.Parameter(torch.empty(shape.conv_dim_local, 1, shape.conv_kernel), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        state = get_parallel_state()
        base = offset = 0
        for size in self.parts:
            start, local = shard_range(size, state.tp_rank, state.tp_size)
            copy_into(param.data[offset:offset + local], loaded.narrow(0, base + start, local))
            base, offset = base + size, offset + local


class GatedRMSNorm(nn.Module):
    """Per value head: x / rms(x) * weight * silu(gate), statistics in float32 (weight as is, not 1 + w)."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # both [..., head_dim]
        dtype = x.dtype
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * normed.to(dtype)) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(RecurrentLayer):
    """Qwen3.5's layer: in_proj_qkv (q | k | v, fused in the checkpoint), in_proj_z, in_proj_b and in_proj_a
    (loaded into in_proj_zba as shards 0, 1, 2), conv1d, A_log and dt_bias, the gated norm, out_proj.

    states (bound by the worker): conv [num_slots, conv_dim_local, kernel - 1] in the model dtype,
    recurrent [num_slots, num_v_heads_local, head_k_dim, head_v_dim] float32."""

    def __init__(self, config):
        super().__init__()
        self.shape = shape = DeltaNetShape.of(config)
        self.conv_state_dtype = torch.get_default_dtype()  # the model's (the loader builds under it)
        self.make_projections(shape)
        self.conv1d = ConvWeight(shape)
        num_v = shape.num_v_heads_local
        self.A_log = nn.Parameter(torch.empty(num_v, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(num_v), requires_grad=False)
        self.norm = GatedRMSNorm(shape.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(shape.value_dim, shape.hidden_size, bias=False)

    def make_projections(self, shape: DeltaNetShape) -> None:
        self.in_proj_qkv = MergedColumnParallelLinear(shape.hidden_size, [shape.key_dim, shape.key_dim,
                                                                          shape.value_dim], bias=False)
        self.in_proj_zba = MergedColumnParallelLinear(shape.hidden_size, [shape.value_dim, shape.num_v_heads,
                                                                          shape.num_v_heads], bias=False)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [num_tokens, hidden_size] -> qkv [num_tokens, conv_dim_local] (q | k | v), z [num_tokens,
        num_v_heads_local, head_v_dim], b and a [num_tokens, num_v_heads_local]."""
        num_v = self.shape.num_v_heads_local
        z, b, a = self.in_proj_zba(hidden).split([num_v * self.shape.head_v_dim, num_v, num_v], dim=-1)
        return self.in_proj_qkv(hidden), z.unflatten(-1, (num_v, -1)), b, a

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        """A_log and dt_bias: this rank's value heads."""
        state = get_parallel_state()
        copy_into(param.data, loaded.narrow(0, *shard_range(loaded.shape[0], state.tp_rank, state.tp_size)))

    def state_specs(self) -> tuple[StateSpec, ...]:
        shape = self.shape
        return (StateSpec((shape.conv_dim_local, shape.conv_kernel - 1), self.conv_state_dtype),
                StateSpec((shape.num_v_heads_local, shape.head_k_dim, shape.head_v_dim), torch.float32))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden_size] -> [num_tokens, hidden_size] (positions unused: order is the state)."""
        qkv, z, b, a = self.project(hidden)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # log decay, <= 0
        meta = get_forward_context().attn_metadata
        if meta is None:  # the profiling dry run: one fresh sequence, no state kept
            core = self.run_sequence(qkv, g, beta, None, None)[0]
        elif uses_kernels(qkv):
            core = self.step_in_place(qkv, g, beta, meta)
        elif meta.is_decode_only:
            core = self.decode(qkv, g, beta, meta)
        else:
            core = self.prefill(qkv, g, beta, meta)
        return self.out_proj(self.norm(core, z).flatten(1))

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = self.shape
        key_local = shape.num_k_heads_local * shape.head_k_dim
        q, k, v = qkv.split([key_local, key_local, shape.num_v_heads_local * shape.head_v_dim], dim=-1)
        return (q.unflatten(-1, (-1, shape.head_k_dim)), k.unflatten(-1, (-1, shape.head_k_dim)),
                v.unflatten(-1, (-1, shape.head_v_dim)))

    def run_sequence(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_state: torch.Tensor | None,
                     recurrent_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's tokens from its states (None: zeros) -> (core [num_tokens, num_v_heads_local,
        head_v_dim], conv state, recurrent state after them)."""
        mixed, conv_state = causal_conv1d(qkv, self.conv1d.weight[:, 0], conv_state)
        core, recurrent_state = chunk_gated_delta_rule(*self.split_heads(mixed), g, beta, recurrent_state)
        return core, conv_state, recurrent_state

    def prefill(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A step with prompt chunks (torch, CPU): each request on its own, from its slot's states (or zeros
        when its step starts at token 0), its states written back to the slot."""
        assert self.states is not None and meta.state_slots is not None and meta.seq_lens_cpu is not None
        conv_states, recurrent_states = self.states
        starts = meta.query_start_loc_cpu
        cores = []
        for r in range(meta.num_requests):
            lo, hi = starts[r], starts[r + 1]
            slot = meta.state_slots[r:r + 1]  # [1] on the device: no host read
            has_context = meta.seq_lens_cpu[r] > hi - lo
            conv = conv_states.index_select(0, slot)[0] if has_context else None
            recurrent = recurrent_states.index_select(0, slot)[0] if has_context else None
            if meta.verifying and meta.verifying[r]:
                core, conv, recurrent = self.verify_tokens(qkv[lo:hi], g[lo:hi], beta[lo:hi], conv, recurrent, slot)
            else:
                core, conv, recurrent = self.run_sequence(qkv[lo:hi], g[lo:hi], beta[lo:hi], conv, recurrent)
            conv_states.index_copy_(0, slot, conv[None].to(conv_states.dtype))
            recurrent_states.index_copy_(0, slot, recurrent[None])
            cores.append(core)
        return torch.cat(cores)

    def verify_tokens(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv: torch.Tensor | None,
                      recurrent: torch.Tensor | None, slot: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A request's last token and drafts (speculative decoding), a token at a time from its states, the states
        after each kept in `verify_states` at its slot (worker/state_rollback.py keeps the right one next step)."""
        assert self.verify_states is not None  # bound when speculative decoding is on
        weight, (conv_rows, recurrent_rows) = self.conv1d.weight[:, 0], self.verify_states
        shape = self.shape
        conv = qkv.new_zeros(shape.conv_dim_local, shape.conv_kernel - 1) if conv is None else conv
        recurrent = recurrent if recurrent is not None else torch.zeros(recurrent_rows.shape[2:], device=qkv.device)
        cores = []
        for j in range(qkv.shape[0]):
            mixed, conv_step = causal_conv1d_step(qkv[j:j + 1], weight, conv[None])
            core, recurrent_step = recurrent_gated_delta_step(*self.split_heads(mixed), g[j:j + 1], beta[j:j + 1],
                                                              recurrent[None])
            conv, recurrent = conv_step[0], recurrent_step[0]
            conv_rows[slot, j] = conv.to(conv_rows.dtype)
            recurrent_rows[slot, j] = recurrent
            cores.append(core)
        return torch.cat(cores), conv, recurrent

    def decode(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One token per request (torch, CPU), all requests at once with no host read: rows gathered by slot,
        zeroed on the device for requests at token 0, scattered back."""
        assert self.states is not None and meta.state_slots is not None
        conv_states, recurrent_states = self.states
        slots = meta.state_slots  # [num_requests]
        has_context = context_lens(meta.seq_lens, meta.query_start_loc) > 0  # [num_requests] on the device
        conv = torch.where(has_context[:, None, None], conv_states.index_select(0, slots), 0)
        mixed, conv = causal_conv1d_step(qkv, self.conv1d.weight[:, 0], conv)
        recurrent = torch.where(has_context[:, None, None, None], recurrent_states.index_select(0, slots), 0)
        core, recurrent = recurrent_gated_delta_step(*self.split_heads(mixed), g, beta, recurrent)
        conv_states.index_copy_(0, slots, conv.to(conv_states.dtype))
        recurrent_states.index_copy_(0, slots, recurrent)
        return core

    def step_in_place(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        """Any step (prefill, mixed, decode) through triton_gated_delta's varlen kernels: one launch per op
        over all requests, each reading and writing its state rows in place by slot, with no host read (a
        decode step is CUDA-graph capturable).

        NOTE: two launches instead of a Python loop over requests (prefill) or a gather, a dozen elementwise
        kernels and a scatter (decode); the recurrent state is read and written once per request."""
        from shardserve.runtime.layers import triton_gated_delta as kernels  # triton is needed only here

        assert self.states is not None and meta.state_slots is not None
        conv_states, recurrent_states = self.states
        index = (meta.state_slots, meta.seq_lens, meta.query_start_loc)
        flags, conv_rows, recurrent_rows = meta.verifying_flags, None, None  # a verify step keeps each token's too
        if flags is not None:
            assert self.verify_states is not None  # bound when speculative decoding is on
            conv_rows, recurrent_rows = self.verify_states
        mixed = kernels.causal_conv1d_varlen(qkv, self.conv1d.weight[:, 0], conv_states, *index, conv_rows, flags)
        return kernels.gated_delta_rule_varlen(*self.split_heads(mixed), g, beta, recurrent_states, *index,
                                               recurrent_rows, flags)


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next's layer: in_proj_qkvz and in_proj_ba interleaved per key-head group,

        in_proj_qkvz rows:  | group 0: q (head_k_dim) k (head_k_dim) v (n * head_v_dim) z (n * head_v_dim) | group 1 ...
        in_proj_ba rows:    | group 0: b (n) a (n) | group 1 ...          (n = num_v_heads / num_k_heads)

    so a plain split of the rows over the ranks hands each rank whole groups: its key heads' own."""

    def make_projections(self, shape: DeltaNetShape) -> None:
        self.in_proj_qkvz = ColumnParallelLinear(shape.hidden_size, 2 * shape.key_dim + 2 * shape.value_dim, bias=False)
        self.in_proj_ba = ColumnParallelLinear(shape.hidden_size, 2 * shape.num_v_heads, bias=False)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shape = self.shape
        group = shape.num_v_heads // shape.num_k_heads
        groups = self.in_proj_qkvz(hidden).unflatten(-1, (shape.num_k_heads_local, -1))
        q, k, v, z = groups.split([shape.head_k_dim, shape.head_k_dim, group * shape.head_v_dim,
                                   group * shape.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).unflatten(-1, (shape.num_k_heads_local, -1)).split([group, group], dim=-1)
        qkv = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=-1)
        return qkv, z.reshape(z.shape[0], -1, shape.head_v_dim), b.flatten(1), a.flatten(1)
