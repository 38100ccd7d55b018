"""Say why: the rule that decided, the warnings, and why the other layouts lost."""

from __future__ import annotations

from shardserve.planner.hardware import GIB, Hardware
from shardserve.planner.model_source import ModelInfo
from shardserve.planner.options import RuntimeSettings
from shardserve.planner.rules import expert_parallel_problem, expert_parallel_reason, replica_spans_nodes
from shardserve.planner.search import Candidate, rank_key, tier


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB / 2 else f"{nbytes / 2**20:.1f} MiB"


def rationale(model: ModelInfo, hardware: Hardware, settings: RuntimeSettings,
              chosen: Candidate, candidates: list[Candidate], executor: str,
              weights: int, pins: dict[str, int] | None = None,
              forced_expert_parallel: bool | None = None) -> list[str]:
    """`pins`: the sizes the settings fixed; the layout is then theirs, not a rule's."""
    spec, layout, gpu = model.spec, chosen.layout, hardware.gpu
    tp, pp, dp = (layout.tensor_parallel_size, layout.pipeline_parallel_size,
                  layout.data_parallel_size)
    usable = gpu.memory_bytes * settings.gpu_memory_utilization
    offer = (f"host memory offers {_gib(usable)} per rank; KV cache pool "
             f"{_gib(settings.kv_cache_memory_bytes)}" if gpu.is_cpu else
             f"one {gpu.name} offers {_gib(usable)} at gpu_memory_utilization "
             f"{settings.gpu_memory_utilization}")
    lines = [f"weights: {_gib(weights)} in {settings.dtype}"
             + (f" ({spec.quantization.method})" if spec.quantization else "") + f"; {offer}"]
    one_gpu = next((c for c in candidates if c.layout.gpus_per_replica == 1), None)
    layout_pins = {k: v for k, v in (pins or {}).items() if k != "data_parallel_size"}
    if layout_pins:
        lines.append("layout pinned by the settings: "
                     + ", ".join(f"{k}={v}" for k, v in layout_pins.items()))
    elif layout.gpus_per_replica == 1:
        lines.append(f"rule 1: the model fits on one {'rank' if gpu.is_cpu else 'GPU'} with "
                     "room for KV cache"
                     + (f"; the other {dp - 1} {gpu.unit}s serve as replicas (data parallel)"
                        if dp > 1 else ""))
    else:
        if one_gpu is not None and one_gpu.problem:
            lines.append(f"one {gpu.unit} is not enough: {one_gpu.problem}")
        if replica_spans_nodes(layout, hardware):
            if tp == hardware.gpus_per_node:
                lines.append(f"rule 3: too big for one node; tensor parallel {tp} = GPUs per "
                             f"node, pipeline parallel {pp} across nodes")
            else:
                lines.append(f"rule 4: tensor parallel {hardware.gpus_per_node} is not "
                             f"possible, so tensor parallel {tp} with {pp} pipeline stages")
        elif hardware.interconnect == "pcie" and tp == 1:
            lines.append(f"rule 5: no NVLink between {gpu.name} GPUs, so pipeline parallel "
                         f"{pp} rather than tensor parallel")
        elif pp == 1:
            lines.append(f"rule 2: fits in one node; tensor parallel {tp} inside it"
                         + (f", {dp} replicas" if dp > 1 else ""))
        else:
            lines.append(f"rule 4: no tensor-parallel size uses every GPU "
                         f"({_tp_blocker(candidates, tp)}), so pipeline parallel {pp} "
                         "with an uneven split rather than idle GPUs")
    experts = _experts_line(model, chosen, forced_expert_parallel)
    if experts:
        lines.append(experts)
    if pp > 1:
        lines.append(f"rule 7: layers per stage {list(chosen.split)}: the first stage holds "
                     "the embedding, the last the final norm and LM head")
    lines.append(f"rule 6: executor {executor} ("
                 + ("one node" if executor == "mp" else
                    "several nodes" if hardware.source != "ray" else "inside a Ray cluster")
                 + ")")
    mem = chosen.memory
    lines.append(f"KV cache: {mem.kv_cache_tokens} tokens per replica, "
                 f"{mem.max_concurrency(settings.max_model_len):.2f}x requests of "
                 f"{settings.max_model_len} tokens")
    return lines


