"""Refusing impossible tensor/pipeline layouts before any worker starts, naming the rule that broke."""

from __future__ import annotations

from shardserve.planner.settings import BY_NAME
from shardserve.runtime.config import ModelConfig, ParallelConfig
from shardserve.runtime.layers.quantization.config import check_quantized_layout


def _ffn_size(hf_config) -> int | None:
    for name in ("intermediate_size", "ffn_dim", "n_inner"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    hidden = getattr(hf_config, "n_embd", None)
    return 4 * hidden if hidden else None


def num_routed_experts(hf_config) -> int | None:
    """Routed experts per MoE layer (Mixtral's num_local_experts, Qwen-MoE's num_experts); None: dense."""
    for name in ("num_local_experts", "num_experts"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return None


def check_expert_parallel(model: ModelConfig, tp: int) -> None:
    """enable_expert_parallel needs routed experts, and as many on every rank (NOTE: uneven expert counts
    are refused rather than padded, so every rank holds and computes the same share)."""
    experts = num_routed_experts(model.hf_config)
    if experts is None:
        raise ValueError(f"enable_expert_parallel: {model.architecture} has no routed experts (not a "
                         "mixture-of-experts model); leave enable_expert_parallel off")
    if experts % tp:
        raise ValueError(f"enable_expert_parallel: the model's {experts} experts do not divide evenly over "
                         f"tensor_parallel_size={tp} ranks; choose a tensor_parallel_size dividing {experts} "
                         "or leave enable_expert_parallel off")


def _check_mlp(hf_config, tp: int, expert_parallel: bool) -> None:
    """The MLP features tensor parallel splits: a dense MLP's, and the experts' unless they are whole
    per rank (Mixtral's experts are its intermediate_size; Qwen-MoE's have moe_intermediate_size)."""
    ffn, experts = _ffn_size(hf_config), num_routed_experts(hf_config)
    expert_width = (getattr(hf_config, "moe_intermediate_size", None) or ffn) if experts else None
    if expert_width and not expert_parallel and expert_width % tp:
        hint = "; enable_expert_parallel keeps experts whole" if experts % tp == 0 else ""
        raise ValueError(f"tensor_parallel_size={tp} does not divide the experts' {expert_width} intermediate "
                         f"features{hint}")
    has_dense_mlp = not experts or getattr(hf_config, "moe_intermediate_size", None)
    if has_dense_mlp and ffn is not None and ffn % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the MLP's {ffn} intermediate features")


def check_parallel_layout(model: ModelConfig, parallel: ParallelConfig, num_devices: int | None) -> None:
    """Raise ValueError for a layout no worker could run. `num_devices`: GPUs this executor can place
    ranks on (None: no limit, as for CPU ranks)."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    c = model.hf_config
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    kv_heads = model.num_kv_heads
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_parallel_size={tp} and pipeline_parallel_size={pp} must be at least 1")
    BY_NAME["distributed_executor_backend"].check(parallel.distributed_executor_backend)
    if heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {heads} attention heads")
    if max(kv_heads, tp) % min(kv_heads, tp):
        raise ValueError(f"tensor_parallel_size={tp} and the model's {kv_heads} KV heads: one must divide the "
                         "other (KV heads are split while tp <= KV heads, replicated when tp > KV heads)")
    _check_mlp(c, tp, parallel.enable_expert_parallel)
    if pp > model.num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} is more stages than the model's {model.num_layers} layers "
                         "(each stage needs at least one layer)")
    if parallel.layer_split is not None and (len(parallel.layer_split) != pp or min(parallel.layer_split) < 1
                                             or sum(parallel.layer_split) != model.num_layers):
        raise ValueError(f"layer_split={list(parallel.layer_split)} must give each of the {pp} pipeline stages at "
                         f"least one layer and {model.num_layers} layers in all")
    check_quantized_layout(model, tp)
    if parallel.enable_expert_parallel:
        check_expert_parallel(model, tp)
    if num_devices is not None and tp * pp > num_devices:
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} = {tp * pp} ranks, more than "
                         f"the {num_devices} devices available")
