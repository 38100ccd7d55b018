"""A Plan (the planner's working objects) -> the PlanFile record that `plan -o` writes."""

from __future__ import annotations

import math
from dataclasses import replace

from shardserve.planner.plan_file import (SCHEMA_VERSION, EstimatesSection, GpuSection, HardwareSection,
                                          MemorySection, ModelSection, ParallelSection, PlanFile, RuntimeSection,
                                          ServiceSection, SpeculationSection, SpeedSection, StageSection,
                                          WorkloadSection)


def plan_record(plan) -> PlanFile:
    hw, s, chosen = plan.hardware, plan.settings, plan.chosen
    mem, est, layout = chosen.memory, chosen.estimates, chosen.layout
    tightest = mem.tightest

    def per_gpu(stage) -> StageSection:
        return StageSection(total_bytes=stage.total_bytes, weights_bytes=stage.weights_bytes,
                           activation_bytes=stage.activation_bytes, overhead_bytes=stage.overhead_bytes,
                           kv_cache_bytes=mem.kv_cache_bytes(stage), lora_bytes=stage.lora_bytes or None,
                           recurrent_state_bytes=stage.recurrent_state_bytes or None)

    record = PlanFile(
        version=SCHEMA_VERSION,
        model=_model_section(plan),
        hardware=_hardware_section(hw),
        parallel=ParallelSection(**{
            "tensor_parallel_size": layout.tensor_parallel_size,
            "pipeline_parallel_size": layout.pipeline_parallel_size,
            "data_parallel_size": layout.data_parallel_size,
            "layer_split": tuple(chosen.split),
            "distributed_executor_backend": plan.executor,
            "enable_expert_parallel": chosen.expert_parallel,
        }),
        memory=MemorySection(**{
            "per_gpu": per_gpu(tightest),
            "per_stage": tuple(per_gpu(stage) for stage in mem.stages),
            "block_size": mem.block_size, "num_blocks": mem.num_blocks,
            "kv_cache_tokens": mem.kv_tokens(s.max_model_len),
            "max_concurrency": round(mem.max_concurrency(s.max_model_len), 2),
            "offload_tokens": mem.offload_tokens or None, "offload_bytes": mem.offload_bytes or None,
        }),
        runtime=RuntimeSection(**{
            "device": "cpu" if hw.gpu.is_cpu else "cuda",
            "dtype": s.dtype, "quantization": s.quantization, "kv_cache_dtype": s.kv_cache_dtype if s.is_fp8_kv else "auto",
            "max_model_len": s.max_model_len,
            "gpu_memory_utilization": s.gpu_memory_utilization,
            "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
            "block_size": s.block_size, "enable_prefix_caching": s.enable_prefix_caching,
            "kv_cache_memory_bytes": s.kv_cache_memory_bytes, "enforce_eager": s.enforce_eager,
            "kv_offloading_size": s.kv_offloading_size,
            **({"enable_lora": True, "max_loras": s.max_loras, "max_lora_rank": s.max_lora_rank} if s.enable_lora
               else {}),
            "speculative_config": s.speculative.to_json() if s.speculative else None,
        }),
        service=replace(_service_section(plan.search), draft_acceptance_rate=s.draft_acceptance_rate),
        estimates=replace(_estimates_section(est), speculation=_speculation_section(plan)),
        rationale=tuple(plan.rationale), warnings=tuple(plan.warnings),
        alternatives=tuple(plan.alternatives),
    )
    return replace(record, inputs_digest=record.digest())



def _service_section(search) -> ServiceSection:
    w, t = search.workload, search.targets
    return ServiceSection(input_len=w.input_len, output_len=w.output_len, prefix_len=w.prefix_len,
                          concurrency=w.concurrency, request_rate=w.request_rate, ttft_ms=t.ttft_ms,
                          tpot_ms=t.tpot_ms, target_percentile=w.percentile)


def finite(value: float, digits: int) -> float | None:
    """A figure as a plan writes it: rounded, or None where it is unbounded (an overloaded layout's TTFT)."""
    return round(value, digits) if math.isfinite(value) else None


def _estimates_section(est) -> EstimatesSection:
    w = est.workload
    return EstimatesSection(
        workload=WorkloadSection(input_len=w.input_len, output_len=w.output_len, prefix_len=w.prefix_len,
                                 concurrency=w.concurrency, request_rate=w.request_rate, percentile=w.percentile),
        ttft_ms=finite(est.ttft_ms, 1), tpot_ms=round(est.tpot_ms, 2),
        output_tokens_per_s=round(est.output_tokens_per_s, 1),
        output_tokens_per_s_per_gpu=round(est.output_tokens_per_s_per_gpu, 1),
        output_tokens_per_s_per_user=round(est.output_tokens_per_s_per_user, 1),
        max_request_rate=round(est.max_request_rate, 2),
        decode_tokens_per_s_batch1=round(est.decode_tokens_per_s_batch1, 1), source=est.source,
        api_max_request_rate=finite(est.api_max_request_rate, 2))


def _speculation_section(plan) -> SpeculationSection | None:
    s, without = plan.settings, plan.without_speculation
    if s.speculative is None or s.draft_acceptance_rate is None or without is None:
        return None
    return SpeculationSection(
        method=s.speculative.method, num_speculative_tokens=s.speculative.num_speculative_tokens,
        draft_acceptance_rate=s.draft_acceptance_rate, tokens_per_step=round(s.tokens_per_step, 2),
        without=SpeedSection(ttft_ms=finite(without.ttft_ms, 1), tpot_ms=round(without.tpot_ms, 2),
                             output_tokens_per_s=round(without.output_tokens_per_s, 1),
                             decode_tokens_per_s_batch1=round(without.decode_tokens_per_s_batch1, 1)))


def _model_section(plan) -> ModelSection:
    spec, s, q, hub = plan.model.spec, plan.settings, plan.model.spec.quantization, plan.model.hub
    kv_bytes = s.kv_dtype_bytes
    return ModelSection(
        id=spec.id, path=plan.model.path, architecture=spec.architecture, num_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
        num_params=plan.model.num_params, weight_bytes=plan.weight_bytes, dtype=s.dtype,
        quantization={"method": q.method, "bits": q.bits, "group_size": q.group_size} if q else None,
        kv_bytes_per_token=spec.kv_bytes_per_token(kv_bytes),
        revision=hub.revision if hub else None, download_dir=hub.download_dir if hub else None)


def _hardware_section(hw) -> HardwareSection:
    gpu = hw.gpu
    return HardwareSection(
        source=hw.source, nodes=hw.num_nodes, gpus_per_node=hw.gpus_per_node,
        gpu=GpuSection(name=gpu.name, memory_bytes=gpu.memory_bytes, hbm_bandwidth_bytes_per_s=gpu.hbm_bytes_per_s,
                       bf16_flops=gpu.bf16_flops, fp16_flops=gpu.fp16_flops, fp8=gpu.has_fp8, is_cpu=gpu.is_cpu),
        interconnect=hw.interconnect, node_ips=tuple(hw.node_ips))
