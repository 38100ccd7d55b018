"""Roofline speed estimates for a layout: decode, throughput and time to first token."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardserve.planner.hardware import GpuSpec, Hardware
from shardserve.planner.model_spec import ModelSpec
from shardserve.planner.options import RuntimeSettings
from shardserve.planner.sharding import ShardedModel

# NOTE: a roofline with the efficiencies good kernels reach: 80% of HBM bandwidth for decode,
# 60% of dense FLOP/s for prefill and large batches. Estimates rank layouts; they are not
# promises, and `bench/` measures the real numbers.
HBM_EFFICIENCY = 0.8
FLOPS_EFFICIENCY = 0.6
# Context per request assumed for decode estimates (tokens of KV read per step).
DECODE_CONTEXT = 1024
_LATENCY_S = {"nvlink": 8e-6, "pcie": 20e-6, "none": 50e-6, "network": 30e-6}


@dataclass(frozen=True)
class Estimates:
    decode_tokens_per_s_batch1: float
    throughput_tokens_per_s: float  # output tokens/s of all replicas at full batch
    ttft_ms: float                  # a prompt of max_model_len tokens, idle server
    batch_per_replica: int


@dataclass(frozen=True)
class _Stage:
    weight_bytes: float  # one rank
    embedding_bytes: float
    expert_bytes: float
    params: float        # one rank's parameters, dense-equivalent (all experts)
    num_layers: int
    kv_bytes_per_token: int


def estimate(spec: ModelSpec, num_params: float, sharded: ShardedModel, split: list[int],
             stage_weights: list[float], kv_per_token: list[int], tp: int, dp: int,
             hardware: Hardware, settings: RuntimeSettings, kv_cache_tokens: int) -> Estimates:
    gpu, pp = hardware.gpu, len(split)
    total_weights = sum(stage_weights) or 1.0
    stages, start = [], 0
    for s, (count, weights) in enumerate(zip(split, stage_weights)):
        experts = sum(sharded.layer_bytes[start:start + count]) / max(
            sum(sharded.layer_bytes), 1.0) * sharded.expert_bytes
        stages.append(_Stage(weights, sharded.embedding_bytes if s == 0 else 0.0, experts,
                             num_params / tp * weights / total_weights, count, kv_per_token[s]))
        start += count
    flops = _flops(gpu, settings, spec)
    link, latency = _link(hardware)
    hops = _hop_links(hardware, tp, pp)

    def replica_step(batch: int, context: int) -> float:
        """Seconds for `batch` requests to each get one token through every stage."""
        return sum(_decode_stage(st, spec, batch, context, tp, gpu, flops, link, latency,
                                 settings) for st in stages) + sum(
            _hop(batch, spec, settings, h, hardware) for h in hops)

    context = min(settings.max_model_len, DECODE_CONTEXT)
    batch1 = 1.0 / replica_step(1, context)
    batch = max(1, min(settings.max_num_seqs, kv_cache_tokens // context))
    if pp == 1 or batch < pp:
        per_replica = batch / replica_step(batch, context)
    else:
        # pp micro-batches in flight, one per stage: every stage-time the pipeline hands out
        # one micro-batch's tokens, and the slowest stage (with its hop) sets the stage-time.
        micro = batch // pp
        slowest = max(_decode_stage(st, spec, micro, context, tp, gpu, flops, link, latency,
                                    settings) for st in stages)
        slowest += max(_hop(micro, spec, settings, h, hardware) for h in hops)
        per_replica = micro / slowest
    ttft = sum(_prefill_stage(st, spec, settings, tp, gpu, flops, link, latency)
               for st in stages)
    ttft += sum(_hop(settings.max_model_len, spec, settings, h, hardware) for h in hops)
    return Estimates(batch1, per_replica * dp, ttft * 1e3, batch)


def _flops(gpu: GpuSpec, settings: RuntimeSettings, spec: ModelSpec) -> float:
    base = gpu.bf16_flops if settings.dtype == "bfloat16" else gpu.fp16_flops
    if settings.dtype == "float32":
        base = max(gpu.bf16_flops, gpu.fp16_flops) / 2  # TF32 tensor cores
    if spec.quantization and spec.quantization.method == "fp8" and gpu.has_fp8:
        base *= 2
    return base * FLOPS_EFFICIENCY


def _link(hardware: Hardware) -> tuple[float, float]:
    gpu = hardware.gpu
    return gpu.link_bytes_per_s, _LATENCY_S[hardware.interconnect]


def _allreduce(nbytes: float, tp: int, link: float, latency: float) -> float:
    if tp == 1:
        return 0.0
    return latency + 2 * (tp - 1) / tp * nbytes / link  # ring all-reduce


def _decode_stage(st: _Stage, spec: ModelSpec, batch: int, context: int, tp: int,
                  gpu: GpuSpec, flops: float, link: float, latency: float,
                  settings: RuntimeSettings) -> float:
    weights_read = st.weight_bytes - st.embedding_bytes
    active = st.params
    if spec.is_moe and st.expert_bytes:
        share = spec.num_experts_per_tok / spec.num_experts
        touched = 1 - (1 - share) ** batch  # experts a batch of tokens reaches, in expectation
        weights_read -= st.expert_bytes * (1 - touched)
        active -= st.params * (st.expert_bytes / st.weight_bytes) * (1 - share)
    kv_read = batch * context * st.kv_bytes_per_token
    memory_s = (weights_read + kv_read) / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    compute_s = 2 * active * batch / flops
    comm = 2 * st.num_layers * _allreduce(batch * spec.hidden_size * settings.dtype_bytes, tp,
                                          link, latency)
    return max(memory_s, compute_s) + comm


def _prefill_stage(st: _Stage, spec: ModelSpec, settings: RuntimeSettings, tp: int,
                   gpu: GpuSpec, flops: float, link: float, latency: float) -> float:
    n = settings.max_model_len
    active = st.params
    if spec.is_moe and st.expert_bytes:
        active -= st.params * (st.expert_bytes / st.weight_bytes) * (
            1 - spec.num_experts_per_tok / spec.num_experts)
    heads = spec.num_attention_heads // tp
    attention = 2 * st.num_layers * n * n * heads * spec.head_dim  # causal QK^T and PV
    compute_s = (2 * active * n + attention) / flops
    chunks = math.ceil(n / settings.max_num_batched_tokens)
    memory_s = chunks * st.weight_bytes / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    comm = 2 * st.num_layers * chunks * _allreduce(
        min(n, settings.max_num_batched_tokens) * spec.hidden_size * settings.dtype_bytes, tp,
        link, latency)
    return max(compute_s, memory_s) + comm


def _hop_links(hardware: Hardware, tp: int, pp: int) -> list[str]:
    """For each stage boundary of a replica: 'node' (inside a node) or 'network'."""
    per_node = hardware.gpus_per_node
    return ["network" if (s * tp) // per_node != ((s + 1) * tp) // per_node else "node"
            for s in range(pp - 1)]


def _hop(tokens: int, spec: ModelSpec, settings: RuntimeSettings, where: str,
         hardware: Hardware) -> float:
    nbytes = 2 * tokens * spec.hidden_size * settings.dtype_bytes  # hidden states + residual
    if where == "network":
        return _LATENCY_S["network"] + nbytes / hardware.inter_node_bytes_per_s
    return _LATENCY_S[hardware.interconnect] + nbytes / hardware.gpu.link_bytes_per_s
