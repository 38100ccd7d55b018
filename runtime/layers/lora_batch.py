"""Which LoRA slot each token of a step uses, sorted on the host once so that the gathered matmul
(lora_ops.py) reads each slot's tokens as one contiguous run:

    token_slots:   t0:1  t1:-1  t2:0  t3:1  t4:0          (-1: no adapter)
    sorted_tokens: | t2 t4 | t0 t3 | t1 |
    slot_starts:   0       2       4              [L + 1] (L = 2; tokens past slot_starts[L] have no slot)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class LoRABatch:
    """Which LoRA slot each token of a step uses, sorted for the kernel."""

    token_slots: torch.Tensor  # [T] int32, -1 for tokens without an adapter
    sorted_tokens: torch.Tensor  # [T] int32: token indices ordered by slot, tokens with slot -1 last
    slot_starts: torch.Tensor  # [L + 1] int32: sorted_tokens[slot_starts[l]:slot_starts[l + 1]] are slot l's
    active_slots: tuple[int, ...]  # the slots that have tokens this step (host side, for the torch path)
    max_tokens_per_slot: int  # host side, bounds the kernel grid (may be an upper bound such as T)

    @property
    def num_slots(self) -> int:
        return self.slot_starts.numel() - 1


def lora_batch(token_slots: np.ndarray, num_slots: int, device: torch.device | str) -> LoRABatch:
    """token_slots [T] (slot ids in [0, num_slots), -1 for no adapter) -> the sorted metadata, built with
    numpy on the host and copied to `device` in one transfer."""
    slots = np.asarray(token_slots, dtype=np.int64)
    if slots.ndim != 1:
        raise ValueError(f"token_slots must be one-dimensional, got shape {slots.shape}")
    if slots.size and (slots.min() < -1 or slots.max() >= num_slots):
        raise ValueError(f"token slots must lie in [-1, {num_slots}), got {slots.min()}..{slots.max()}")
    keys = np.where(slots < 0, num_slots, slots)  # tokens without an adapter sort after every slot
    order = np.argsort(keys, kind="stable")  # stable: a slot's tokens keep their batch order
    counts = np.bincount(keys, minlength=num_slots + 1)[:num_slots]
    starts = np.concatenate(([0], np.cumsum(counts)))
    # one int32 host buffer, one copy: [token_slots (T) | sorted_tokens (T) | slot_starts (L + 1)]
    packed = torch.from_numpy(np.concatenate((slots, order, starts)).astype(np.int32)).to(device)
    num_tokens = slots.size
    return LoRABatch(token_slots=packed[:num_tokens], sorted_tokens=packed[num_tokens:2 * num_tokens],
                     slot_starts=packed[2 * num_tokens:],
                     active_slots=tuple(int(s) for s in np.flatnonzero(counts)),
                     max_tokens_per_slot=int(counts.max()) if num_slots else 0)


def check_gathered_shapes(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
    """Raise ValueError unless x [T, K], w [L, N, K], out [T, N] and the batch (L slots) agree. The batch may
    cover fewer than T tokens: rows past its tokens (a graph's padding) are treated as having no adapter."""
    num_tokens, num_inputs = x.shape
    num_slots, num_outputs, w_inputs = w.shape
    if w_inputs != num_inputs or out.shape != (num_tokens, num_outputs):
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    if batch.num_slots != num_slots or batch.token_slots.numel() > num_tokens:
        raise ValueError(f"batch has {batch.token_slots.numel()} tokens and {batch.num_slots} slots; "
                         f"x has {num_tokens} tokens, w {num_slots} slots")
