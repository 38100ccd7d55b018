"""Make a plan: resolve settings and the workload, search layouts, explain the choice, write the schema."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardserve.planner.draft import load_draft
from shardserve.planner.errors import InfeasibleError, PlanError
from shardserve.planner.fixes import cannot_fit, hardware_for, missed_targets, recommend_hardware
from shardserve.planner.hardware import Hardware
from shardserve.planner.model_source import ModelInfo
from shardserve.planner.options import (PlanOptions, RuntimeSettings, resolve_settings, resolve_targets,
                                        resolve_workload)
from shardserve.planner.plan_file import PlanFile
from shardserve.planner.alternatives import alternatives
from shardserve.planner.rationale import rationale, speculation_note, warnings
from shardserve.planner.rules import Layout, nodes_used
from shardserve.planner.schema import plan_record
from shardserve.planner.search import Candidate, Search, choose, estimates_of
from shardserve.planner.speed import Estimates
from shardserve.planner.settings import SettingError
from shardserve.planner.served import check_served
from shardserve.planner.sharding import total_weight_bytes
from shardserve.planner.workload import Targets

# NOTE: a recorded trace is replayed (plan --trace) on the chooser's first few layouts, not on every one: the
# steady-state model ranks them in milliseconds, a replay takes about a second per 1,000 requests.
MAX_CONTENDERS = 4


@dataclass(frozen=True)
class Plan:
    model: ModelInfo
    hardware: Hardware
    settings: RuntimeSettings
    chosen: Candidate
    executor: str
    rationale: tuple[str, ...]
    warnings: tuple[str, ...]
    alternatives: tuple[dict, ...]
    weight_bytes: int  # the whole model, in the runtime dtype
    search: Search
    candidates: tuple[Candidate, ...] = ()  # every layout the search tried, the chosen among them
    recommend: bool = False  # planned on the fewest GPUs of the type (make_plan's `recommend`)
    without_speculation: Estimates | None = None  # with speculative_config: the chosen layout's speed without it

    def record(self) -> PlanFile:
        return plan_record(self)

    def contenders(self, limit: int = MAX_CONTENDERS) -> list[Plan]:
        """This plan, then the plans the next best layouts make (the chooser's order, up to `limit` in all): what a
        replayed trace decides among (`replayed_choice`)."""
        rivals = contenders(self.chosen, list(self.candidates), self.hardware, self.search.targets,
                            self.search.settings, limit)
        return [self] + [self.with_chosen(self.search.exact(c)) for c in rivals[1:]]

    def with_chosen(self, chosen: Candidate) -> Plan:
        """The plan with another of its candidates chosen, explained again."""
        return _assembled(self.model, self.hardware, self.search, chosen, list(self.candidates), self.recommend)

    def to_dict(self) -> dict:
        return plan_record(self).to_dict()


def make_search(model: ModelInfo, hardware: Hardware, options: PlanOptions) -> Search:
    settings = resolve_settings(options, model.spec, hardware.gpu)
    workload = resolve_workload(options, settings.max_model_len)
    targets = resolve_targets(options)
    if targets.is_set and workload.concurrency is None and workload.request_rate is None:
        raise PlanError("latency targets need the load they hold at: add --request-rate (requests/s) or "
                        "--concurrency (requests in flight)")
    return Search(model, hardware, options, settings, workload, targets, draft=load_draft(settings, model))


def make_plan(model: ModelInfo, hardware: Hardware, options: PlanOptions, recommend: bool = False,
              layer_split: tuple[int, ...] | None = None) -> Plan:
    """`recommend`: plan on the fewest GPUs of hardware's GPU type that meet the targets at the
    request rate (the hardware given names the type and the GPUs per node). `layer_split`: layers per
    pipeline stage as given (a plan edited by hand), instead of balanced by weight bytes."""
    check_served(model.spec)
    if options.enable_expert_parallel and not model.spec.is_moe:
        raise PlanError(f"enable_expert_parallel: {model.spec.id} has no routed experts (not a "
                        "mixture-of-experts model); leave --enable-expert-parallel off")
    if layer_split is not None and (min(layer_split, default=0) < 1 or sum(layer_split) != model.spec.num_layers):
        raise PlanError(f"layer_split {list(layer_split)} must give each stage at least one layer and "
                        f"{model.spec.num_layers} layers in all")
    search = replace(make_search(model, hardware, options), layer_split=layer_split)
    if recommend:
        hardware = recommend_hardware(search)
        search = replace(search, hardware=hardware)
    candidates = search.candidates()
    pinned = _pinned_problem(candidates, options)
    if pinned:
        raise PlanError(pinned)
    chosen = choose(candidates, hardware, search.targets, search.settings)
    if recommend and chosen is not None and chosen.layout.num_gpus < hardware.total_gpus:
        # NOTE: the search tries step budgets and expert placements that the count of GPUs does not (it
        # would take minutes): what it chose may need fewer GPUs, and then the hardware is that many
        hardware = hardware_for(hardware, chosen.layout.num_gpus)
        search = replace(search, hardware=hardware)
        candidates = search.candidates()
        chosen = choose(candidates, hardware, search.targets, search.settings)
    if chosen is None:
        if any(c.is_feasible for c in candidates) and search.targets.is_set:
            raise InfeasibleError(missed_targets(search, candidates))
        raise InfeasibleError(cannot_fit(search, candidates))
    search, chosen = _fitted_workload(search, search.exact(chosen))
    return _assembled(model, hardware, search, chosen, candidates, recommend)


def _assembled(model: ModelInfo, hardware: Hardware, search: Search, chosen: Candidate, candidates: list[Candidate],
               recommend: bool) -> Plan:
    """The plan of the chosen candidate (its memory sized at its own settings), explained."""
    settings = chosen.settings  # max_model_len auto: the chosen layout's number; max_num_seqs: its cap
    assert settings is not None  # the chosen candidate is feasible
    options = search.options
    executor = choose_executor(chosen.layout, hardware, options)
    weight_bytes = total_weight_bytes(model.spec, model.groups, settings.dtype)
    reasons = rationale(search, chosen, candidates, executor, weight_bytes, _pins(options), recommend)
    notes = warnings(model, hardware, settings, chosen)
    without = None
    if settings.speculative is not None:  # the same layout, settings and load, every step one token a request
        plain = replace(search, draft=None).with_settings(speculative=None, draft_acceptance_rate=None)
        without = plain.again(chosen).estimates
        assert without is not None  # Search.again estimates the layout it sizes
        line, warning = speculation_note(settings, estimates_of(chosen), without, hardware, search.draft,
                                         chosen.layout.tensor_parallel_size)
        reasons.append(line)
        notes += [warning] if warning else []
    return Plan(model, hardware, settings, chosen, executor, tuple(reasons), tuple(notes),
                tuple(alternatives(chosen, candidates, hardware, search.targets)), weight_bytes, search,
                tuple(candidates), recommend, without)


def contenders(chosen: Candidate, candidates: list[Candidate], hardware: Hardware, targets: Targets,
               base: RuntimeSettings, limit: int) -> list[Candidate]:
    """The chosen candidate, then the one `choose` takes were the layouts before it gone, and so on (one candidate
    per layout, up to `limit` in all), among those it could take on other numbers: with targets, every layout
    (`choose` keeps those meeting them); without, the chosen one's pool (as many GPUs, one per replica if it has)."""
    def key(c: Candidate) -> tuple:
        return c.layout, c.expert_parallel

    def in_pool(c: Candidate) -> bool:
        single = c.layout.gpus_per_replica == 1
        return targets.is_set or (c.layout.num_gpus == chosen.layout.num_gpus
                                  and single == (chosen.layout.gpus_per_replica == 1))

    out = [chosen]
    pool = [c for c in candidates if c.is_feasible and key(c) != key(chosen) and in_pool(c)]
    while len(out) < limit and (taken := choose(pool, hardware, targets, base)) is not None:
        out.append(taken)
        pool = [c for c in pool if key(c) != key(taken)]
    return out


def replayed_choice(contenders: list[Plan], replayed: list[Estimates]) -> Plan | None:
    """The contender `choose` takes with each one's estimates as a replayed trace measured them (its latencies at the
    plan's percentile, the output tokens/s it served the trace at); None when none meets the targets."""
    first = contenders[0]
    candidates = [replace(p.chosen, estimates=e) for p, e in zip(contenders, replayed)]
    won = choose(candidates, first.hardware, first.search.targets, first.search.settings)
    return next((p for p, c in zip(contenders, candidates) if c is won), None)


def _fitted_workload(search: Search, chosen: Candidate) -> tuple[Search, Candidate]:
    """max_model_len auto: the traffic resolved again once the length is (the chosen layout's), its default
    lengths fitted to it as to a max_model_len given, and the chosen layout estimated for that traffic; so
    the plan's service section is one that launch, and a plan made again from it, accept. NOTE: the layouts
    were compared on the traffic of the model's own length, the only one known before each is sized."""
    settings = chosen.settings
    if settings is None or not settings.is_max_model_len_auto:
        return search, chosen
    try:
        workload = resolve_workload(search.options, settings.max_model_len)
    except SettingError as e:
        raise SettingError(f"max_model_len auto is {settings.max_model_len} on {chosen.layout} (what its KV cache "
                           f"holds): {e}") from None
    if workload == search.workload:
        return search, chosen
    fitted = replace(search, workload=workload)
    return fitted, fitted.again(chosen)


def _pins(options: PlanOptions) -> dict[str, int]:
    return {name: getattr(options, name) for name in
            ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
            if getattr(options, name) is not None}


def _pinned_problem(candidates: list[Candidate], options: PlanOptions) -> str | None:
    """When the user pinned sizes and every layout they allow breaks a rule, say which."""
    pins = (options.tensor_parallel_size, options.pipeline_parallel_size,
            options.data_parallel_size, options.enable_expert_parallel)
    if not any(pins) or any(c.memory is not None for c in candidates):
        return None
    return candidates[0].problem if candidates else "no layout matches the pinned sizes"


def choose_executor(layout: Layout, hardware: Hardware, options: PlanOptions) -> str:
    """Rule 6: mp on one node, ray across nodes or inside a Ray cluster; the flag overrides."""
    spans = nodes_used(layout, hardware)
    ranks = layout.tensor_parallel_size * layout.pipeline_parallel_size
    if options.distributed_executor_backend == "uni" and ranks > 1:
        raise PlanError(f"distributed_executor_backend uni runs one rank in-process; {layout} has "
                        f"{ranks}: use mp or ray")
    if options.distributed_executor_backend == "mp" and spans > 1:
        raise PlanError(f"distributed_executor_backend mp runs on one node; {layout} spans "
                        f"{spans} nodes: use ray")
    if options.distributed_executor_backend:
        return options.distributed_executor_backend
    return "ray" if hardware.source == "ray" or spans > 1 else "mp"
