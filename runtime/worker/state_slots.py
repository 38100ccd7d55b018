"""Which row of the recurrent layers' state tensors each request holds (layers/recurrent_state.py).

A rank gives a request a slot when it first sees it and takes it back when the request finishes or is
preempted (a preempted request comes back as new, computing from token 0, so from a zero state). The
scheduler runs at most max_num_seqs requests, so max_num_seqs slots always suffice; one more, the last,
is scratch for a CUDA graph's padding rows. Slots are local to a rank: ranks need not agree on them."""

from __future__ import annotations

from shardserve.planner.linear_attention import recurrent_state_slots


class StateSlots:
    def __init__(self, max_num_seqs: int) -> None:
        self.num_slots = recurrent_state_slots(max_num_seqs)  # the planner counts the same rows
        self.scratch = self.num_slots - 1
        self._free = list(range(self.scratch - 1, -1, -1))  # popped from the end: lowest first
        self._held: dict[str, int] = {}

    def take(self, request_id: str) -> int:
        if request_id in self._held:
            raise RuntimeError(f"request {request_id!r} already holds state slot {self._held[request_id]}")
        if not self._free:
            raise RuntimeError(f"all {self.scratch} state slots are held: the scheduler ran more than "
                               "max_num_seqs requests at once")
        slot = self._free.pop()
        self._held[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        slot = self._held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_held(self) -> int:
        return len(self._held)
