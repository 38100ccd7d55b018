"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5/3.6): its widths and the state each request keeps.

A linear-attention layer keeps no KV per token: each request has one fixed-size state per layer, held in
`num_slots` rows beside the paged KV cache (runtime/layers/recurrent_state.py):

    conv state       [conv_dim / tp, kernel - 1]          model dtype   (the short convolution's window)
    recurrent state  [num_value_heads / tp, dk, dv]       float32       (the delta rule's matrix)

    conv_dim = 2 * key_dim + value_dim    key_dim = num_key_heads * dk    value_dim = num_value_heads * dv

The planner sizes them with `recurrent_state_bytes`; the runtime allocates each layer's StateSpecs
(runtime/layers/gated_delta_net.py), of these shapes, in `recurrent_state_slots` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardserve.planner.hf_config import ConfigReader
from shardserve.planner.served import LINEAR_ATTENTION_FAMILIES

if TYPE_CHECKING:
    from shardserve.planner.model_spec import ModelSpec

RECURRENT_STATE_BYTES = 4  # the delta rule's state is float32 whatever the model dtype
# NOTE: the runtime keeps one row per running request and one scratch row (a CUDA graph's padding rows
# write it): the planner counts the scratch row too, so plan and launch take the same memory.
SCRATCH_SLOTS = 1


@dataclass(frozen=True)
class LinearAttentionSpec:
    """config.json's linear_* widths of the Gated DeltaNet layers."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    def conv_dim(self, tp: int = 1) -> int:
        """Channels of the short convolution (q, k and v) on one of tp ranks."""
        return 2 * self.key_dim // tp + self.value_dim // tp

    def projection_width(self, tp: int = 1) -> int:
        """Output features of the input projections on a rank: q, k, v, the gate z, and b and a per value head."""
        return self.conv_dim(tp) + self.value_dim // tp + 2 * self.num_value_heads // tp

    def conv_state_bytes(self, tp: int, dtype_bytes: int) -> int:
        return self.conv_dim(tp) * (self.conv_kernel_dim - 1) * dtype_bytes

    def recurrent_state_values(self, tp: int) -> int:
        return self.num_value_heads // tp * self.key_head_dim * self.value_head_dim

    def state_bytes_per_layer(self, tp: int, dtype_bytes: int) -> int:
        """One request's state in one layer on one of tp ranks (conv state in `dtype_bytes`)."""
        return self.conv_state_bytes(tp, dtype_bytes) + self.recurrent_state_values(tp) * RECURRENT_STATE_BYTES

    @staticmethod
    def from_config(read: ConfigReader) -> "LinearAttentionSpec":
        return LinearAttentionSpec(read.count("linear_num_key_heads"), read.count("linear_num_value_heads"),
                                   read.count("linear_key_head_dim"), read.count("linear_value_head_dim"),
                                   read.count("linear_conv_kernel_dim"))


def hybrid_fields(family: str, read: ConfigReader, rope: dict | None) -> dict:
    """The ModelSpec fields of a linear-attention hybrid: the linear layers' widths, the gated full
    attention and its partial rotary; {} for any other family."""
    if family not in LINEAR_ATTENTION_FAMILIES:
        return {}
    # NOTE: transformers' Qwen3-Next and Qwen3.5 attention always gates its output (q_proj twice as wide)
    return {"linear_attention": LinearAttentionSpec.from_config(read),
            "has_attention_output_gate": read.bool("attn_output_gate", True),
            "partial_rotary_factor": float((rope or {}).get("partial_rotary_factor", 1.0))}


def recurrent_state_slots(max_num_seqs: int) -> int:
    """Rows of every recurrent state tensor: one per running request, and the scratch row."""
    return max_num_seqs + SCRATCH_SLOTS


def state_copies(num_speculative_tokens: int) -> int:
    """The states a slot keeps: its own and, with speculative decoding, the one after each of a verify step's
    k + 1 tokens (the next step keeps the one its kept drafts reach: runtime/worker/state_rollback.py)."""
    return 1 + (num_speculative_tokens + 1 if num_speculative_tokens else 0)


def recurrent_state_bytes(spec: ModelSpec, tp: int, layers: range, num_slots: int, dtype_bytes: int) -> int:
    """Bytes of recurrent state on one rank of the stage that owns `layers` (tensor parallel `tp`):
    each linear-attention layer's conv and delta-rule state, times `num_slots` rows
    (recurrent_state_slots(max_num_seqs)); the conv state in the model dtype's `dtype_bytes`.
    0 for a model without linear-attention layers."""
    la = spec.linear_attention
    if la is None:
        return 0
    return spec.num_linear_layers(layers) * la.state_bytes_per_layer(tp, dtype_bytes) * num_slots


def linear_attention_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why tp ranks cannot split the linear-attention heads evenly, or None."""
    la = spec.linear_attention
    if la is None or tp == 1:
        return None
    for name, heads in (("linear_num_key_heads", la.num_key_heads), ("linear_num_value_heads", la.num_value_heads)):
        if heads % tp:
            return (f"{name} {heads} is not divisible by tensor_parallel_size {tp} (each rank holds whole "
                    "linear-attention heads and their state)")
    return None
