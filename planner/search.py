"""Evaluate every layout the hardware allows for the workload, and choose by the targets or by speed."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardserve.planner.draft import DraftModel
from shardserve.planner.hardware import Hardware
from shardserve.planner.memory import MemoryPlan, plan_memory
from shardserve.planner.model_source import ModelInfo
from shardserve.planner.options import PlanOptions, RuntimeSettings
from shardserve.planner.rules import (Layout, expert_parallel_problem, expert_parallel_reason, max_replicas,
                                      offload_size_problem, placement_problem, replica_spans_nodes,
                                      tensor_parallel_problem)
from shardserve.planner.serving import Replica
from shardserve.planner.speed import Estimates, estimate, replica_model
from shardserve.planner.workload import Targets, Workload

# NOTE: the rules' preferred shapes (one GPU per replica, tensor parallel inside an NVLink node,
# pipeline over PCIe, tp = GPUs per node across nodes) win unless another layout is estimated
# this much faster: a preference is an input to the comparison, never an override of it.
PREFERENCE_MARGIN = 0.9
BATCH_CAPS = (8, 16, 32, 64, 128)  # max_num_seqs tried below the setting's when targets ask for it
# max_num_batched_tokens tried beside the setting's when targets ask for it and nothing pins it: a
# smaller step leaves more memory to the KV cache, a larger one prefills a long prompt in fewer steps
TOKEN_BUDGETS = (2048, 4096, 8192, 16384, 32768)
DEPARTURE_DISCOUNT = 0.05


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    problem: str | None  # why it cannot run; None when it can
    split: tuple[int, ...] = ()
    memory: MemoryPlan | None = None
    estimates: Estimates | None = None
    expert_parallel: bool = False  # MoE: whole experts per tp rank
    settings: RuntimeSettings | None = None  # with max_model_len auto, this layout's longest
    is_rule8_choice: bool = True  # experts dealt out as rule 8 (or enable_expert_parallel) says

    @property
    def is_feasible(self) -> bool:
        return self.problem is None


def estimates_of(c: Candidate) -> Estimates:
    """A feasible candidate's estimates: Search.with_replicas gives every one its own."""
    assert c.estimates is not None, f"{c.layout} has no estimates: {c.problem}"
    return c.estimates


