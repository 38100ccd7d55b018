"""Host<->device transfers of a step: its inputs in one copy through a persistent staging buffer, its
sampled token ids back without blocking the host."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shardserve.runtime.core.messages import ModelRunnerOutput, TokenLogprobs
from shardserve.runtime.core.spec_decode import verify

_ALIGN = 16  # bytes: every array starts where an int64 may, and kernels load vectors
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32}


def _event(device: torch.device):
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class StagingBuffer:
    """Packs a step's numpy arrays into one host buffer and copies the bytes used to one device
    buffer in a single copy; returns device views in the arrays' dtypes and shapes.

        host slot s (pinned):  | input_ids | positions | slot_mapping | ... | block_tables |
        device buffer:         | the same bytes; the views handed back point here        |
                               ^ each array at a multiple of 16 bytes

    NOTE: two host slots, used in turn, each refilled only after the copy that last read it is
    done: with async scheduling the host packs step N+1 while step N's copy may still be queued.
    One device buffer is enough: the next step's copy is queued behind this step's kernels on the
    same stream. A CPU worker runs the same packing (its copy is a memcpy), so the tests cover it."""

    def __init__(self, device: torch.device, num_bytes: int = 1 << 16):
        self.device = device
        self._slot = 0
        self._allocate(num_bytes)

    def _allocate(self, num_bytes: int) -> None:
        pinned = self.device.type == "cuda"
        self._host = [torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
        self._host_views = [buffer.numpy() for buffer in self._host]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # the event after each slot's last copy (CUDA only)
        self._device = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)

    @property
    def num_bytes(self) -> int:
        return len(self._device)

    def to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        offsets, end = [], 0
        for array in arrays:
            offsets.append(end)
            end += -(-array.nbytes // _ALIGN) * _ALIGN
        if end > self.num_bytes:
            self._wait_all()
            self._allocate(max(end, 2 * self.num_bytes))  # (views handed out before keep the old buffer)
        slot, self._slot = self._slot, 1 - self._slot
        copied = self._copied[slot]
        if copied is not None and not copied.query():
            copied.synchronize()  # (two steps back: done already but on a busy queue)
        host = self._host_views[slot]
        for array, offset in zip(arrays, offsets):
            host[offset: offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self._device[:end].copy_(self._host[slot][:end], non_blocking=True)
        self._copied[slot] = _event(self.device)
        return [self._device[offset: offset + array.nbytes].view(_TORCH_DTYPES[array.dtype]).view(array.shape)
                for array, offset in zip(arrays, offsets)]

    def _wait_all(self) -> None:
        for event in self._copied:
            if event is not None:
                event.synchronize()


class SampledTokens:
    """A step's sampled ids on their way to the host: the copy is queued behind the step, and
    tolist() waits for it alone (never for a step queued after it)."""

    def __init__(self, tokens: torch.Tensor, host_buffer: torch.Tensor):
        self.device_tokens = tokens  # [num_sampled] int64, read on the device by the next step's inputs
        if tokens.device.type == "cpu":
            self._host, self._event = tokens, None
            return
        self._host = host_buffer[: len(tokens)]
        self._host.copy_(tokens, non_blocking=True)
        self._event = _event(tokens.device)

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host.tolist()


class SampledTokenBuffers:
    """Pinned host buffers for the sampled ids, two used in turn.
    NOTE: two suffice because the engine collects step N before it submits step N+2, so a buffer
    is refilled only after its last step's ids were read."""

    def __init__(self, max_num_sampled: int, device: torch.device):
        pinned = device.type == "cuda"
        self._buffers = [torch.empty(max_num_sampled, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._next = 0

    def start_copy(self, tokens: torch.Tensor) -> SampledTokens:
        buffer, self._next = self._buffers[self._next], 1 - self._next
        return SampledTokens(tokens, buffer)


@dataclass(slots=True)
class StepOutput:
    """The output rank's result of a step submitted to the device, read on the host when collected."""

    request_ids: list[str] = field(default_factory=list)  # the rows of `tokens`
    tokens: SampledTokens | None = None
    row_logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # the rows that ask for them
    prompt_logprobs: dict = field(default_factory=dict)  # as ModelRunnerOutput.prompt_logprobs
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> [hidden_size], on the device
    failed_loras: tuple[int, ...] = ()  # as ModelRunnerOutput.failed_loras
    drafts: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)  # speculative: (first row, drafts)

    def to_runner_output(self) -> ModelRunnerOutput:
        pooled = {request_id: vector.cpu().numpy() for request_id, vector in self.pooled.items()}
        tokens = self.tokens.tolist() if self.tokens is not None else []
        sampled, accepted, logprobs, draft_logprobs = verify(self.request_ids, tokens, self.drafts, self.row_logprobs)
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
                                 pooled=pooled, failed_loras=self.failed_loras, accepted_drafts=accepted,
                                 draft_logprobs=draft_logprobs)
