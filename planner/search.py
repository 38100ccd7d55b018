"""Evaluate every layout the hardware allows and choose one by the rules, fastest first."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.planner.hardware import Hardware
from shardserve.planner.memory import MemoryPlan, plan_memory
from shardserve.planner.model_source import ModelInfo
from shardserve.planner.options import PlanOptions, RuntimeSettings
from shardserve.planner.rules import (Layout, expert_parallel_reason, max_replicas, placement_problem,
                                      replica_spans_nodes, tensor_parallel_problem)
from shardserve.planner.speed import Estimates, estimate


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    problem: str | None  # why it cannot run; None when it can
    split: tuple[int, ...] = ()
    memory: MemoryPlan | None = None
    estimates: Estimates | None = None
    expert_parallel: bool = False  # MoE: whole experts per tp rank

    @property
    def is_feasible(self) -> bool:
        return self.problem is None


def evaluate(model: ModelInfo, layout: Layout, hardware: Hardware, options: PlanOptions,
             settings: RuntimeSettings) -> Candidate:
    spec = model.spec
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    ep = uses_expert_parallel(model, tp, options)
    problem = tensor_parallel_problem(spec, tp, ep) or placement_problem(layout, spec, hardware)
    if problem:
        return Candidate(layout, problem, expert_parallel=ep)
    sharded = model.sharded(tp, settings.dtype, pp, ep)
    split = sharded.split(pp)
    stage_weights = sharded.stage_bytes(split)
    memory = plan_memory(spec, stage_weights, split, tp, hardware.gpu, settings, ep)
    needed = settings.max_model_len * options.target_concurrency
    problem = None
    if memory.tightest.kv_budget_bytes <= 0:
        t = memory.tightest
        problem = (f"weights {t.weights_bytes / 2**30:.1f} GiB + activations and overhead "
                   f"{(t.activation_bytes + t.overhead_bytes) / 2**30:.1f} GiB exceed "
                   f"{t.total_bytes * settings.gpu_memory_utilization / 2**30:.1f} GiB per {hardware.gpu.unit}")
    elif memory.kv_cache_tokens < needed:
        problem = (f"KV cache holds {memory.kv_cache_tokens} tokens; {needed} needed for "
                   f"{options.target_concurrency} request(s) of {settings.max_model_len}")
    est = estimate(spec, model.num_params, sharded, split, stage_weights,
                   [s.kv_bytes_per_token for s in memory.stages], tp,
                   layout.data_parallel_size, hardware, settings, memory.kv_cache_tokens)
    return Candidate(layout, problem, tuple(split), memory, est, ep)


def uses_expert_parallel(model: ModelInfo, tp: int, options: PlanOptions) -> bool:
    """As enable_expert_parallel forces it, else where expert_parallel_reason finds whole experts better."""
    if options.enable_expert_parallel is not None:
        return options.enable_expert_parallel
    return expert_parallel_reason(model.spec, tp) is not None


def candidate_layouts(model: ModelInfo, hardware: Hardware,
                      options: PlanOptions) -> list[Layout]:
    """Every (tp, pp) the pins allow, each with as many replicas as fit (or the pinned dp)."""
    tps = ([options.tensor_parallel_size] if options.tensor_parallel_size
           else range(1, hardware.gpus_per_node + 1))
    out = []
    for tp in tps:
        max_pp = max(1, min(model.spec.num_layers, hardware.total_gpus // tp))
        pps = ([options.pipeline_parallel_size] if options.pipeline_parallel_size
               else range(1, max_pp + 1))
        for pp in pps:
            dp = options.data_parallel_size or max(1, max_replicas(tp, pp, hardware))
            out.append(Layout(tp, pp, dp))
    return out


def tier(layout: Layout, hardware: Hardware) -> int:
    """Rules 2, 3 and 5 as a preference: lower is preferred."""
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    if replica_spans_nodes(layout, hardware):
        return 2 if tp == hardware.gpus_per_node else 3  # rule 3: tp = GPUs per node
    if hardware.interconnect == "pcie":
        return 0 if tp == 1 else 1  # rule 5: pipeline over PCIe
    return 0 if pp == 1 else 1  # rule 2: tensor parallel inside a node


def rank_key(c: Candidate, hardware: Hardware):
    idle = hardware.total_gpus - c.layout.num_gpus
    return (idle, tier(c.layout, hardware), -c.estimates.throughput_tokens_per_s,
            -c.memory.kv_cache_tokens, c.layout)


def choose(candidates: list[Candidate], hardware: Hardware) -> Candidate | None:
    """Rule 1 first: one GPU per replica when it fits. Then fewest idle GPUs (rule 4), the
    rules' preferred shape (2, 3, 5), and the highest estimated throughput."""
    feasible = [c for c in candidates if c.is_feasible]
    if not feasible:
        return None
    single = [c for c in feasible if c.layout.gpus_per_replica == 1]
    if single:
        return min(single, key=lambda c: rank_key(c, hardware))
    return min(feasible, key=lambda c: rank_key(c, hardware))
