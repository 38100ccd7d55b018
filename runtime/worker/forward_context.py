"""The per-forward state every attention layer reads, entered once per step with a context manager."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol

import torch

if TYPE_CHECKING:
    from shardserve.runtime.layers.lora_batch import LoRABatch


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in the batch and in the KV block pool.

        tokens:        | r0: q0 q1 q2 | r1: q0 | r2: q0 q1 |      (flattened, num_tokens = 6)
        query_start:   0              3        4           6
        seq_lens:      r0 = cached prefix + 3, r1 = cached + 1, ...
        slot of token: block_table[r][pos // block_size] * block_size + pos % block_size

    Query token j of request r sits at position seq_lens[r] - query_len[r] + j and attends to
    positions [0, that position] (causal over cached prefix + new tokens)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V is written
    query_start_loc: torch.Tensor  # [num_requests + 1] int32
    seq_lens: torch.Tensor  # [num_requests] int32, cached + new tokens per request
    block_tables: torch.Tensor  # [num_requests, max_blocks_per_request] int32, padded with 0
    max_query_len: int
    max_seq_len: int  # an upper bound inside a CUDA graph (max_model_len)
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int] | None  # None inside a CUDA graph, where only the device tensor is current
    # [num_requests] int64, each request's row of the recurrent layers' states (layers/recurrent_state.py);
    # None for a model without recurrent layers
    state_slots: torch.Tensor | None = None
    # the other KV groups' metadata (planner/kv_groups.py): this step with their slot_mapping and block_tables;
    # an attention layer of group g > 0 reads groups[g - 1]
    groups: tuple[AttentionMetadata, ...] = ()
    # per request: its step verifies drafts (recurrent layers keep the state after each of its tokens); () none
    verifying: tuple[bool, ...] = ()
    verifying_flags: torch.Tensor | None = None  # the same as int32 on the device (the kernels'); None: none verifies

    def for_group(self, group: int) -> AttentionMetadata:
        return self if group == 0 else self.groups[group - 1]

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    """attention/torch_backend.py's or attention/triton_backend.py's."""

    name: str
    fuses_rotary: bool  # forward also takes positions and rotary_emb, and rotates q and k itself

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, *args: Any, **kwargs: Any) -> torch.Tensor: ...


@dataclass(slots=True)
class HiddenCapture:
    """The hidden states entering these decoder layers (index L: the last one's output), appended in layer order
    by a forward (models/llama.run_stage) for whoever reads them after it (an EAGLE-3 head, worker/eagle.py)."""

    layers: tuple[int, ...]
    captured: list[torch.Tensor] = field(default_factory=list)


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata | None  # None during weight-free dry runs
    backend: AttentionBackend
    lora: LoRABatch | None = None  # each token's adapter slot (enable_lora); None: no adapter this step
    capture: HiddenCapture | None = None  # the model's hidden states some layers take; None: none kept


# NOTE: per thread, so engines stepping in different threads of one process (data-parallel
# replicas behind one server) each see their own forward pass.
_LOCAL = threading.local()


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    if getattr(_LOCAL, "current", None) is not None:
        raise RuntimeError("forward_context is already active; forward passes do not nest")
    _LOCAL.current = context
    try:
        yield context
    finally:
        _LOCAL.current = None


def get_forward_context() -> ForwardContext:
    current = getattr(_LOCAL, "current", None)
    if current is None:
        raise RuntimeError("attention ran outside forward_context(...)")
    return current
