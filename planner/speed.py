"""Speed of a layout for a workload: TTFT, TPOT and tokens/s from measured operators and batching.

`replica_model` turns a layout into a `serving.Replica` (its step time for any batch, built per
stage by `operators`, pipeline stages overlapping micro-batches, host time per step); `estimate`
runs the workload through it and scales to the replicas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from shardserve.planner.draft import DraftModel
from shardserve.planner.hardware import GpuSpec, Hardware
from shardserve.planner.model_spec import ModelSpec
from shardserve.planner.operators import Chunk, Operators, StageShape, stage_step_ms
from shardserve.planner.options import RuntimeSettings
from shardserve.planner.perf_tables import Database, load_database, roofline_fit
from shardserve.planner.serving import Replica, ReplicaSpeed
from shardserve.planner.workload import Targets, Workload

_LATENCY_S = {"nvlink": 8e-6, "pcie": 20e-6, "none": 50e-6, "network": 30e-6}


@dataclass(frozen=True)
class Estimates:
    workload: Workload           # the lengths and the concurrency or rate of the whole deployment
    ttft_ms: float
    tpot_ms: float
    output_tokens_per_s: float   # the whole deployment
    output_tokens_per_s_per_gpu: float
    output_tokens_per_s_per_user: float
    max_request_rate: float      # requests/s the deployment serves within the targets
    decode_tokens_per_s_batch1: float
    is_overloaded: bool
    source: str                  # where the operator times came from
    api_max_request_rate: float = math.inf  # requests/s the deployment's one API process keeps up with

    @property
    def is_api_bound(self) -> bool:
        """The API process, not the GPUs, sets the output tokens/s."""
        return self.output_tokens_per_s >= self.api_max_request_rate * self.workload.output_len * (1 - 1e-9)

    def meets(self, targets: Targets) -> bool:
        return not self.misses(targets)

    def misses(self, targets: Targets) -> list[str]:
        """What keeps it from the targets, worded for a reader: the latencies over them, then an overload."""
        return targets.misses(self.ttft_ms, self.tpot_ms) + [m for m in (self.overload(),) if m]

    def overload(self) -> str | None:
        """None, or how the load outruns the layout: at a request rate, 'overloaded: serves at most 12.8 of
        the 100 req/s asked for (3,847 output tokens/s); TTFT grows without bound' (the queue never ends)."""
        if not self.is_overloaded:
            return None
        w = self.workload
        if w.request_rate is None or math.isfinite(self.ttft_ms):
            return "overloaded: prompts arrive faster than the steps prefill them"
        by = " (the API process's bound)" if self.is_api_bound else ""
        return (f"overloaded: serves at most {self.output_tokens_per_s / w.output_len:.3g} of the "
                f"{w.request_rate:g} req/s asked for ({self.output_tokens_per_s:,.0f} output tokens/s){by}; "
                "TTFT grows without bound")


def _dtypes(spec: ModelSpec, settings: RuntimeSettings, hardware: Hardware) -> dict:
    gpu, q = hardware.gpu, spec.quantization
    if settings.dtype == "float32":
        gemm, bits = "float32", 32
    elif q and q.method == "fp8" and gpu.has_fp8:
        gemm, bits = "fp8", 8
    else:
        gemm, bits = "bfloat16", q.bits if q and q.method in ("awq", "gptq") else 16
    kv = "fp8" if settings.is_fp8_kv else settings.dtype
    expert_bits = 4 if q and q.method == "mxfp4" and bits == 16 else bits
    return {"gemm_dtype": gemm, "weight_bits": bits, "act_bytes": settings.dtype_bytes, "kv_dtype": kv,
            "kv_bytes": settings.kv_dtype_bytes, "expert_bits": expert_bits}


def stage_shapes(spec: ModelSpec, split: list[int], tp: int, expert_parallel: bool,
                 settings: RuntimeSettings, hardware: Hardware) -> list[StageShape]:
    dtypes, shapes, start = _dtypes(spec, settings, hardware), [], 0
    windowed = _window_layers(spec)
    moe = set(spec.moe_layers)
    for s, count in enumerate(split):
        layers = range(start, start + count)
        shapes.append(StageShape(
            spec, tp, expert_parallel, count, sum(1 for i in layers if i in moe),
            sum(1 for i in layers if i in windowed), s == 0, s == len(split) - 1, **dtypes,
            num_linear_layers=spec.num_linear_layers(layers)))
        start += count
    return shapes


