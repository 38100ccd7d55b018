"""Make a plan: resolve settings, search layouts, explain the choice, and write the schema."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardserve.planner.errors import InfeasibleError, PlanError
from shardserve.planner.hardware import Hardware, Node
from shardserve.planner.model_source import ModelInfo
from shardserve.planner.options import PlanOptions, RuntimeSettings, resolve_settings
from shardserve.planner.rationale import alternatives, rationale, warnings
from shardserve.planner.rules import Layout, nodes_used
from shardserve.planner.plan_file import PlanFile
from shardserve.planner.schema import plan_record
from shardserve.planner.served import check_served
from shardserve.planner.search import Candidate, candidate_layouts, choose, evaluate
from shardserve.planner.sharding import total_weight_bytes


@dataclass(frozen=True)
class Plan:
    model: ModelInfo
    hardware: Hardware
    settings: RuntimeSettings
    chosen: Candidate
    executor: str
    rationale: tuple[str, ...]
    warnings: tuple[str, ...]
    alternatives: tuple[dict, ...]
    weight_bytes: int  # the whole model, in the runtime dtype

    def record(self) -> PlanFile:
        return plan_record(self)

    def to_dict(self) -> dict:
        return plan_record(self).to_dict()


def make_plan(model: ModelInfo, hardware: Hardware, options: PlanOptions) -> Plan:
    check_served(model.spec)
    if options.enable_expert_parallel and not model.spec.is_moe:
        raise PlanError(f"enable_expert_parallel: {model.spec.id} has no routed experts (not a "
                        "mixture-of-experts model); leave --enable-expert-parallel off")
    settings = resolve_settings(options, model.spec, hardware.gpu)
    candidates = _search(model, hardware, options, settings)
    pinned = _pinned_problem(candidates, options)
    if pinned:
        raise PlanError(pinned)
    chosen = choose(candidates, hardware)
    if chosen is None:
        raise InfeasibleError(_cannot_fit(model, hardware, options, settings, candidates))
    executor = choose_executor(chosen.layout, hardware, options)
    weight_bytes = total_weight_bytes(model.spec, model.groups, settings.dtype)
    return Plan(model, hardware, settings, chosen, executor,
                tuple(rationale(model, hardware, settings, chosen, candidates, executor,
                                weight_bytes, _pins(options), options.enable_expert_parallel)),
                tuple(warnings(model, hardware, settings, chosen)),
                tuple(alternatives(chosen, candidates, hardware)), weight_bytes)


def _pins(options: PlanOptions) -> dict[str, int]:
    return {name: getattr(options, name) for name in
            ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
            if getattr(options, name) is not None}


def _search(model, hardware, options, settings) -> list[Candidate]:
    return [evaluate(model, layout, hardware, options, settings)
            for layout in candidate_layouts(model, hardware, options)]


def _pinned_problem(candidates: list[Candidate], options: PlanOptions) -> str | None:
    """When the user pinned sizes and every layout they allow breaks a rule, say which."""
    pins = (options.tensor_parallel_size, options.pipeline_parallel_size,
            options.data_parallel_size, options.enable_expert_parallel)
    if not any(pins) or any(c.memory is not None for c in candidates):
        return None
    return candidates[0].problem if candidates else "no layout matches the pinned sizes"


def choose_executor(layout: Layout, hardware: Hardware, options: PlanOptions) -> str:
    """Rule 6: mp on one node, ray across nodes or inside a Ray cluster; the flag overrides."""
    spans = nodes_used(layout, hardware)
    ranks = layout.tensor_parallel_size * layout.pipeline_parallel_size
    if options.distributed_executor_backend == "uni" and ranks > 1:
        raise PlanError(f"distributed_executor_backend uni runs one rank in-process; {layout} has "
                        f"{ranks}: use mp or ray")
    if options.distributed_executor_backend == "mp" and spans > 1:
        raise PlanError(f"distributed_executor_backend mp runs on one node; {layout} spans "
                        f"{spans} nodes: use ray")
    if options.distributed_executor_backend:
        return options.distributed_executor_backend
    return "ray" if hardware.source == "ray" or spans > 1 else "mp"


def _cannot_fit(model: ModelInfo, hardware: Hardware, options: PlanOptions,
                settings: RuntimeSettings, candidates: list[Candidate]) -> str:
    spec = model.spec
    sized = [c for c in candidates if c.memory is not None]
    head = f"{spec.id} does not fit on {hardware.describe()}"
    if not sized:
        return f"{head}: " + "; ".join(sorted({c.problem for c in candidates}))
    best = max(sized, key=lambda c: (c.memory.kv_cache_tokens,
                                     c.memory.tightest.kv_budget_bytes))
    lines = [f"{head} with max_model_len {settings.max_model_len}: {best.problem} "
             f"(best layout {best.layout})."]
    fitting_len = best.memory.kv_cache_tokens // options.target_concurrency
    if fitting_len >= settings.block_size:
        lines.append(f"--max-model-len {fitting_len} would fit ({best.layout}).")
    if not settings.is_fp8_kv and (hardware.gpu.has_fp8 or hardware.is_cpu):
        fp8 = replace(options, kv_cache_dtype="fp8")
        if choose(_search(model, hardware, fp8, resolve_settings(fp8, spec, hardware.gpu)),
                  hardware):
            lines.append("--kv-cache-dtype fp8 would fit (half the KV bytes per token).")
    more = _gpus_needed(model, hardware, options)
    if more:
        lines.append(more)
    return " ".join(lines)


def _gpus_needed(model: ModelInfo, hardware: Hardware, options: PlanOptions) -> str | None:
    """The smallest hardware of the same GPU that would fit: a fuller node, then more nodes."""
    if hardware.is_cpu:
        return None
    gpu, spec = hardware.gpu, model.spec
    settings = resolve_settings(replace(options, tensor_parallel_size=None,
                                        pipeline_parallel_size=None), spec, gpu)
    per_node = max(hardware.gpus_per_node, 8)
    sizes = [(1, n) for n in range(hardware.gpus_per_node + 1, 9)]
    sizes += [(nodes, per_node) for nodes in range(2, 33)]
    for nodes, count in sizes:
        if nodes * count <= hardware.total_gpus:
            continue
        bigger = Hardware("declared", tuple(Node(gpu, count) for _ in range(nodes)),
                          hardware.interconnect, hardware.inter_node_bytes_per_s)
        # one replica over all of it: tp as wide as the node allows, pipeline for the rest
        tps = [tp for tp in range(count, 0, -1) if (nodes * count) % tp == 0]
        for tp in tps:
            layout = Layout(tp, nodes * count // tp, 1)
            if layout.pipeline_parallel_size > spec.num_layers:
                continue
            if evaluate(model, layout, bigger, options, settings).is_feasible:
                shape = f"{nodes}x{count}x{gpu.name}" if nodes > 1 else f"{count}x{gpu.name}"
                more = nodes * count - hardware.total_gpus
                return f"{shape} would fit ({more} more GPU{'s' if more > 1 else ''})."
    return f"not even 32 nodes of {per_node}x{gpu.name} would fit."
