"""Say why: the rule that decided, the warnings, and why the other layouts lost."""

from __future__ import annotations

import math

from shardserve.planner.draft import DraftModel
from shardserve.planner.speculative import HEAD_METHODS
from shardserve.planner.hardware import GIB, Hardware
from shardserve.planner.model_source import ModelInfo
from shardserve.planner.options import RuntimeSettings
from shardserve.planner.rules import expert_parallel_problem, expert_parallel_reason, replica_spans_nodes
from shardserve.planner.search import Candidate, Search, estimates_of, tier
from shardserve.planner.speed import Estimates



def _rule_name(layout, hardware: Hardware) -> str:
    """The rule that prefers this layout's shape (search.tier's order)."""
    if layout.gpus_per_replica == 1:
        return "rule 1 (one GPU per replica)"
    if replica_spans_nodes(layout, hardware):
        return "rule 3 (tensor parallel = GPUs per node across nodes)"
    if hardware.interconnect == "pcie":
        return "rule 5 (pipeline rather than tensor parallel over PCIe)"
    return "rule 2 (tensor parallel inside an NVLink node)"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB / 2 else f"{nbytes / 2**20:.1f} MiB"


def rationale(search: Search, chosen: Candidate, candidates: list[Candidate], executor: str,
              weights: int, pins: dict[str, int] | None = None, recommend: bool = False) -> list[str]:
    """`pins`: the sizes the settings fixed; the layout is then theirs, not a rule's."""
    model, hardware, settings = search.model, search.hardware, chosen.settings
    spec, gpu, pp = model.spec, hardware.gpu, chosen.layout.pipeline_parallel_size
    assert settings is not None  # the chosen candidate is feasible
    usable = gpu.memory_bytes * settings.gpu_memory_utilization
    pool = settings.kv_cache_memory_bytes or 0  # resolve_settings always gives a CPU plan its pool
    offer = (f"host memory offers {_gib(usable)} per rank; KV cache pool {_gib(pool)}" if gpu.is_cpu else
             f"one {gpu.name} offers {_gib(usable)} at gpu_memory_utilization "
             f"{settings.gpu_memory_utilization}")
    lines = [f"weights: {_gib(weights)} in {settings.dtype}"
             + (f" ({spec.quantization.method})" if spec.quantization else "") + f"; {offer}"]
    lines.append(_objective(search, chosen, recommend))
    layout_pins = {k: v for k, v in (pins or {}).items() if k != "data_parallel_size"}
    if layout_pins:
        lines.append("layout pinned by the settings: "
                     + ", ".join(f"{k}={v}" for k, v in layout_pins.items()))
    else:
        lines += _layout_lines(search, chosen, candidates)
    if settings.max_num_seqs < search.settings.max_num_seqs:
        e = estimates_of(chosen)
        assert e.workload.concurrency is not None  # Search.batch_caps tries caps only at a concurrency
        lines.append(f"max_num_seqs {settings.max_num_seqs} (not {search.settings.max_num_seqs}): a replica runs "
                     f"at most {settings.max_num_seqs} of its {e.workload.concurrency / chosen.layout.data_parallel_size:g} "
                     f"requests at once, for TPOT {e.tpot_ms:.1f} ms; the rest queue (TTFT {e.ttft_ms:,.0f} ms)")
    budget = _token_budget_line(search, chosen)
    if budget:
        lines.append(budget)
    experts = _experts_line(model, chosen, search.options.enable_expert_parallel, candidates)
    if experts:
        lines.append(experts)
    if pp > 1:
        lines.append(f"rule 7: layers per stage {list(chosen.split)}: the first stage holds "
                     "the embedding, the last the final norm and LM head")
    lines.append(f"rule 6: executor {executor} ("
                 + ("one node" if executor == "mp" else
                    "several nodes" if hardware.source != "ray" else "inside a Ray cluster")
                 + ")")
    if spec.mla:
        lines.append(f"multi-head latent attention: a token caches {spec.mla.cache_width} values per layer "
                     f"(kv_lora_rank {spec.mla.kv_lora_rank} + qk_rope_head_dim {spec.mla.qk_rope_head_dim}), "
                     "whole on every tensor-parallel rank: tensor parallel splits the heads, not the KV cache")
    return lines + _kv_cache_lines(chosen.memory, settings, spec.max_context_len)