def _window_layers(spec: ModelSpec) -> set[int]:
    if not spec.sliding_window:
        return set()
    if spec.layer_types is None:
        return set(range(spec.num_layers))
    return {i for i, kind in enumerate(spec.layer_types) if kind == "sliding_attention"}


def database_for(hardware: Hardware) -> Database:
    """The GPU's tables; the measured all-reduce only where the node's links are the catalog's."""
    db = load_database(hardware.gpu.name)
    if "allreduce" in db.tables and hardware.interconnect != hardware.gpu.interconnect:
        db = replace(db, tables={k: v for k, v in db.tables.items() if k != "allreduce"})
    return db


_OPERATORS: dict[tuple[GpuSpec, int], Operators] = {}


def _operators(gpu: GpuSpec, db: Database) -> Operators:
    """One Operators per GPU and database, so that its cached operator times serve every layout a
    search compares (each candidate used to start from an empty cache)."""
    key = (gpu, id(db))
    found = _OPERATORS.get(key)
    if found is None or found.db is not db:  # (an id reused after its database was dropped)
        if len(_OPERATORS) >= 16:  # databases made per plan (links filtered, a new calibration): no hoard
            _OPERATORS.clear()
        found = _OPERATORS[key] = Operators(gpu, db, gpu.link_bytes_per_s)
    return found


def replica_model(spec: ModelSpec, split: list[int], tp: int, expert_parallel: bool,
                  hardware: Hardware, settings: RuntimeSettings, kv_cache_tokens: int,
                  draft: DraftModel | None = None) -> Replica:
    """`kv_cache_tokens`: the pool's pages x block_size (MemoryPlan.kv_cache_tokens); `draft`: speculative_config's
    draft model, which runs before the target's forward on its one stage."""
    db = database_for(hardware)
    ops = _operators(hardware.gpu, db)
    draft_step = _draft_step(draft, tp, settings, hardware, ops, db)
    shapes = stage_shapes(spec, split, tp, expert_parallel, settings, hardware)
    hops = [_hop_cost(spec, settings, h, hardware) for h in _hop_links(hardware, tp, len(split))]
    cache: dict = {}
    cycles: dict = {}
    # steps without CUDA graphs (a prefill or mixed step, a step verifying drafts, every step with --enforce-eager
    # or LoRA, a CPU's every step): the host issues every kernel
    always_eager = hardware.is_cpu or not settings.graphs_captured

    def stage(i: int, b: int, chunks: tuple[Chunk, ...], context: int, drafts: int) -> float:
        key = (i, b, chunks, context, drafts)
        if key not in cache:
            device = stage_step_ms(ops, shapes[i], b, context, chunks, drafts)
            issue = shapes[i].num_layers * db.host.eager_layer_ms if always_eager or chunks or drafts else 0.0
            # a GPU computes while its host issues the next kernels; a CPU's one thread does both in turn
            cache[key] = device + issue if hardware.is_cpu else max(device, issue)
        return cache[key]

    def cycle(b: int, chunks: tuple[Chunk, ...], context: int, drafts: int = 0) -> float:
        key = (b, chunks, context, drafts)
        if key not in cycles:
            cycles[key] = _cycle(b, chunks, context, drafts)
        return cycles[key]

    def _cycle(b: int, chunks: tuple[Chunk, ...], context: int, drafts: int) -> float:
        host = db.host.ms(b)
        if len(shapes) == 1:
            return stage(0, b, chunks, context, drafts) + draft_step(b, chunks, context, drafts) + host
        # NOTE: pp micro-batches in flight (one per stage while b allows): a request's next token
        # comes after one pass through every stage, or after every micro-batch took the slowest
        # stage, whichever is longer. Each micro-batch verifies its requests' drafts.
        micro = max(1, min(len(shapes), b))  # (a step of prefill chunks alone: one micro-batch)
        mb, md = math.ceil(b / micro), math.ceil(drafts / micro)
        tokens = mb + md + sum(c.tokens for c in chunks)
        one_pass = sum(stage(i, mb, chunks, context, md) for i in range(len(shapes)))
        one_pass += sum(fixed + per_token * tokens for fixed, per_token in hops)
        slowest = max(stage(i, mb, (), context, md) for i in range(len(shapes)))
        busiest = max(stage(i, mb, chunks, context, md) for i in range(len(shapes)))
        return max(one_pass, (micro - 1) * slowest + busiest) + host * micro

    return Replica(cycle, settings.max_num_seqs, settings.max_num_batched_tokens, kv_cache_tokens,
                   db.host.request_ms, _source(db, hardware.gpu.name), kv_windows=spec.kv_groups.windows,
                   num_drafts=settings.num_drafts, tokens_per_step=settings.tokens_per_step,
                   api_ms=db.host.api_ms)


