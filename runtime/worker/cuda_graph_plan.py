"""Whether every rank captures decode CUDA graphs and at which sizes (agreed across the ranks), and the
memory set aside for them.

With tensor parallelism a graph records the stage's all-reduces: every rank of a stage must capture
the same sizes in the same order (each capture's warm-up and the capture itself are collectives), and
replay the same size at every step. With pipeline stages each stage records only its own forward;
IntermediateTensors cross between stages outside the graphs (into static buffers on the receiver).
So either every rank of the engine captures the same ladder, or none does:

    rank      | decides locally                      | after agree()
    ----------+--------------------------------------+-------------------------------------
    every one | reason (None: can capture) and sizes | one decision, the same on every rank"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch

from shardserve.planner.graph_memory import GraphShape, capture_sizes, cuda_graph_bytes
from shardserve.planner.speculative import HEAD_METHODS
from shardserve.runtime.config import EngineConfig
from shardserve.runtime.distributed.parallel_state import get_parallel_state

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CaptureDecision:
    """Graphs at these sizes, or none (reason says why)."""

    reason: str | None
    sizes: tuple[int, ...] = ()

    @property
    def captures(self) -> bool:
        return self.reason is None


def local_decision(config: EngineConfig, device: torch.device, model: torch.nn.Module) -> CaptureDecision:
    """What this rank alone can do."""
    if device.type != "cuda":
        return CaptureDecision(f"the device is {device.type}")
    if config.model.enforce_eager:
        return CaptureDecision("enforce_eager=True")
    if config.lora is not None:
        return CaptureDecision("enable_lora: each batch's adapters are chosen on the host")
    spec = config.scheduler.speculative
    if spec is not None and spec.method in HEAD_METHODS:
        return CaptureDecision(f"speculative_config method {spec.method}: every step keeps the hidden states its "
                               "head reads")
    if config.model.runner == "pooling":
        return CaptureDecision("runner='pooling' prefills prompts and never decodes")
    if not getattr(model, "supports_cuda_graphs", False):
        return CaptureDecision(f"{type(model).__name__} reads tensor values on the host during its forward")
    return CaptureDecision(None, tuple(capture_sizes(config.scheduler.max_num_seqs)))


def agree(decisions: list[CaptureDecision]) -> CaptureDecision:
    """Every rank's local decision (by global rank) -> the one they all act on: graphs only where every
    rank can capture them, and then only the one ladder of sizes."""
    reasons = {d.reason for d in decisions if d.reason is not None}
    if len(reasons) == 1 and all(d.reason is not None for d in decisions):
        return CaptureDecision(reasons.pop())
    for rank, decision in enumerate(decisions):
        if decision.reason is not None:
            return CaptureDecision(f"rank {rank}: {decision.reason}")
    first = decisions[0].sizes
    differing = [rank for rank, d in enumerate(decisions) if d.sizes != first]
    if differing:
        raise RuntimeError(f"ranks {differing} would capture CUDA graphs at sizes other than rank 0's "
                           f"{list(first)}: every rank must capture the same sizes in the same order")
    return decisions[0]


def agreed_decision(config: EngineConfig, device: torch.device, model: torch.nn.Module) -> CaptureDecision:
    """local_decision, agreed with every other rank of the engine (a collective: all ranks call it)."""
    local = local_decision(config, device, model)
    world_size = get_parallel_state().world_size
    if world_size == 1 or not torch.distributed.is_initialized():
        return local
    gathered: list[CaptureDecision | None] = [None] * world_size
    torch.distributed.all_gather_object(gathered, local)
    return agree(cast("list[CaptureDecision]", gathered))  # all_gather_object filled every slot


def graph_shape(config: EngineConfig, num_layers: int) -> GraphShape:
    """This rank's decode graphs as the planner sizes them (its memory model, on this rank's slice)."""
    from shardserve.planner.memory import activation_bytes_per_token
    from shardserve.planner.model_source import load_model as load_model_info

    state = get_parallel_state()
    spec = load_model_info(config.model.model, None).spec
    dtype_bytes = config.model.dtype.itemsize
    return GraphShape(config.scheduler.max_num_seqs, config.model.max_model_len, config.cache.block_size,
                      config.model.hf_config.hidden_size, dtype_bytes, num_layers,
                      activation_bytes_per_token(spec, state.tp_size, dtype_bytes, state.enable_expert_parallel),
                      state.is_first_stage)


def reserved_graph_bytes(config: EngineConfig, num_layers: int) -> int:
    """What the KV budget leaves aside for this rank's graphs: the planner's estimate."""
    return cuda_graph_bytes(graph_shape(config, num_layers))


def log_graph_memory(measured: int, reserved: int) -> None:
    """NOTE: measured as free device memory before and after capture, so it counts the graphs'
    executables and NCCL's capture buffers as well as the graph pool."""
    logger.info("CUDA graphs hold %.3f GiB (reserved %.3f GiB)", measured / 2**30, reserved / 2**30)
    if measured > reserved:
        logger.warning("CUDA graphs took %.0f MiB more than the %.0f MiB reserved for them: lower "
                       "gpu_memory_utilization if the GPU runs out of memory", (measured - reserved) / 2**20,
                       reserved / 2**20)
