"""The layouts that lost: the best of each shape, the Pareto front marked, and why each lost."""

from __future__ import annotations

from shardserve.planner.hardware import Hardware
from shardserve.planner.schema import finite
from shardserve.planner.search import PREFERENCE_MARGIN, Candidate, estimates_of, pareto_front, preference, rank_key
from shardserve.planner.workload import Targets


# the estimates each alternative shows, with their decimals
SPEED_FIELDS = (("output_tokens_per_s", 1), ("output_tokens_per_s_per_gpu", 1), ("output_tokens_per_s_per_user", 1),
                ("ttft_ms", 1), ("tpot_ms", 2))


def _best_per_shape(candidates: list[Candidate], targets: Targets) -> list[Candidate]:
    """One candidate per (tp, pp, expert parallel): with targets the fewest replicas that meet them (else the most),
    without them the one the search tried (every GPU busy)."""
    shapes: dict[tuple[int, int, bool], list[Candidate]] = {}
    for c in candidates:
        if c.memory is not None:
            shapes.setdefault((c.layout.tensor_parallel_size, c.layout.pipeline_parallel_size, c.expert_parallel),
                              []).append(c)
    out = []
    for group in shapes.values():
        runnable = [c for c in group if c.is_feasible]
        meeting = [c for c in runnable if targets.is_set and estimates_of(c).meets(targets)]
        if meeting:
            out.append(min(meeting, key=lambda c: c.layout.num_gpus))
        else:
            out.append(max(runnable or group, key=lambda c: c.layout.num_gpus))
    return out


def alternatives(chosen: Candidate, candidates: list[Candidate], hardware: Hardware, targets: Targets,
                 limit: int = 6) -> list[dict]:
    """The best few other layouts, the Pareto front (tokens/s per GPU against per user) first."""
    front = {id(c) for c in pareto_front(candidates)}
    others = [c for c in _best_per_shape(candidates, targets)
              if (c.layout, c.expert_parallel) != (chosen.layout, chosen.expert_parallel)]
    others.sort(key=lambda c: (not c.is_feasible, id(c) not in front,
                               rank_key(c, hardware) if c.is_feasible else c.layout))
    out = []
    for c in others[:limit]:
        # a layout that cannot run has no speed, an overloaded one no TTFT (unbounded): their cells stay empty
        speed = {name: None if c.estimates is None else finite(getattr(c.estimates, name), digits)
                 for name, digits in SPEED_FIELDS}
        out.append({
            "tensor_parallel_size": c.layout.tensor_parallel_size,
            "pipeline_parallel_size": c.layout.pipeline_parallel_size,
            "data_parallel_size": c.layout.data_parallel_size,
            "enable_expert_parallel": c.expert_parallel,
            **speed,
            "kv_cache_tokens": c.memory.kv_tokens(c.settings.max_model_len) if c.memory and c.settings else 0,
            "on_pareto_front": id(c) in front,
            "why_not": why_not(c, chosen, hardware, targets),
        })
    return out


def why_not(c: Candidate, chosen: Candidate, hardware: Hardware, targets: Targets) -> str:
    if c.problem:
        return c.problem
    e, best = estimates_of(c), estimates_of(chosen)
    if targets.is_set:
        misses = e.misses(targets)
        if misses:
            return "; ".join(misses)
        if c.layout.num_gpus > chosen.layout.num_gpus:
            return f"meets the targets on {c.layout.num_gpus} GPUs; the plan needs {chosen.layout.num_gpus}"
        ratio = e.output_tokens_per_s_per_gpu / best.output_tokens_per_s_per_gpu
        if round(ratio, 2) == 1 and e.max_request_rate < best.max_request_rate:  # a rate both keep up with
            return (f"meets the targets on as many GPUs, up to {e.max_request_rate:,.2f} req/s (the plan "
                    f"{best.max_request_rate:,.2f})")
        return f"meets the targets with {ratio:.0%} of the plan's output tokens/s per GPU"
    idle = hardware.total_gpus - c.layout.num_gpus
    if idle > hardware.total_gpus - chosen.layout.num_gpus:
        return f"leaves {idle} {hardware.gpu.unit}(s) idle"
    ratio = e.output_tokens_per_s / best.output_tokens_per_s
    if ratio > 1 and preference(c, hardware) > preference(chosen, hardware):
        return (f"{ratio:.0%} of the plan's output tokens/s, within {1 - PREFERENCE_MARGIN:.0%}: the rules' "
                "preferred shape wins")
    if preference(c, hardware) < preference(chosen, hardware):
        return f"the rules prefer it, but it is estimated at {ratio:.0%} of the plan's output tokens/s"
    overload = e.overload()
    return f"slower: {ratio:.0%} of the plan's estimated output tokens/s" + (f" ({overload})" if overload else "")