def _draft_step(draft: DraftModel | None, tp: int, settings: RuntimeSettings, hardware: Hardware, ops: Operators,
                db: Database) -> Callable[[int, tuple[Chunk, ...], int, int], float]:
    """A draft model's share of a step: a forward catching it up with the step's tokens, then one a round for
    drafts 2 to k, each issued kernel by kernel (it runs eagerly) after the host's work for it."""
    if draft is None:
        return lambda b, chunks, context, drafts: 0.0
    shape = stage_shapes(draft.info.spec, [draft.num_layers], tp, False, settings, hardware)[0]
    issue = draft.num_layers * db.host.eager_layer_ms

    def step(b: int, chunks: tuple[Chunk, ...], context: int, drafts: int) -> float:
        rounds = max(0, drafts // b - 1) if b else 0
        forwards = [stage_step_ms(ops, shape, b, context, chunks)] + [stage_step_ms(ops, shape, b, context, ())] * rounds
        return sum((f + issue if hardware.is_cpu else max(f, issue)) + db.host.ms(b) for f in forwards)
    return step


def _source(db: Database, gpu: str) -> str:
    if db.is_measured:
        return "measured operators: " + "; ".join(db.sources)
    return (f"no measured data for {gpu}: roofline with efficiencies "
            f"{roofline_fit()['source'].removeprefix('fitted by bench/perfdata_extract.py to ')} reach")


def estimate(replica: Replica, workload: Workload, targets: Targets, dp: int, num_gpus: int,
             replica_max_rate: float) -> Estimates:
    """The deployment's speed for `workload` (whole deployment), its replicas sharing it evenly;
    `replica_max_rate`: the rate one replica serves within the targets (Replica.max_request_rate)."""
    if workload.concurrency is None and workload.request_rate is None:  # full batches
        workload = replace(workload, concurrency=round(replica.max_running(workload) * dp, 1))
    speed: ReplicaSpeed = replica.speed(workload.per_replica(dp))
    batch1_ms = replica.decode_step_ms(workload, 1)  # one request decoding alone (its drafts verified too)
    api_rate = replica.api_max_request_rate(workload)
    total = min(speed.output_tokens_per_s * dp, api_rate * workload.output_len)
    # requests asked for faster than the API process takes them in queue before it without end
    api_overloaded = workload.request_rate is not None and workload.request_rate > api_rate
    return Estimates(workload, math.inf if api_overloaded else speed.ttft_ms, speed.tpot_ms, total,
                     total / num_gpus, 1e3 / speed.tpot_ms, min(replica_max_rate * dp, api_rate),
                     1e3 * replica.tokens_per_step / batch1_ms, speed.is_overloaded or api_overloaded,
                     replica.source, api_rate)


def _hop_links(hardware: Hardware, tp: int, pp: int) -> list[str]:
    """For each stage boundary of a replica: 'node' (inside a node) or 'network'."""
    per_node = hardware.gpus_per_node
    return ["network" if (s * tp) // per_node != ((s + 1) * tp) // per_node else "node"
            for s in range(pp - 1)]


def _hop_cost(spec: ModelSpec, settings: RuntimeSettings, where: str, hardware: Hardware) -> tuple[float, float]:
    """(fixed ms, ms per token) to hand a stage's hidden states and residual to the next stage."""
    per_token = 2 * spec.hidden_size * settings.dtype_bytes
    if where == "network":
        return _LATENCY_S["network"] * 1e3, per_token / hardware.inter_node_bytes_per_s * 1e3
    return _LATENCY_S[hardware.interconnect] * 1e3, per_token / hardware.gpu.link_bytes_per_s * 1e3
