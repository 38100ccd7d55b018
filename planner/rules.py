"""The layout rules: what a tensor/pipeline/replica layout must satisfy to run at all."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.planner.hardware import GIB, Hardware
from shardserve.planner.linear_attention import linear_attention_problem
from shardserve.planner.model_spec import ModelSpec


@dataclass(frozen=True, order=True)
class Layout:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_replica * self.data_parallel_size

    def __str__(self) -> str:
        return (f"tp={self.tensor_parallel_size} pp={self.pipeline_parallel_size} "
                f"dp={self.data_parallel_size}")


# NOTE: below this many output features per expert and rank, a grouped GEMM tile (64-128 wide) runs
# mostly empty and each expert's weights come in slivers; whole experts per rank keep GEMMs full.
EFFICIENT_EXPERT_WIDTH = 128


def expert_parallel_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why whole experts cannot be dealt out evenly to `tp` ranks, or None."""
    if not spec.is_moe:
        return f"enable_expert_parallel: {spec.id} has no routed experts (not a mixture-of-experts model)"
    assert spec.num_experts  # is_moe
    if spec.num_experts % tp:
        return (f"enable_expert_parallel: {spec.num_experts} experts do not divide evenly over "
                f"tensor_parallel_size {tp} (every rank holds as many experts)")
    return None


def expert_parallel_reason(spec: ModelSpec, tp: int) -> str | None:
    """Why whole experts per rank beat splitting every expert at this tp (None: they do not, or cannot)."""
    if tp == 1 or expert_parallel_problem(spec, tp):
        return None
    inter, q = spec.moe_intermediate_size, spec.quantization
    assert inter is not None  # a mixture of experts (expert_parallel_problem checked it)
    per_rank = inter // tp
    if inter % tp:
        return f"moe_intermediate_size {inter} does not divide by tensor_parallel_size {tp}"
    if q and q.group_size and per_rank % q.group_size:
        return f"splitting experts would cut {q.method} groups of {q.group_size} ({inter} / {tp} = {per_rank})"
    if q and q.block_shape and (per_rank % q.block_shape[0] or per_rank % q.block_shape[1]):
        return f"splitting experts would cut fp8 weight blocks ({inter} / {tp} = {per_rank})"
    if per_rank < EFFICIENT_EXPERT_WIDTH:
        return (f"splitting experts leaves {inter} / {tp} = {per_rank} features per expert and rank, "
                f"below an efficient GEMM width of {EFFICIENT_EXPERT_WIDTH}")
    return None


def _split_mlp(spec: ModelSpec, expert_parallel: bool) -> tuple[str, int]:
    """The MLP width tensor parallel splits, named; 0 when none is (expert parallel, experts only)."""
    if not spec.is_moe:
        return "intermediate_size", spec.intermediate_size
    if not expert_parallel:
        assert spec.moe_intermediate_size is not None  # a mixture of experts has it
        return "moe_intermediate_size", spec.moe_intermediate_size
    has_dense = len(spec.moe_layers) < spec.num_layers  # Qwen-MoE's mlp_only_layers stay split
    return "intermediate_size", spec.intermediate_size if has_dense else 0


FP8_COMPUTE_CAPABILITY = (8, 9)  # Ada, Hopper and later have fp8 tensor cores


def fp8_kv_problem(kv_cache_dtype: str, device: str, has_fp8: bool) -> str | None:
    """Why an fp8 KV cache cannot run on `device` (the plan's GPU or the worker's own), or None. CPU
    ranks store fp8 and compute in float32, so they count as having fp8."""
    if not kv_cache_dtype.startswith("fp8") or has_fp8:
        return None
    return (f"kv_cache_dtype {kv_cache_dtype} needs a GPU with fp8 support (compute capability "
            f"{'.'.join(map(str, FP8_COMPUTE_CAPABILITY))} or newer); {device} has none: use kv_cache_dtype auto")


def offload_blocks(size_gib: float | None, rank_block_bytes: int, num_ranks: int) -> int:
    """Blocks in the CPU tier of the KV cache (kv_offloading_size, GiB per replica summed over its
    ranks, as vLLM counts it): a block is kept on every rank, each costed as the rank that needs most
    per block, so no rank's share exceeds size / num_ranks (planner and runtime share this rule)."""
    if not size_gib:
        return 0
    return int(size_gib * GIB) // (rank_block_bytes * num_ranks)


def offload_size_problem(size_gib: float | None, rank_block_bytes: int, num_ranks: int) -> str | None:
    """A CPU tier too small for one block (offload_blocks' rule) would hold nothing."""
    if size_gib is None or offload_blocks(size_gib, rank_block_bytes, num_ranks):
        return None
    return (f"kv_offloading_size {size_gib:g} GiB holds no KV block ({rank_block_bytes * num_ranks} bytes across "
            "a replica's ranks): raise it")


def prefix_caching_problem(enable_prefix_caching: bool | None, recurrent_kind: str | None) -> str | None:
    """A model with recurrent layers (`recurrent_kind`, such as "Gated DeltaNet") keeps one state per
    request rather than KV per block: a prefix hit would need that state at the prefix's last token,
    which nothing keeps, so prefix caching cannot be turned on for it."""
    if recurrent_kind is None or not enable_prefix_caching:
        return None
    return (f"enable_prefix_caching is not served for this model: its {recurrent_kind} layers keep one state per "
            "request, not KV per block, so no prefix can be reused; leave --enable-prefix-caching unset (or false)")


