"""The engine's view of the adapter slots every rank keeps: which adapter each holds, and how many
running requests use it. A request with an adapter is admitted only when its adapter holds a slot or a
slot is free of running requests; the slot's new adapter is then loaded on every rank before the step
(SchedulerOutput.lora_loads).

NOTE: a slot's adapter is replaced only when no running request uses it. A batch in flight may still
read the old adapter for a request finished meanwhile (whose token is dropped): ranks run batches in
order and load a slot at the start of the step that first needs it, so the old weights are read first."""

from __future__ import annotations

import itertools

from shardserve.runtime.lora_request import LoRARequest


class LoRASlots:
    def __init__(self, num_slots: int):
        self.adapters: list[LoRARequest | None] = [None] * num_slots
        self.users = [0] * num_slots  # running requests per slot
        self._released = [0] * num_slots  # when each slot was last left unused (least recent goes first)
        self._clock = itertools.count(1)
        self.loads: list[tuple[int, LoRARequest]] = []  # drained into the next SchedulerOutput

    def slot_of(self, lora: LoRARequest) -> int | None:
        return next((slot for slot, held in enumerate(self.adapters) if held == lora), None)

    def can_take(self, lora: LoRARequest) -> bool:
        return self.slot_of(lora) is not None or 0 in self.users

    def take(self, lora: LoRARequest) -> int:
        """The slot a newly admitted request of `lora` runs with (can_take said there is one)."""
        slot = self.slot_of(lora)
        if slot is None:  # an empty slot first, then the one unused longest
            slot = min((s for s, users in enumerate(self.users) if users == 0),
                       key=lambda s: (self.adapters[s] is not None, self._released[s]))
            self.adapters[slot] = lora
            self.loads.append((slot, lora))
        self.users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1
        if not self.users[slot]:
            self._released[slot] = next(self._clock)

    def empty(self, lora: LoRARequest) -> None:
        """Its ranks could not load `lora` (its requests are finished): its slot holds nothing now, so its
        next request loads it again."""
        slot = self.slot_of(lora)
        if slot is not None:
            assert not self.users[slot], "an adapter emptied while requests still use its slot"
            self.adapters[slot] = None

    def check_integrity(self, running_slots: list[int]) -> None:
        assert [running_slots.count(s) for s in range(len(self.users))] == self.users, "slot users disagree"
