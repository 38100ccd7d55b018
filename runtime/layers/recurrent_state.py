"""Layers whose memory of the past is a fixed-size state per request (linear attention: Gated DeltaNet's
short-convolution window and its delta-rule matrix), kept in slots beside the paged KV cache.

    state tensor (one per StateSpec):  [num_slots, *spec.shape]     (bound by the worker)
    a request's row:                    meta.state_slots[r]          (the worker's StateSlots give it)
    what the row holds:                 the state after the request's first seq_len - query_len tokens

A request whose step starts at token 0 (seq_len == query_len) starts from a zero state: its row may hold
an earlier request's state and is never read. Slot num_slots - 1 is scratch (a CUDA graph's padding rows
write it); no request is given it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StateSpec:
    shape: tuple[int, ...]  # one request's state on this rank
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class RecurrentLayer(nn.Module):
    """A layer with per-request state: state_specs() says its shapes, and the worker binds `states`
    (one tensor [num_slots, *spec.shape] per spec, zeroed) before any step with metadata."""

    states: tuple[torch.Tensor, ...] | None = None
    # with speculative decoding, the states after each token of a verify step: [num_slots, k + 1, *spec.shape]
    # per spec (worker/state_rollback.py)
    verify_states: tuple[torch.Tensor, ...] | None = None

    def state_specs(self) -> tuple[StateSpec, ...]:
        raise NotImplementedError


def state_bytes_per_slot(layers: list[RecurrentLayer]) -> int:
    """One request's state across these layers."""
    return sum(spec.nbytes for layer in layers for spec in layer.state_specs())


def context_lens(seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """[num_requests] tokens before each request's step: 0 means it starts from a zero state."""
    return seq_lens - (query_start_loc[1:] - query_start_loc[:-1])