@dataclass(frozen=True)
class Search:
    """One planning question: the model on the hardware, for a workload, within targets."""
    model: ModelInfo
    hardware: Hardware
    options: PlanOptions
    settings: RuntimeSettings
    workload: Workload
    targets: Targets
    layer_split: tuple[int, ...] | None = None  # pinned layers per stage (a plan edited by hand); None: balanced
    draft: DraftModel | None = None  # speculative_config's draft model (method draft_model)

    def candidates(self) -> list[Candidate]:
        out = []
        for search in self.token_budgets():
            for tp, pp, dps in candidate_shapes(self.model, self.hardware, self.options, self.targets.is_set):
                for ep in expert_parallel_choices(self.model, tp, self.options):
                    shape = search.shape(tp, pp, expert_parallel=ep)
                    for dp in dps:
                        out += [search.with_replicas(shape, dp, cap) for cap in search.batch_caps(dp)]
        return out

    def token_budgets(self) -> list[Search]:
        """This search, then (with targets, max_num_batched_tokens not pinned) one per other step
        budget of TOKEN_BUDGETS that holds max_num_seqs."""
        if not self.targets.is_set or self.options.max_num_batched_tokens is not None:
            return [self]
        own, seqs = self.settings.max_num_batched_tokens, self.settings.max_num_seqs
        return [self] + [self.with_settings(max_num_batched_tokens=t)
                         for t in TOKEN_BUDGETS if t != own and t >= seqs]

    def with_settings(self, **changes) -> Search:
        return replace(self, settings=replace(self.settings, **changes))

    def batch_caps(self, dp: int) -> list[int]:
        """max_num_seqs values to try: the setting's, and with targets under a closed loop every
        smaller cap below the replica's concurrency (fewer running, faster tokens, the rest queue)."""
        top, w = self.settings.max_num_seqs, self.workload
        if not self.targets.is_set or w.concurrency is None:
            return [top]
        return [top] + [cap for cap in BATCH_CAPS if cap < top and cap < w.concurrency / dp]

    def exact(self, chosen: Candidate) -> Candidate:
        """The chosen candidate with its memory planned at its own max_num_seqs (the CUDA graphs it
        keeps) and step budget, so the plan's KV cache is the one the engine will size."""
        if chosen.settings is None or chosen.settings.max_num_seqs == self.settings.max_num_seqs:
            return chosen
        return self.again(chosen)

    def again(self, chosen: Candidate) -> Candidate:
        """The chosen layout sized and estimated by this search (its workload) at the chosen max_num_seqs
        and step budget."""
        assert chosen.settings is not None  # a feasible candidate's
        search = self.with_settings(max_num_seqs=chosen.settings.max_num_seqs,
                                    max_num_batched_tokens=chosen.settings.max_num_batched_tokens)
        layout = chosen.layout
        shape = search.shape(layout.tensor_parallel_size, layout.pipeline_parallel_size,
                             expert_parallel=chosen.expert_parallel)
        return search.with_replicas(shape, layout.data_parallel_size)

    def shape(self, tp: int, pp: int, with_rate: bool = True,
              expert_parallel: bool | None = None) -> tuple[Candidate, Replica | None, float]:
        """One replica of tp x pp (whole experts per rank or not; default: the options' or rule 8's
        choice): its memory, its speed model and the rate it serves within the targets (0 unless
        `with_rate`)."""
        model, spec, settings = self.model, self.model.spec, self.settings
        layout = Layout(tp, pp, 1)
        rule8_ep = uses_expert_parallel(model, tp, self.options)
        ep = rule8_ep if expert_parallel is None else expert_parallel
        problem = (tensor_parallel_problem(spec, tp, ep) or placement_problem(layout, spec, self.hardware)
                   or (self.draft.problem(tp, pp, settings.kv_offloading_size) if self.draft is not None else None))
        rule8 = ep == rule8_ep
        if problem:
            return Candidate(layout, problem, expert_parallel=ep, is_rule8_choice=rule8), None, 0.0
        sharded = model.sharded(tp, settings.dtype, pp, ep)
        split = list(self.layer_split) if self.layer_split is not None else sharded.split(pp)
        if len(split) != pp:
            return Candidate(layout, f"layer_split {split} has {len(split)} stages, not {pp}", expert_parallel=ep,
                             is_rule8_choice=rule8), None, 0.0
        draft = (0, 0) if self.draft is None else (self.draft.weights_bytes(tp, settings.dtype),
                                                   self.draft.kv_bytes_per_token(tp, settings.kv_dtype_bytes))
        memory = plan_memory(spec, sharded.stage_bytes(split), split, tp, self.hardware.gpu, settings, ep, draft)
        if settings.is_max_model_len_auto:  # this layout's own longest; the model's limit if none fits
            fitting = memory.longest_fitting_len(spec.max_context_len, self.options.target_concurrency)
            settings = replace(settings, max_model_len=fitting or settings.max_model_len)
        problem = _memory_problem(memory, settings, self.options, self.hardware, tp * pp)
        replica = replica_model(spec, split, tp, ep, self.hardware, settings, memory.kv_cache_tokens, self.draft)
        rate = replica.max_request_rate(self.workload.per_replica(1), self._meets) if with_rate else 0.0
        return Candidate(layout, problem, tuple(split), memory, None, ep, settings, rule8), replica, rate

    def _meets(self, speed) -> bool:
        return not self.targets.misses(speed.ttft_ms, speed.tpot_ms)

    def with_replicas(self, shape: tuple[Candidate, Replica | None, float], dp: int,
                      max_num_seqs: int | None = None) -> Candidate:
        """The shape with dp replicas; `max_num_seqs` below the settings' caps each replica's batch."""
        base, replica, rate = shape
        layout = Layout(base.layout.tensor_parallel_size, base.layout.pipeline_parallel_size, dp)
        placement = placement_problem(layout, self.model.spec, self.hardware)
        if placement:  # this many replicas cannot be placed at all: no memory to speak of
            return Candidate(layout, placement, expert_parallel=base.expert_parallel,
                             is_rule8_choice=base.is_rule8_choice)
        if replica is None or base.problem:
            return replace(base, layout=layout)
        assert base.settings is not None  # Search.shape sets them on every shape it sizes
        if max_num_seqs is not None and max_num_seqs != replica.max_num_seqs:
            replica = replace(replica, max_num_seqs=max_num_seqs)
            base = replace(base, settings=replace(base.settings, max_num_seqs=max_num_seqs))
            rate = replica.max_request_rate(self.workload.per_replica(1), self._meets)
        est = estimate(replica, self.workload, self.targets, dp, layout.num_gpus, rate)
        return replace(base, layout=layout, estimates=est)