def _token_budget_line(search: Search, chosen: Candidate) -> str | None:
    """Why the step budget is not the settings' one (only the targets' search changes it)."""
    assert chosen.settings is not None and chosen.memory is not None  # the chosen candidate is feasible
    own, ours = search.settings.max_num_batched_tokens, chosen.settings.max_num_batched_tokens
    if own == ours:
        return None
    e, w = estimates_of(chosen), search.workload
    why = (f"a {w.input_len:,}-token prompt prefills in {-(-(w.input_len - w.prefix_len) // ours)} step(s), for TTFT "
           f"{e.ttft_ms:,.0f} ms" if ours > own else
           f"smaller activations leave the KV cache {chosen.memory.kv_tokens(chosen.settings.max_model_len):,} tokens, for "
           f"{e.output_tokens_per_s_per_gpu:,.0f} output tokens/s per GPU")
    return f"max_num_batched_tokens {ours} (not {own}): {why}"


def _objective(search: Search, chosen: Candidate, recommend: bool) -> str:
    w, e = search.workload, estimates_of(chosen)
    if search.targets.is_set:
        head = (f"recommend: {search.hardware.describe()} is the least {search.hardware.gpu.name} hardware "
                "that meets the targets; " if recommend else "")
        return (f"{head}targets: {search.targets.describe()} at p{w.percentile} for {e.workload.describe()}: the fewest GPUs "
                f"that meet them ({chosen.layout.num_gpus}), then the most output tokens/s per GPU")
    return (f"objective: the most output tokens/s for {e.workload.describe()} with every "
            f"{search.hardware.gpu.unit} busy (no --ttft-ms/--tpot-ms targets given)")


def _layout_lines(search: Search, chosen: Candidate, candidates: list[Candidate]) -> list[str]:
    """The rule behind the layout's shape, and when speed overrode the rules' preference, by how much."""
    hardware, layout, gpu = search.hardware, chosen.layout, search.hardware.gpu
    tp, pp, dp = layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.data_parallel_size
    lines = []
    one_gpu = next((c for c in candidates if c.layout.gpus_per_replica == 1), None)
    if layout.gpus_per_replica == 1:
        lines.append(f"rule 1: the model fits on one {'rank' if gpu.is_cpu else 'GPU'} with room for KV cache"
                     + (f"; {dp} replicas (data parallel)" if dp > 1 else ""))
    else:
        if one_gpu is not None and one_gpu.problem:
            lines.append(f"one {gpu.unit} is not enough: {one_gpu.problem}")
        if replica_spans_nodes(layout, hardware):
            lines.append(f"rule 3: too big for one node; tensor parallel {tp} = GPUs per node, pipeline "
                         f"parallel {pp} across nodes" if tp == hardware.gpus_per_node else
                         f"rule 4: tensor parallel {hardware.gpus_per_node} is not possible, so tensor "
                         f"parallel {tp} with {pp} pipeline stages")
        elif hardware.interconnect == "pcie" and tp == 1:
            lines.append(f"rule 5: no NVLink between {gpu.name} GPUs, so pipeline parallel {pp} rather than "
                         "tensor parallel")
        elif pp == 1:
            lines.append(f"rule 2: tensor parallel {tp} inside a node" + (f", {dp} replicas" if dp > 1 else ""))
        else:
            lines.append(f"rule 4: no tensor-parallel size uses every GPU ({_tp_blocker(candidates, tp)}), so "
                         f"pipeline parallel {pp} with an uneven split rather than idle GPUs")
    overridden = _overridden(search, chosen, candidates)
    if overridden:
        lines.append(overridden)
    return lines


