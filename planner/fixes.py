"""When no layout works: the nearest miss and what would fix it; and the fewest GPUs that would."""

from __future__ import annotations

import math
from dataclasses import replace

from shardserve.planner.errors import InfeasibleError, PlanError
from shardserve.planner.hardware import Hardware, Node
from shardserve.planner.options import resolve_settings
from shardserve.planner.quantized_releases import quantized_fix
from shardserve.planner.rules import Layout
from shardserve.planner.search import Candidate, Search, choose, estimates_of
from shardserve.planner.serving import api_max_request_rate
from shardserve.planner.speed import database_for

MAX_NODES = 16  # --recommend and "would fit" look this far
MAX_STAGES = 16  # --recommend's deepest pipeline


def _bigger(hardware: Hardware, num_nodes: int, per_node: int) -> Hardware:
    return Hardware("declared", tuple(Node(hardware.gpu, per_node) for _ in range(num_nodes)),
                    hardware.interconnect, hardware.inter_node_bytes_per_s)


def _per_node(hardware: Hardware) -> int:
    return max(hardware.gpus_per_node, 8) if hardware.total_gpus == 1 else hardware.gpus_per_node


def _replicas_needed(search: Search, shape, dp_limit: int) -> int | None:
    """The fewest replicas of this shape that meet the targets under the workload, or None."""
    base, replica, rate = shape
    if replica is None or base.problem:
        return None
    w = search.workload
    if w.request_rate is not None:  # (beyond the API process's bound no number of replicas keeps up)
        fits = rate > 0 and w.request_rate <= replica.api_max_request_rate(w)
        return math.ceil(w.request_rate / rate) if fits else None
    for dp in range(1, dp_limit + 1):
        if estimates_of(search.with_replicas(shape, dp)).meets(search.targets):
            return dp
    return None


def fewest_gpus(search: Search) -> tuple[Layout, Hardware] | None:
    """The layout on the fewest GPUs of this type (up to MAX_NODES nodes) that meets the targets."""
    best = _fewest(search)
    if best is None or not _within_recommend(search, best):
        return None
    return best, hardware_for(search.hardware, best.num_gpus)