def _memory_problem(memory: MemoryPlan, settings: RuntimeSettings, options: PlanOptions,
                    hardware: Hardware, num_ranks: int) -> str | None:
    if settings.kv_offloading_size and not memory.num_offload_blocks:  # (replicated KV heads, an uneven split)
        rank_block = max(s.kv_bytes_per_token for s in memory.stages) * memory.block_size
        return offload_size_problem(settings.kv_offloading_size, rank_block, num_ranks)
    needed = memory.blocks_per_request(settings.max_model_len) * options.target_concurrency
    if memory.tightest.kv_budget_bytes <= 0:
        t = memory.tightest
        state = (f" + recurrent state {t.recurrent_state_bytes / 2**30:.1f} GiB (max_num_seqs {settings.max_num_seqs})"
                 if t.recurrent_state_bytes else "")
        return (f"weights {t.weights_bytes / 2**30:.1f} GiB + activations and overhead "
                f"{(t.activation_bytes + t.overhead_bytes) / 2**30:.1f} GiB{state} exceed "
                f"{t.total_bytes * settings.gpu_memory_utilization / 2**30:.1f} GiB per {hardware.gpu.unit}")
    if memory.num_blocks < needed and memory.has_windows:
        return (f"KV cache holds {memory.num_blocks} blocks of {memory.block_size} tokens; {needed} needed for "
                f"{options.target_concurrency} request(s) of {settings.max_model_len} (windowed layers hold their "
                "window)")
    if memory.num_blocks < needed:
        return (f"KV cache holds {memory.kv_cache_tokens} tokens; {needed * memory.block_size} needed for "
                f"{options.target_concurrency} request(s) of {settings.max_model_len}")
    return None


def uses_expert_parallel(model: ModelInfo, tp: int, options: PlanOptions) -> bool:
    """As enable_expert_parallel forces it, else where expert_parallel_reason finds whole experts better."""
    if options.enable_expert_parallel is not None:
        return options.enable_expert_parallel
    return expert_parallel_reason(model.spec, tp) is not None


def expert_parallel_choices(model: ModelInfo, tp: int, options: PlanOptions) -> list[bool]:
    """Whole experts per rank, split experts, or both where both can run and nothing pins it: the
    search then weighs them by speed, rule 8's choice first."""
    preferred = uses_expert_parallel(model, tp, options)
    spec = model.spec
    if options.enable_expert_parallel is not None or not spec.is_moe or tp == 1:
        return [preferred]
    other = not preferred
    if tensor_parallel_problem(spec, tp, other) or (other and expert_parallel_problem(spec, tp)):
        return [preferred]
    return [preferred, other]


