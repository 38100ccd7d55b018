"""A plan file's speed model again, for any workload: what `launch` compares its measurements with.

The plan records everything the speed model needs (the GPU, the layout and layer split, the
runtime settings, the KV cache it sized), so `predict(plan, model, workload)` gives the estimates
the planner would have made for that traffic on exactly that deployment.
"""

from __future__ import annotations

from dataclasses import replace

from shardserve.planner.catalog import find_gpu
from shardserve.planner.draft import load_draft
from shardserve.planner.errors import PlanError
from shardserve.planner.hardware import GpuSpec, Hardware, Node
from shardserve.planner.model_source import ModelInfo
from shardserve.planner.options import RuntimeSettings
from shardserve.planner.plan_file import GpuSection, PlanFile
from shardserve.planner.serving import Replica
from shardserve.planner.settings import default
from shardserve.planner.speculative import resolve
from shardserve.planner.speed import Estimates, estimate, replica_model
from shardserve.planner.workload import Targets, Workload


def _gpu(section: GpuSection, interconnect: str) -> GpuSpec:
    if section.is_cpu:
        return GpuSpec.cpu(section.memory_bytes)
    if find_gpu(section.name) is not None:
        return replace(GpuSpec.from_catalog(section.name), memory_bytes=section.memory_bytes)
    # mixed nodes: the plan's weakest-of-each figures (links as a PCIe or NVLink catalog GPU has them)
    link = GpuSpec.from_catalog("H100-PCIE" if interconnect == "pcie" else "H100-80GB").link_bytes_per_s
    return GpuSpec(section.name, section.memory_bytes, section.hbm_bandwidth_bytes_per_s, section.bf16_flops,
                   section.fp16_flops, section.fp8, interconnect, link)


def hardware_of(plan: PlanFile) -> Hardware:
    hw = plan.hardware
    gpu = _gpu(hw.gpu, hw.interconnect)
    return Hardware(hw.source, tuple(Node(gpu, hw.gpus_per_node) for _ in range(hw.nodes)), hw.interconnect)


def settings_of(plan: PlanFile) -> RuntimeSettings:
    rt = plan.runtime
    return RuntimeSettings(
        dtype=rt.dtype, quantization=rt.quantization,
        kv_cache_dtype=rt.kv_cache_dtype if rt.kv_cache_dtype.startswith("fp8") else rt.dtype,
        max_model_len=rt.max_model_len, max_num_seqs=rt.max_num_seqs,
        max_num_batched_tokens=rt.max_num_batched_tokens, block_size=rt.block_size,
        gpu_memory_utilization=rt.gpu_memory_utilization, enable_prefix_caching=rt.enable_prefix_caching,
        kv_cache_memory_bytes=rt.kv_cache_memory_bytes, enforce_eager=rt.enforce_eager,
        kv_offloading_size=rt.kv_offloading_size, enable_lora=bool(rt.enable_lora),
        max_loras=rt.max_loras or default("max_loras"), max_lora_rank=rt.max_lora_rank or default("max_lora_rank"),
        **_speculation(plan))


def _speculation(plan: PlanFile) -> dict:
    """RuntimeSettings' speculative and draft_acceptance_rate from the plan, or a PlanError naming the setting."""
    try:
        config, rate = resolve(plan.runtime.speculative_config, plan.service.draft_acceptance_rate)
    except ValueError as e:
        raise PlanError(f"the plan's {e}") from None
    return {"speculative": config, "draft_acceptance_rate": rate}


def replica_of(plan: PlanFile, model: ModelInfo) -> Replica:
    """The speed model of one of the plan's replicas: its layout, split, GPU, settings and KV cache."""
    par = plan.parallel
    settings = settings_of(plan)
    return replica_model(model.spec, list(par.layer_split), par.tensor_parallel_size, par.enable_expert_parallel,
                         hardware_of(plan), settings, plan.memory.num_blocks * plan.memory.block_size,
                         load_draft(settings, model))


def predict(plan: PlanFile, model: ModelInfo, workload: Workload) -> Estimates:
    """The plan's deployment under `workload` (whole deployment), within the plan's targets."""
    return predict_replicas(plan, replica_of(plan, model), workload)


def predict_replicas(plan: PlanFile, replica: Replica, workload: Workload) -> Estimates:
    """The plan's replicas and targets, each replica served as `replica` models it."""
    par, svc = plan.parallel, plan.service
    targets = Targets(svc.ttft_ms, svc.tpot_ms)
    rate = replica.max_request_rate(workload.per_replica(1),
                                    lambda s: not targets.misses(s.ttft_ms, s.tpot_ms))
    gpus = par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size
    return estimate(replica, workload, targets, par.data_parallel_size, gpus, rate)
