"""Megatron sharding of a checkpoint's tensors: bytes on each rank of each pipeline stage."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from shardserve.planner.layer_split import split_layers
from shardserve.planner.model_spec import DTYPE_BYTES, ModelSpec, TensorInfo, stacked_expert_part


class Shard(Enum):
    COLUMN = "column"          # output features split across tp ranks (q, gate/up, fc1, c_attn)
    ROW = "row"                # input features split; the bias stays whole (o, down, fc2)
    KV = "kv"                  # k/v: split by KV heads, one head per rank once tp > KV heads
    VOCAB = "vocab"            # rows split, vocab padded to a multiple of tp
    REPLICATED = "replicated"  # norms, routers, positions


_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
_COLUMN = {"q_proj", "gate_proj", "up_proj", "w1", "w3", "c_fc", "fc1", "c_attn", "qkv_proj",
           "gate_up_proj", "query_key_value", "q_b_proj", "kv_b_proj",  # MLA's down-projections: replicated
           # Gated DeltaNet: input projections and the depthwise conv split by heads (A_log, dt_bias: tiny, counted whole)
           "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d"}
_ROW = {"o_proj", "down_proj", "w2", "fc2", "c_proj", "out_proj", "dense"}
_EMBED = {"embed_tokens", "wte"}
_POSITIONS = {"wpe", "embed_positions"}


@dataclass(frozen=True)
class PlacedTensor:
    tensor: TensorInfo
    layer: int | None  # None: outside the decoder layers
    site: str          # "layer" | "first" (embeddings) | "last" (final norm, LM head)
    shard: Shard


def place(tensor: TensorInfo) -> PlacedTensor:
    module, _, leaf_param = tensor.name.rpartition(".")
    leaf = module.rpartition(".")[2]
    stacked = stacked_expert_part(tensor.name)
    if stacked:  # gpt-oss: `experts.gate_up_proj_blocks`, one tensor of every expert, placed as its projection
        leaf, leaf_param = stacked[0], "bias" if stacked[1] == "bias" else "weight"
    match = _LAYER.search(tensor.name)
    if match:
        if leaf in _COLUMN:
            shard = Shard.COLUMN
        elif leaf in ("k_proj", "v_proj"):
            shard = Shard.KV
        elif leaf in _ROW and leaf_param != "bias":
            shard = Shard.ROW
        else:
            shard = Shard.REPLICATED
        return PlacedTensor(tensor, int(match.group(1)), "layer", shard)
    if leaf in _EMBED:
        return PlacedTensor(tensor, None, "first", Shard.VOCAB)
    if leaf in _POSITIONS:
        return PlacedTensor(tensor, None, "first", Shard.REPLICATED)
    if leaf == "lm_head":
        return PlacedTensor(tensor, None, "last", Shard.VOCAB)
    return PlacedTensor(tensor, None, "last", Shard.REPLICATED)


@dataclass(frozen=True)
class ShardedModel:
    """Per-rank weight bytes of a model at one tensor-parallel size and dtype."""

    layer_bytes: tuple[float, ...]  # one rank's share of each decoder layer
    first_bytes: float              # embeddings, on the first stage
    last_bytes: float               # final norm and LM head, on the last stage
    embedding_bytes: float          # one rank's share of the token embedding (not read per step)
    expert_bytes: float             # one rank's share of the routed experts, all layers

    def split(self, num_stages: int) -> list[int]:
        """Layers per stage with weight bytes balanced: the split planner and runtime share."""
        return split_layers(self.layer_bytes, num_stages, self.first_bytes, self.last_bytes)

    def stage_bytes(self, split: list[int]) -> list[float]:
        out, start = [], 0
        for stage, count in enumerate(split):
            total = sum(self.layer_bytes[start:start + count])
            total += self.first_bytes if stage == 0 else 0.0
            total += self.last_bytes if stage == len(split) - 1 else 0.0
            out.append(total)
            start += count
        return out


TensorGroups = dict  # (site, layer, shard, is_expert, is_float) -> (elements, stored bytes)


def summarize(tensors: Iterable[TensorInfo]) -> TensorGroups:
    """Tensors grouped by (site, layer, shard, is_expert, is_float): (elements, stored bytes).

    Grouping a big checkpoint's thousands of tensors once keeps every layout cheap.
    """
    groups: dict[tuple, tuple[int, int]] = {}
    for t in tensors:
        match = _LAYER.search(t.name)
        site, shard = _site_and_shard(_DIGITS.sub(".#.", t.name))
        key = (site, int(match.group(1)) if match else None, shard, ".experts." in t.name,
               t.is_float)
        numel, stored = groups.get(key, (0, 0))
        groups[key] = (numel + t.numel, stored + t.stored_bytes)
    return groups


_DIGITS = re.compile(r"\.\d+\.")


@functools.lru_cache(maxsize=4096)
def _site_and_shard(pattern: str) -> tuple[str, Shard]:
    # one placement per name pattern (layer and expert numbers masked): experts share it
    placed = place(TensorInfo(pattern.replace(".#.", ".0."), 0, "F32"))
    return placed.site, placed.shard


def shard_model(spec: ModelSpec, groups: TensorGroups, tp: int, dtype: str,
                num_stages: int = 1, expert_parallel: bool = False) -> ShardedModel:
    """Bytes per rank, float tensors converted to `dtype`, quantized ones kept as stored. With fp8
    quantization, float linear weights of the decoder layers count one byte (a float checkpoint
    quantized while loading). With expert_parallel a rank holds num_experts / tp whole experts (the
    runtime refuses uneven counts), so expert bytes scale by its share of experts, not of features."""
    is_fp8 = spec.quantization is not None and spec.quantization.method == "fp8"
    kv_per_rank = max(1, spec.num_kv_heads // tp)  # replicated once tp > KV heads
    factors = {Shard.COLUMN: 1 / tp, Shard.ROW: 1 / tp,
               Shard.KV: kv_per_rank / spec.num_kv_heads,
               Shard.VOCAB: math.ceil(spec.vocab_size / tp) / spec.vocab_size,
               Shard.REPLICATED: 1.0}
    expert_share = None
    if expert_parallel:
        assert spec.num_experts  # only a mixture of experts runs expert parallel
        expert_share = -(-spec.num_experts // tp) / spec.num_experts
    layers = [0.0] * spec.num_layers
    first = last = embedding = experts = 0.0
    has_lm_head = False
    for (site, layer, shard, is_expert, is_float), (numel, stored) in \
            groups.items():
        quantized_here = is_fp8 and site == "layer" and shard is not Shard.REPLICATED
        factor = expert_share if is_expert and expert_share is not None else factors[shard]
        size = (numel * (1 if quantized_here else DTYPE_BYTES[dtype]) if is_float else stored) * factor
        if site == "layer":
            if layer < spec.num_layers:
                layers[layer] += size
                experts += size if is_expert else 0.0
        elif site == "first":
            first += size
            embedding += size if shard is Shard.VOCAB else 0.0
        else:
            last += size
            has_lm_head |= shard is Shard.VOCAB
    if not has_lm_head and num_stages > 1:
        last += embedding  # tied head: the last stage keeps its own copy of the embedding
    return ShardedModel(tuple(layers), first, last, embedding, experts)


def layer_split(spec: ModelSpec, groups: TensorGroups, tp: int, pp: int,
                dtype: str) -> list[int]:
    """The split both the planner and the runtime use: balance weight bytes per stage."""
    return shard_model(spec, groups, tp, dtype, pp).split(pp)


def total_weight_bytes(spec: ModelSpec, groups: TensorGroups, dtype: str) -> int:
    """The whole model's weights in `dtype` (quantized tensors as stored)."""
    return int(shard_model(spec, groups, 1, dtype).stage_bytes([spec.num_layers])[0])