def resolved_prefix_caching(enable_prefix_caching: bool | None, recurrent_kind: str | None) -> bool:
    """enable_prefix_caching as served (after prefix_caching_problem): unset means on, except for a model
    with recurrent layers."""
    return enable_prefix_caching is not False and recurrent_kind is None


def offload_groups_problem(kv_offloading_size: float | None, windows: tuple[int | None, ...]) -> str | None:
    """The CPU tier keeps one block table's blocks; a model with a table per kind of layer (full attention and
    sliding windows, planner/kv_groups.py) would need a tier per table."""
    if kv_offloading_size is None or len(windows) == 1:
        return None
    return ("kv_offloading_size is not served for this model: its full-attention and sliding-window layers keep a "
            "block table each, and the CPU tier holds one table's blocks; drop --kv-offloading-size")


def offload_problem(enable_prefix_caching: bool, kv_offloading_size: float | None) -> str | None:
    """The CPU tier keeps prefix blocks: without prefix caching it would hold nothing anyone reads."""
    if kv_offloading_size is not None and not enable_prefix_caching:
        return ("kv_offloading_size needs enable_prefix_caching: the CPU tier keeps evicted prefix blocks for "
                "later prompts; turn prefix caching on or drop --kv-offloading-size")
    return None


def tensor_parallel_problem(spec: ModelSpec, tp: int, expert_parallel: bool = False) -> str | None:
    """Rule 4: why `tp` cannot shard this model (its experts whole per rank with expert_parallel), or None."""
    if tp == 1:
        return None
    if expert_parallel and expert_parallel_problem(spec, tp):
        return expert_parallel_problem(spec, tp)
    heads, kv = spec.num_attention_heads, spec.num_kv_heads
    if heads % tp:
        return f"{heads} attention heads are not divisible by tensor_parallel_size {tp}"
    if kv % tp and tp % kv:
        return (f"{kv} KV heads neither divide by tensor_parallel_size {tp} nor divide it "
                "(KV heads can only be split evenly or replicated whole)")
    if linear_attention_problem(spec, tp):
        return linear_attention_problem(spec, tp)
    label, inter = _split_mlp(spec, expert_parallel)
    if inter % tp:
        return f"{label} {inter} is not divisible by tensor_parallel_size {tp}"
    if spec.shared_expert_intermediate_size and spec.shared_expert_intermediate_size % tp:
        return (f"shared_expert_intermediate_size {spec.shared_expert_intermediate_size} is "
                f"not divisible by tensor_parallel_size {tp}")
    q = spec.quantization
    shared = spec.shared_expert_intermediate_size or 0  # Qwen2-MoE's shared expert: split like a dense MLP
    if q and q.group_size:
        # row-parallel layers split their input features: each rank needs whole groups, or, under act-order
        # (every rank keeps all groups, found through g_idx), whole int32 words of packed rows
        unit, what = ((32 // q.bits, f"act-order: {q.bits}-bit words of {32 // q.bits} rows do not divide")
                      if q.has_act_order else (q.group_size, f"group_size {q.group_size} does not divide"))
        for name, features in (("intermediate size", inter), ("attention width", heads * spec.head_dim),
                               ("shared expert intermediate size", shared)):
            if (features // tp) % unit:
                return (f"{q.method} {what} the {name} per rank "
                        f"({features} / {tp} = {features // tp})")
    if q and q.block_shape:
        block_out, block_in = q.block_shape
        for name, features in (("intermediate size", inter), ("shared expert intermediate size", shared)):
            if (features // tp) % block_in or (features // tp) % block_out:
                return (f"fp8 weight blocks {block_out}x{block_in} do not divide the {name} per rank "
                        f"({features} / {tp} = {features // tp})")
    return None


def placement_problem(layout: Layout, spec: ModelSpec, hardware: Hardware) -> str | None:
    """Why this layout cannot be placed on this hardware, or None."""
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    if pp > spec.num_layers:
        return (f"pipeline_parallel_size {pp} is more stages than the model's "
                f"{spec.num_layers} layers")
    unit = hardware.gpu.unit
    more = " (declare CPU ranks with --hardware NxCPU, e.g. --hardware 2xcpu)" if hardware.is_cpu else ""
    if tp > hardware.gpus_per_node:
        return (f"tensor_parallel_size {tp} is more than the {hardware.gpus_per_node} {unit}(s) of a "
                "node (tensor parallel stays inside a node: use pipeline parallel across nodes)" + more)
    if layout.num_gpus > hardware.total_gpus:
        return (f"{layout} needs {layout.num_gpus} {unit}s; the hardware has "
                f"{hardware.total_gpus}" + more)
    groups = sum(node.num_gpus // tp for node in hardware.nodes)
    if pp * layout.data_parallel_size > groups:
        return (f"{layout} needs {pp * layout.data_parallel_size} groups of {tp} {unit}s inside a "
                f"node; the nodes hold {groups}" + more)
    return None


def max_replicas(tp: int, pp: int, hardware: Hardware) -> int:
    groups = sum(node.num_gpus // tp for node in hardware.nodes)
    return groups // pp


def nodes_used(layout: Layout, hardware: Hardware) -> int:
    """Nodes the layout spans when replicas and stages are packed node by node."""
    used, left = 0, layout.num_gpus
    for node in hardware.nodes:
        if left <= 0:
            break
        take = min(left, node.num_gpus // layout.tensor_parallel_size
                   * layout.tensor_parallel_size)
        used, left = used + (take > 0), left - take
    return used


def replica_spans_nodes(layout: Layout, hardware: Hardware) -> bool:
    return layout.gpus_per_replica > hardware.gpus_per_node