def _overridden(search: Search, chosen: Candidate, candidates: list[Candidate]) -> str | None:
    """When a rule preferred another shape and the estimates chose this one: say by how much."""
    if search.targets.is_set:
        return None
    hardware = search.hardware
    rivals = [c for c in candidates if c.is_feasible and c.layout.num_gpus == chosen.layout.num_gpus
              and tier(c.layout, hardware) < tier(chosen.layout, hardware)]
    if not rivals:
        return None
    best = max(rivals, key=lambda c: estimates_of(c).output_tokens_per_s)
    ours, theirs = estimates_of(chosen).output_tokens_per_s, estimates_of(best).output_tokens_per_s
    return (f"{_rule_name(best.layout, hardware)} prefers {best.layout}, but this layout "
            f"is estimated {ours / theirs:.1f}x as fast ({ours:,.0f} vs {theirs:,.0f} output tok/s)")


def _window_note(mem, length: int) -> str:
    """How windowed layers shrink a request's blocks (planner/kv_groups.py), or nothing without them."""
    if not mem.has_windows:
        return ""
    if len(mem.windows) == 1:
        return (f" (every layer attends over {mem.windows[0]} tokens: a request holds at most "
                f"{mem.blocks_per_request(length)} blocks)")
    kinds = ", ".join(f"{mem.windows.count(w)} of {'full attention' if w is None else f'a {w}-token window'}"
                      for w in dict.fromkeys(mem.windows))
    return (f" (a block table per group of layers, {kinds}: the windowed ones hold only their window, so a request "
            f"holds at most {mem.blocks_per_request(length)} blocks across the groups)")


def _kv_cache_lines(mem, settings: RuntimeSettings, model_limit: int) -> list[str]:
    length = settings.max_model_len
    lines = [f"KV cache: {mem.kv_tokens(length)} tokens per replica, {mem.max_concurrency(length):.2f}x requests "
             f"of {length} tokens" + _window_note(mem, length)]
    if mem.num_offload_blocks:
        lines.append(f"CPU tier (kv_offloading_size {settings.kv_offloading_size:g} GiB): {mem.offload_tokens} "
                     f"tokens per replica in {mem.offload_bytes / 2**30:.2f} GiB of host memory; full prefix "
                     "blocks evicted from the KV cache wait there, and a prompt sharing them loads them back "
                     "instead of computing them")
    if settings.enable_lora:
        lora = mem.tightest.lora_bytes
        lines.append(f"LoRA: {settings.max_loras} adapter slot(s) of rank up to {settings.max_lora_rank} take "
                     f"{lora / 2**20:.1f} MiB per GPU of the tightest stage before the KV cache; a batch serves at "
                     f"most {settings.max_loras} adapters (others wait for a slot), and decode runs without CUDA "
                     "graphs")
    if settings.is_max_model_len_auto:
        lines.append(f"max_model_len auto: {length}, the longest for which target_concurrency requests fit "
                     f"the KV cache (the model's limit: {model_limit})")
    return lines


def _experts_line(model: ModelInfo, chosen: Candidate, forced: bool | None,
                  candidates: list[Candidate]) -> str | None:
    """Rule 8, for a mixture of experts over tensor-parallel ranks: whole experts per rank or every
    expert split, and why."""
    spec, tp = model.spec, chosen.layout.tensor_parallel_size
    if not spec.is_moe or tp == 1:
        return None
    assert spec.num_experts and spec.moe_intermediate_size is not None  # a mixture of experts has both
    whole = (f"expert parallel: {spec.num_experts // tp} of the {spec.num_experts} experts whole on each "
             "rank, attention tensor parallel")
    split = f"experts split by tensor parallel ({spec.moe_intermediate_size // tp} features per expert and rank)"
    if forced is not None:
        return f"rule 8: {whole if chosen.expert_parallel else split}, as enable_expert_parallel={forced} asks"
    if not chosen.is_rule8_choice:
        twin = next((c for c in candidates if c.layout == chosen.layout and c.is_rule8_choice), None)
        would = "split the experts" if chosen.expert_parallel else "keep experts whole"
        if twin is None or not twin.is_feasible:
            return f"rule 8 would {would}, but {twin.problem if twin else 'that cannot run here'}"
        ratio = estimates_of(chosen).output_tokens_per_s / estimates_of(twin).output_tokens_per_s
        return (f"rule 8 would {would}, but {whole if chosen.expert_parallel else split} is estimated "
                f"{ratio:.2f}x as fast")
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
    out = ([model.note] if model.note else []) + list(hardware.notes)
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
    overload = _overload_line(chosen, hardware)
    if overload:
        out.append(overload)
    e = estimates_of(chosen)
    if e.is_api_bound and not e.is_overloaded:
        out.append(f"the API process bounds the output at {e.output_tokens_per_s:,.0f} tokens/s ("
                   f"{e.api_max_request_rate:.3g} req/s of {e.workload.output_len:,} streamed tokens): one process "
                   "serves every replica (`shardserve calibrate` measures its CPU time a request and a token here)")
    return out


