"""Speculative decoding with recurrent layers (Qwen3.5, Qwen3-Next): a verify step runs a request's last token and
its k drafts through each layer's state, and only the state after the kept ones may stand. A layer keeps the
state after each of the step's tokens beside its slot (layers/gated_delta_net.py, `verify_states`); next step,
once the scheduler has said how many were kept, the slot takes the one they reach.

    verify step of request r (slot s, from position e):  verify_states[s, j] = state after tokens e .. e + j
    next step (r has computed n tokens by then):         states[s] = verify_states[s, n - e - 1]

vLLM keeps the same per-token states for its hybrid models' drafts. The copies are counted by the plan too
(planner/linear_attention.state_copies)."""

from __future__ import annotations

import torch

from shardserve.runtime.layers.recurrent_state import RecurrentLayer
from shardserve.runtime.worker.inputs import RequestState


class StateRollback:
    def __init__(self, layers: list[RecurrentLayer], num_speculative_tokens: int):
        self.layers, self.num_rows = layers, num_speculative_tokens + 1
        # request id -> (its state, the position its verify step started at)
        self.pending: dict[str, tuple[RequestState, int]] = {}

    def bind(self, num_slots: int, device: torch.device) -> None:
        """Each layer's per-token states, beside its `states`: [num_slots, k + 1, *spec.shape] per spec."""
        for layer in self.layers:
            layer.verify_states = tuple(torch.zeros((num_slots, self.num_rows, *spec.shape), dtype=spec.dtype,
                                                    device=device) for spec in layer.state_specs())

    def release(self) -> None:
        for layer in self.layers:
            layer.verify_states = None
        self.pending.clear()

    def record(self, batch: list[RequestState], verifying: list[bool]) -> None:
        """Before a step: the requests whose drafts it verifies, and where each starts."""
        for state, verifies in zip(batch, verifying):
            if verifies:
                self.pending[state.request_id] = (state, state.num_computed_tokens)

    def restore(self, batch: list[RequestState], states: dict[str, RequestState]) -> None:
        """Before a step's forward: each request of the batch verified by an earlier step takes the state its kept
        tokens reach; a finished or preempted request's record is dropped."""
        picks = []
        for state in batch:
            entry = self.pending.pop(state.request_id, None)
            if entry is not None and entry[0] is state:
                picks.append((state.state_slot, state.num_computed_tokens - entry[1] - 1))
        for request_id in [r for r, (s, _) in self.pending.items() if states.get(r) is not s]:
            del self.pending[request_id]
        if not picks:
            return
        for layer in self.layers:
            assert layer.states is not None and layer.verify_states is not None  # bound with the KV cache
            slots = torch.tensor([slot for slot, _ in picks], device=layer.states[0].device)
            rows = torch.tensor([row for _, row in picks], device=layer.states[0].device)
            for kept, per_token in zip(layer.states, layer.verify_states):
                kept.index_copy_(0, slots, per_token[slots, rows])