def _experts_line(model: ModelInfo, chosen: Candidate, forced: bool | None) -> str | None:
    """Rule 8, for a mixture of experts over tensor-parallel ranks: whole experts per rank or every
    expert split, and why."""
    spec, tp = model.spec, chosen.layout.tensor_parallel_size
    if not spec.is_moe or tp == 1:
        return None
    whole = (f"expert parallel: {spec.num_experts // tp} of the {spec.num_experts} experts whole on each "
             "rank, attention tensor parallel")
    split = f"experts split by tensor parallel ({spec.moe_intermediate_size // tp} features per expert and rank)"
    if forced is not None:
        return f"rule 8: {whole if chosen.expert_parallel else split}, as enable_expert_parallel={forced} asks"
    if chosen.expert_parallel:
        return f"rule 8: {whole}: {expert_parallel_reason(spec, tp)}"
    blocked = expert_parallel_problem(spec, tp)
    why = blocked.removeprefix("enable_expert_parallel: ") if blocked else "GEMMs stay wide enough"
    return f"rule 8: {split}: {why}"


def _tp_blocker(candidates: list[Candidate], tp: int) -> str:
    blocked = [c.problem for c in candidates
               if c.layout.pipeline_parallel_size == 1 and c.layout.tensor_parallel_size > tp
               and c.problem]
    return blocked[-1] if blocked else "the GPU count"


def warnings(model: ModelInfo, hardware: Hardware, settings: RuntimeSettings,
             chosen: Candidate) -> list[str]:
    spec, layout = model.spec, chosen.layout
    out = list(hardware.notes)
    if hardware.is_cpu:
        out.append("no GPU: this is a CPU plan (gloo between ranks; float32)")
    idle = hardware.total_gpus - layout.num_gpus
    if idle:
        out.append(f"{idle} {hardware.gpu.unit}(s) left idle by {layout}")
    if layout.tensor_parallel_size > spec.num_kv_heads:
        out.append(f"tensor_parallel_size {layout.tensor_parallel_size} > {spec.num_kv_heads} "
                   "KV heads: KV heads are replicated, so KV cache per GPU does not shrink")
    if len({n.gpu.name for n in hardware.nodes}) > 1:
        out.append("mixed GPUs: every rank is planned for the smallest memory and the slowest "
                   "bandwidth among them")
    wanted = hardware.gpu.memory_bytes * settings.gpu_memory_utilization
    for node in hardware.nodes:
        for i, free in enumerate(node.free_memory_bytes or ()):
            if free < wanted:
                out.append(f"GPU {i} has {_gib(free)} free but gpu_memory_utilization "
                           f"{settings.gpu_memory_utilization} asks for {_gib(wanted)}: "
                           "another process holds memory; lower --gpu-memory-utilization")
    if model.tensors_from == "config":
        out.append("weight sizes derived from config.json (no safetensors files read)")
    return out


def alternatives(chosen: Candidate, candidates: list[Candidate], hardware: Hardware,
                 limit: int = 5) -> list[dict]:
    """The best few other layouts and why each lost."""
    others = [c for c in candidates if c is not chosen and c.estimates is not None]
    others.sort(key=lambda c: (not c.is_feasible, rank_key(c, hardware)))
    out = []
    for c in others[:limit]:
        out.append({
            "tensor_parallel_size": c.layout.tensor_parallel_size,
            "pipeline_parallel_size": c.layout.pipeline_parallel_size,
            "data_parallel_size": c.layout.data_parallel_size,
            "throughput_tokens_per_s": round(c.estimates.throughput_tokens_per_s, 1),
            "decode_tokens_per_s_batch1": round(c.estimates.decode_tokens_per_s_batch1, 1),
            "kv_cache_tokens": c.memory.kv_cache_tokens,
            "why_not": _why_not(c, chosen, hardware),
        })
    return out


def _why_not(c: Candidate, chosen: Candidate, hardware: Hardware) -> str:
    if c.problem:
        return c.problem
    if chosen.layout.gpus_per_replica == 1 and c.layout.gpus_per_replica > 1:
        return f"rule 1: one {hardware.gpu.unit} per replica suffices"
    idle = hardware.total_gpus - c.layout.num_gpus
    if idle > hardware.total_gpus - chosen.layout.num_gpus:
        return f"leaves {idle} {hardware.gpu.unit}(s) idle"
    if tier(c.layout, hardware) > tier(chosen.layout, hardware):
        if replica_spans_nodes(c.layout, hardware):
            return (f"rule 3: across nodes, tensor parallel should fill a node's "
                    f"{hardware.gpus_per_node} GPUs and pipeline stages span the nodes")
        if hardware.interconnect == "pcie":
            return "rule 5: tensor parallel over PCIe"
        return "rule 2: inside an NVLink node, tensor parallel beats pipeline stages"
    ratio = c.estimates.throughput_tokens_per_s / chosen.estimates.throughput_tokens_per_s
    return f"slower: {ratio:.0%} of the chosen layout's estimated throughput"