def _overload_line(chosen: Candidate, hardware: Hardware) -> str | None:
    """How the load outruns the chosen layout and, at a request rate, how many replicas would keep up."""
    e, layout = estimates_of(chosen), chosen.layout
    said, rate = e.overload(), e.workload.request_rate
    if said is None or rate is None or e.max_request_rate <= 0:
        return said
    if rate > e.api_max_request_rate:
        return (f"{said}: one API process serves every replica, so no number of them keeps up "
                "(`shardserve calibrate` measures its CPU time a request and a token on this host)")
    # (a plan is overloaded only without targets: max_request_rate is then the rate before overload)
    replicas = math.ceil(rate / (e.max_request_rate / layout.data_parallel_size))
    line = (f"{said}: {replicas} replicas of tp {layout.tensor_parallel_size} x pp {layout.pipeline_parallel_size} "
            f"({replicas * layout.gpus_per_replica} {hardware.gpu.unit}s) would keep up")
    return line if hardware.is_cpu else line + "; --recommend with --ttft-ms/--tpot-ms plans for a latency too"


def speculation_note(settings: RuntimeSettings, est: Estimates, without: Estimates, hardware: Hardware,
                     draft: DraftModel | None = None, tp: int = 1) -> tuple[str, str | None]:
    """(a rationale line: what speculative decoding does to the chosen layout's TPOT and throughput, a warning
    when it makes them worse) at the plan's draft_acceptance_rate."""
    spec, rate = settings.speculative, settings.draft_acceptance_rate
    assert spec is not None and rate is not None  # the caller's check
    k = spec.num_speculative_tokens
    drafter = "" if draft is None else (
        f"; {draft.name} takes {_gib(draft.weights_bytes(tp, settings.dtype))} a "
        f"{hardware.gpu.unit} and "
        f"{draft.kv_bytes_per_token(tp, settings.kv_dtype_bytes):,} KV bytes a token beside the model's")
    line = (f"speculative decoding ({spec.method}, {k} drafts at acceptance {rate:g}: "
            f"{settings.tokens_per_step:.2f} tokens per forward): TPOT {est.tpot_ms:,.1f} ms against "
            f"{without.tpot_ms:,.1f} ms without, {est.output_tokens_per_s:,.0f} output tokens/s against "
            f"{without.output_tokens_per_s:,.0f}{drafter}")
    if est.tpot_ms <= without.tpot_ms and est.output_tokens_per_s >= 0.99 * without.output_tokens_per_s:
        return line, None
    eager = ""
    if not hardware.is_cpu and spec.method in HEAD_METHODS and not settings.enforce_eager:
        eager = f"every step runs without CUDA graphs, as {draft.name if draft else 'its head'} reads each step's " \
            "hidden states, "
    elif not hardware.is_cpu and settings.graphs_captured:
        eager = "a step that verifies drafts runs without CUDA graphs, its kernels issued one by one, "
    eager += f"{draft.name} runs eagerly, a forward a draft, " if draft is not None else ""
    return line, (f"speculative_config makes this plan slower ({eager}and each draft adds a row to every "
                  f"projection): drop --speculative-config, or raise --draft-acceptance-rate if your "
                  f"traffic's measured rate is higher")
