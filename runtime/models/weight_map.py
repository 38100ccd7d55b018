"""How a checkpoint tensor name lands on a model parameter (possibly one shard of a fused one)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WeightTarget:
    param_name: str
    shard_id: object = None  # passed to the parameter's weight_loader when not None
    transpose: bool = False  # checkpoint stores [in, out] (GPT-2 Conv1D)
    skip: bool = False  # a tensor this model (or stage) does not use


def fold_packed(name: str, packed: Mapping[str, tuple[str, object]]) -> WeightTarget:
    """Rename `...q_proj.weight` to `...qkv_proj.weight` with shard "q", etc.; an fp8 KV cache scale
    `...self_attn.k_scale` goes to the attention layer's buffer `...self_attn.attn.k_scale`, gpt-oss's
    `...self_attn.sinks` to its parameter `...self_attn.attn.sinks`."""
    if name.endswith((".self_attn.k_scale", ".self_attn.v_scale", ".self_attn.sinks")):
        return WeightTarget(name.replace(".self_attn.", ".self_attn.attn."))
    for checkpoint_part, (fused_part, shard_id) in packed.items():
        token = f".{checkpoint_part}."
        if token in name:
            return WeightTarget(name.replace(token, f".{fused_part}."), shard_id)
    return WeightTarget(name)



def tied_head_target(name: str, embedding_name: str, has_embedding: bool) -> WeightTarget | None:
    """Tied embeddings: the LM head shares the embedding on a single stage; a last stage without the
    embedding loads its own copy from the embedding tensor. A separate lm_head tensor is ignored.
    Returns None when `name` is not one of the two tied tensors (the caller maps it as usual)."""
    if name == "lm_head.weight":
        return WeightTarget("", skip=True)
    if name == embedding_name and not has_embedding:
        return WeightTarget("lm_head.weight")
    return None
