"""The CPU tier of the prefix cache: which host slot keeps which evicted block, and the copies that move them.

The block manager decides and the ranks copy. A full, hashed block the GPU pool evicts is copied to a
host slot first (unless the tier already holds that hash); a prompt whose prefix continues past the
GPU pool's hits into the tier gets new GPU blocks, loaded from their slots before its first step:

    GPU pool:  [h0 h1]            tier: {h2: slot 5, h3: slot 1}      prompt: h0 h1 h2 h3 h4 ...
    admitted:  blocks h0 h1 (hits) + b7 <- slot 5, b3 <- slot 1 (loads) + new blocks for the rest

Every copy rides on the next SchedulerOutput, and every rank runs a step's copies in the order they
were issued, before its forward: an eviction's copy out of a block always precedes a load into it,
and a slot a load reads is pinned until that load is issued, so no later copy overwrites it first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class KVTransfer(NamedTuple):
    """One block's copy between the GPU pool and the CPU tier, on every rank (its layers and heads)."""

    to_host: bool  # True: GPU block -> host slot (an eviction); False: host slot -> GPU block (a load)
    block_id: int
    slot: int


class OffloadTier:
    """The tier's bookkeeping (the ranks hold the bytes): block hash -> host slot, least recently used
    first. A slot pinned by a load issued this call is never chosen to take a new block."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the CPU tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.pinned: set[int] = set()

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding this content, now the most recently used; None when the tier lacks it."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
        return slot

    def store(self, block_hash: bytes) -> int | None:
        """A slot to copy this content into: a free one, else the least recently used unpinned one
        (its content dropped). None when the tier holds it already (now the most recent) or every
        slot is pinned."""
        if self.lookup(block_hash) is not None:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slots.items() if s not in self.pinned), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
        self._slots[block_hash] = slot
        return slot

    def check_integrity(self) -> None:
        slots = list(self._slots.values())
        assert len(set(slots)) == len(slots), "two hashes share a host slot"
        assert not set(slots) & set(self._free), "a slot is both free and holding a block"
        assert len(slots) + len(self._free) == self.num_slots, "a host slot is lost"


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