def _fewest(search: Search) -> Layout | None:
    """The layout on the fewest GPUs of this type that meets the targets, each replica's shape fitting
    MAX_NODES nodes: at a request rate, however many replicas that takes; at a concurrency, as many as
    MAX_NODES nodes hold (None beyond)."""
    per_node = _per_node(search.hardware)
    big = replace(search, hardware=_bigger(search.hardware, MAX_NODES, per_node))
    best: Layout | None = None
    for tp in range(1, per_node + 1):
        for pp in range(1, min(search.model.spec.num_layers, MAX_STAGES, MAX_NODES * per_node // tp) + 1):
            if best and tp * pp > best.num_gpus:
                break
            dp = _replicas_needed(big, big.shape(tp, pp), MAX_NODES * per_node // (tp * pp))
            if dp is not None and (best is None or dp * tp * pp < best.num_gpus):
                best = Layout(tp, pp, dp)
    return best


def hardware_for(hardware: Hardware, num_gpus: int) -> Hardware:
    """num_gpus of the hardware's GPU type: one node of them, or full nodes of its GPUs per node."""
    per_node = _per_node(hardware)
    nodes = math.ceil(num_gpus / per_node)
    return _bigger(hardware, nodes, per_node if nodes > 1 else num_gpus)


def recommend_hardware(search: Search) -> Hardware:
    w = search.workload
    if not search.targets.is_set or (w.request_rate is None and w.concurrency is None):
        raise PlanError("--recommend needs a load (--request-rate or --concurrency) and a target (--ttft-ms "
                        "and/or --tpot-ms): the fewest GPUs that serve that load within the targets")
    best = _fewest(search)
    if best is None:
        raise InfeasibleError(f"no layout on up to {MAX_NODES} nodes of {_per_node(search.hardware)}x"
                              f"{search.hardware.gpu.name} meets {_targets_text(search)} at "
                              f"{search.workload.describe()}{api_bound_text(search)}")
    if not _within_recommend(search, best):
        raise InfeasibleError(_beyond_recommend(search, best))
    return hardware_for(search.hardware, best.num_gpus)


def api_bound_text(search: Search) -> str:
    """'' or, where the request rate asked for is beyond what the API process takes in, a clause saying so."""
    w = search.workload
    rate = api_max_request_rate(database_for(search.hardware).host.api_ms, w)
    if w.request_rate is None or w.request_rate <= rate:
        return ""
    return (f": the API process keeps up with {rate:.3g} req/s at {w.output_len:,} streamed tokens each (its CPU "
            "time a request and a token, which `shardserve calibrate` measures on this host), and one serves every "
            "replica, so no number of GPUs serves more")


def _within_recommend(search: Search, layout: Layout) -> bool:
    """Whether the layout fits the MAX_NODES nodes --recommend plans."""
    return layout.num_gpus <= MAX_NODES * _per_node(search.hardware)


def _beyond_recommend(search: Search, best: Layout) -> str:
    """A load that takes more than MAX_NODES nodes: how many, and what to do."""
    per_node, w = _per_node(search.hardware), search.workload
    return (f"{w.describe()} within {_targets_text(search)} takes {best.data_parallel_size} replicas of tp "
            f"{best.tensor_parallel_size} x pp {best.pipeline_parallel_size}: {best.num_gpus:,} "
            f"{search.hardware.gpu.name} ({math.ceil(best.num_gpus / per_node)} nodes of {per_node}), more than the "
            f"{MAX_NODES} nodes --recommend plans; split the traffic, and --recommend at each share's "
            "--request-rate plans its deployment")


def _targets_text(search: Search) -> str:
    return f"{search.targets.describe()} (p{search.workload.percentile})"


def missed_targets(search: Search, candidates: list[Candidate]) -> str:
    """The nearest miss, and what would meet the targets: more GPUs, an fp8 KV cache, fp8 weights."""
    runnable = [c for c in candidates if c.is_feasible]
    def distance(c: Candidate) -> tuple[bool, float, int]:  # of the overloaded, the one that serves the most
        e = estimates_of(c)
        far = -e.output_tokens_per_s if e.is_overloaded else search.targets.shortfall(e.ttft_ms, e.tpot_ms)
        return e.is_overloaded, far, c.layout.num_gpus
    nearest = min(runnable, key=distance)
    e = estimates_of(nearest)
    why = "; ".join(e.misses(search.targets))
    lines = [f"no layout on {search.hardware.describe()} meets {_targets_text(search)} at "
             f"{search.workload.describe()}: the nearest, {nearest.layout}, has {why}."]
    best = _fewest(search) if search.workload.concurrency is not None or \
        search.workload.request_rate is not None else None
    if best is not None and _within_recommend(search, best):
        lines.append(f"{best.num_gpus} GPUs would meet them ({best} on "
                     f"{hardware_for(search.hardware, best.num_gpus).describe()}; --recommend plans it).")
    elif best is not None:
        lines.append(_beyond_recommend(search, best) + ".")
    elif bound := api_bound_text(search):
        lines.append(f"No number of GPUs meets them{bound}.")
    lines += _variant_fixes(search, "would meet them")
    return " ".join(lines)


def _variant_fixes(search: Search, verb: str) -> list[str]:
    """Other settings that would make a plan: an fp8 KV cache, fp8 weights."""
    out, hw, spec = [], search.hardware, search.model.spec
    if not search.settings.is_fp8_kv and (hw.gpu.has_fp8 or hw.is_cpu):
        if _works(search, replace(search.options, kv_cache_dtype="fp8"), search.model):
            out.append(f"--kv-cache-dtype fp8 {verb} (half the KV bytes per token).")
    if spec.quantization is None and hw.gpu.has_fp8:
        try:
            fp8 = search.model.with_quantization("fp8")  # the config already read: no Hub request
        except PlanError:
            fp8 = None
        if fp8 is not None and _works(search, replace(search.options, quantization="fp8"), fp8):
            out.append(f"fp8 weights (--quantization fp8) {verb}.")
    return out


def _fewer_state_slots(search: Search, memory) -> str | None:
    """A model with recurrent layers keeps a state row per request it may run (max_num_seqs + 1): the most
    max_num_seqs whose rows leave the KV cache room for the requests asked for, checked by planning with it."""
    stage = memory.tightest
    if not stage.recurrent_state_bytes:
        return None
    per_row = stage.recurrent_state_bytes // (search.settings.max_num_seqs + 1)
    kv_needed = memory.blocks_per_request(search.settings.max_model_len) * search.options.target_concurrency * \
        memory.block_size * stage.kv_bytes_per_token
    num = int((stage.kv_budget_bytes + stage.recurrent_state_bytes - kv_needed) // max(1, per_row)) - 1  # - scratch
    if num < 1 or not _works(search, replace(search.options, max_num_seqs=num), search.model):
        return None
    return f"--max-num-seqs {num} would fit (a recurrent state row per request: {per_row / 2**20:.0f} MiB each)."


def _works(search: Search, options, model) -> bool:
    settings = resolve_settings(options, model.spec, search.hardware.gpu)
    variant = replace(search, model=model, options=options, settings=settings)
    return choose(variant.candidates(), search.hardware, search.targets, variant.settings) is not None


def cannot_fit(search: Search, candidates: list[Candidate]) -> str:
    """Why nothing fits in memory, and what would: a shorter max_model_len, fp8 KV, more GPUs."""
    spec, hardware, settings, options = search.model.spec, search.hardware, search.settings, search.options
    sized = [(c.memory, c) for c in candidates if c.memory is not None]
    head = f"{spec.id} does not fit on {hardware.describe()}"
    if not sized:
        return f"{head}: " + "; ".join(sorted({c.problem for c in candidates if c.problem}))
    memory, best = max(sized, key=lambda mc: (mc[0].kv_cache_tokens, mc[0].tightest.kv_budget_bytes))
    lines = [f"{head} with max_model_len {settings.max_model_len}: {best.problem} (best layout {best.layout})."]
    fitting_len = memory.longest_fitting_len(spec.max_context_len, options.target_concurrency)
    if fitting_len is not None and fitting_len >= settings.block_size:
        lines.append(f"--max-model-len {fitting_len} would fit ({best.layout}; --max-model-len auto picks it).")
    no_targets = replace(search, targets=replace(search.targets, ttft_ms=None, tpot_ms=None))
    lines += [f for f in _variant_fixes(no_targets, "would fit") if f.startswith("--kv")]
    lines += [fix for fix in [_fewer_state_slots(no_targets, memory), quantized_fix(search)] if fix]
    if not hardware.is_cpu:
        lines.append(_gpus_needed(no_targets))
    return " ".join(lines)


def _gpus_needed(search: Search) -> str:
    """The smallest hardware of the same GPU that would fit: a fuller node, then more nodes."""
    hardware, spec = search.hardware, search.model.spec
    options = replace(search.options, tensor_parallel_size=None, pipeline_parallel_size=None,
                      data_parallel_size=None)
    settings = resolve_settings(options, spec, hardware.gpu)
    per_node = max(hardware.gpus_per_node, 8)
    sizes = [(1, n) for n in range(hardware.gpus_per_node + 1, 9)]
    sizes += [(nodes, per_node) for nodes in range(2, 33)]
    for nodes, count in sizes:
        if nodes * count <= hardware.total_gpus:
            continue
        bigger = _bigger(hardware, nodes, count)
        probe = replace(search, hardware=bigger, options=options, settings=settings)
        # one replica over all of it: tp as wide as the node allows, pipeline for the rest
        for tp in [tp for tp in range(count, 0, -1) if (nodes * count) % tp == 0]:
            pp = nodes * count // tp
            if pp > spec.num_layers:
                continue
            base = probe.shape(tp, pp, with_rate=False)[0]
            if base.memory is not None and base.is_feasible:
                shape = f"{nodes}x{count}x{hardware.gpu.name}" if nodes > 1 else f"{count}x{hardware.gpu.name}"
                more = nodes * count - hardware.total_gpus
                return f"{shape} would fit ({more} more GPU{'s' if more > 1 else ''})."
    return f"not even 32 nodes of {per_node}x{hardware.gpu.name} would fit."