def candidate_shapes(model: ModelInfo, hardware: Hardware, options: PlanOptions,
                     any_replicas: bool) -> list[tuple[int, int, list[int]]]:
    """Every (tp, pp) the pins allow, with the replica counts to try: as many as fit (or the pinned
    dp), or, with targets, every count from 1 so the fewest GPUs can win."""
    tps = ([options.tensor_parallel_size] if options.tensor_parallel_size
           else range(1, hardware.gpus_per_node + 1))
    out = []
    for tp in tps:
        max_pp = max(1, min(model.spec.num_layers, hardware.total_gpus // tp))
        pps = ([options.pipeline_parallel_size] if options.pipeline_parallel_size
               else range(1, max_pp + 1))
        for pp in pps:
            most = max(1, max_replicas(tp, pp, hardware))
            dps = ([options.data_parallel_size] if options.data_parallel_size
                   else list(range(1, most + 1)) if any_replicas else [most])
            out.append((tp, pp, dps))
    return out


def tier(layout: Layout, hardware: Hardware) -> int:
    """Rules 1, 2, 3 and 5 as a preference: lower is preferred."""
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    if layout.gpus_per_replica == 1:
        return 0  # rule 1: one GPU per replica
    if replica_spans_nodes(layout, hardware):
        return 3 if tp == hardware.gpus_per_node else 4  # rule 3: tp = GPUs per node
    if hardware.interconnect == "pcie":
        return 1 if tp == 1 else 2  # rule 5: pipeline over PCIe
    return 1 if pp == 1 else 2  # rule 2: tensor parallel inside a node


def preference(c: Candidate, hardware: Hardware) -> tuple[int, int]:
    """The rules' preference for a candidate (lower first): its shape's tier, then whether it deals
    out experts as rule 8 (or the setting) would."""
    return tier(c.layout, hardware), 0 if c.is_rule8_choice else 1


def rank_key(c: Candidate, hardware: Hardware):
    """Fewest idle GPUs, then the most output tokens/s (the order alternatives are listed in)."""
    idle = hardware.total_gpus - c.layout.num_gpus
    assert c.memory is not None  # only feasible candidates are ranked; each has its memory
    return (idle, -estimates_of(c).output_tokens_per_s, preference(c, hardware),
            -c.memory.kv_cache_tokens, c.layout)


def departures(c: Candidate, base: RuntimeSettings) -> int:
    """How many of max_num_seqs and max_num_batched_tokens the candidate changes from `base`."""
    if c.settings is None:
        return 0
    return sum(getattr(c.settings, name) != getattr(base, name) for name in ("max_num_seqs", "max_num_batched_tokens"))


def choose(candidates: list[Candidate], hardware: Hardware, targets: Targets,
           base: RuntimeSettings) -> Candidate | None:
    """With targets: the fewest GPUs that meet them, then the most output tokens/s per GPU (the
    batching of `base`, the settings asked for, unless another is clearly faster), then the most headroom.
    Without: one GPU per replica when the model fits one (rule 1), else every GPU busy (rule 4)
    and the most output tokens/s: of the layouts within PREFERENCE_MARGIN of the fastest, the one
    the rules prefer."""
    feasible = [c for c in candidates if c.is_feasible]
    if targets.is_set:
        meeting = [c for c in feasible if estimates_of(c).meets(targets)]
        # NOTE: at a fixed rate every layout that keeps up serves the same tokens/s; the settings'
        # own batching, then the most headroom (the highest rate it holds within the targets) wins then.
        # Another max_num_seqs or step budget must be DEPARTURE_DISCOUNT faster per change to win.
        return min(meeting, default=None, key=lambda c: (
            c.layout.num_gpus, -round(estimates_of(c).output_tokens_per_s_per_gpu * (1 - DEPARTURE_DISCOUNT) **
                                      departures(c, base), 3),
            departures(c, base), -estimates_of(c).max_request_rate, preference(c, hardware), c.layout))
    if not feasible:
        return None
    single = [c for c in feasible if c.layout.gpus_per_replica == 1]
    feasible = single or feasible  # rule 1: one GPU per replica when the model fits one
    fewest_idle = min(hardware.total_gpus - c.layout.num_gpus for c in feasible)
    pool = [c for c in feasible if hardware.total_gpus - c.layout.num_gpus == fewest_idle]
    fastest = min(pool, key=lambda c: rank_key(c, hardware))
    close = [c for c in pool
             if estimates_of(c).output_tokens_per_s >= PREFERENCE_MARGIN * estimates_of(fastest).output_tokens_per_s]
    return min(close, key=lambda c: (preference(c, hardware), rank_key(c, hardware)))


def pareto_front(candidates: list[Candidate]) -> list[Candidate]:
    """Runnable layouts no other beats on both output tokens/s per GPU and per user."""
    runnable = [c for c in candidates if c.is_feasible and not estimates_of(c).is_overloaded]

    def beats(a: Candidate, b: Candidate) -> bool:
        ea, eb = estimates_of(a), estimates_of(b)
        return (ea.output_tokens_per_s_per_gpu >= eb.output_tokens_per_s_per_gpu and
                ea.output_tokens_per_s_per_user >= eb.output_tokens_per_s_per_user and
                (ea.output_tokens_per_s_per_gpu, ea.output_tokens_per_s_per_user) !=
                (eb.output_tokens_per_s_per_gpu, eb.output_tokens_per_s_per_user))
    return [c for c in runnable if not any(beats(o, c) for o in runnable)]
