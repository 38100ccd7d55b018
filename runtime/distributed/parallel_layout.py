"""Refusing impossible tensor/pipeline layouts before any worker starts, by the planner's own rules."""

from __future__ import annotations

from dataclasses import replace

from shardserve.planner.errors import PlanError
from shardserve.planner.model_spec import ModelSpec
from shardserve.planner.rules import expert_parallel_problem, tensor_parallel_problem
from shardserve.planner.settings import BY_NAME
from shardserve.runtime.config import ModelConfig, ParallelConfig
from shardserve.runtime.layers.quantization.config import check_quantized_layout


def planner_spec(model: ModelConfig) -> ModelSpec:
    """The planner's view of the model being loaded (its config and the quantization it loads with)."""
    try:
        spec = ModelSpec.from_config(model.architecture, model.hf_config.to_dict())  # messages name the architecture
    except PlanError as e:
        raise ValueError(str(e)) from None
    return replace(spec, quantization=model.quantization.spec) if model.quantization else spec


def check_parallel_layout(model: ModelConfig, parallel: ParallelConfig, num_devices: int | None) -> None:
    """Raise ValueError for a layout no worker could run: the planner's rule 4 (tensor parallel, experts
    whole per rank) and its pipeline limits. `num_devices`: GPUs this executor can place ranks on
    (None: no limit, as for CPU ranks)."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_parallel_size={tp} and pipeline_parallel_size={pp} must be at least 1")
    BY_NAME["distributed_executor_backend"].check(parallel.distributed_executor_backend)
    check_quantized_layout(model)
    spec, ep = planner_spec(model), parallel.enable_expert_parallel
    if ep and expert_parallel_problem(spec, tp):
        raise ValueError(f"{expert_parallel_problem(spec, tp)}; leave enable_expert_parallel off")
    problem = tensor_parallel_problem(spec, tp, ep)
    if problem:
        hint = ("; enable_expert_parallel keeps experts whole" if spec.is_moe and not ep
                and not tensor_parallel_problem(spec, tp, True) else "")
        raise ValueError(f"tensor_parallel_size={tp} cannot shard this model: {problem}{hint}")
    if pp > model.num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} is more stages than the model's {model.num_layers} layers "
                         "(each stage needs at least one layer)")
    if parallel.layer_split is not None and (len(parallel.layer_split) != pp or min(parallel.layer_split) < 1
                                             or sum(parallel.layer_split) != model.num_layers):
        raise ValueError(f"layer_split={list(parallel.layer_split)} must give each of the {pp} pipeline stages at "
                         f"least one layer and {model.num_layers} layers in all")
    if num_devices is not None and tp * pp > num_devices:
        raise ValueError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} = {tp * pp} ranks, more than "
                         f"the {num_devices} devices available")
