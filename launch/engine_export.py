"""A plan as the equivalent `vllm serve` or SGLang launch command, naming what the engine cannot take.

`export_plan(plan, "vllm" | "sglang")` maps every runtime and parallel setting of a `PlanFile` to the
other engine's flag: the plan's decisions (parallel sizes, max_model_len, max_num_seqs,
max_num_batched_tokens) always, the rest only where they differ from the engine's default. The
service's traffic is no engine setting. What the engine cannot take (a latency target included) is
listed in `unsupported`, what it takes with another meaning in `notes`:

    # how to run it (multi-node only)
    ENV=VALUE program \\
        --flag value \\
        --switch
    # no equivalent: <setting> (<why>)
    # note: <difference in meaning>
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass, field

from shardserve.planner.plan_file import PlanFile
from shardserve.planner.served import ARCHITECTURES
from shardserve.planner.speculative import SpeculativeConfig

ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
ENGINES = tuple(ENGINE_NAMES)
VLLM_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)  # vLLM's CacheConfig.block_size choices
VLLM_DEFAULT_BLOCK_SIZE = 16  # on CUDA
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
SGLANG_DEFAULT_PAGE_SIZE = 1
SGLANG_KV_CACHE_DTYPES = {"fp8": "fp8_e4m3"}  # SGLang takes no bare "fp8"
RAY_PORT = 6379  # `ray start --head`'s default
SGLANG_DIST_PORT = 50000  # any free port on node 0 (SGLang's multi-node example uses 50000)
HEAD_IP = "HEAD_IP"  # stands for node 0's address when the plan names no node IPs
# the served mixture-of-experts architectures: vLLM couples their replicas
MOE_ARCHITECTURES = tuple(arch for arch, served in ARCHITECTURES.items() if served.has_experts)
LATENCY_TARGETS = ("ttft_ms", "tpot_ms")  # the service's targets: no engine takes one
# the traffic the plan is sized for: a description of the load, no engine setting
TRAFFIC = ("input_len", "output_len", "prefix_len", "concurrency", "request_rate", "target_percentile")
# every parallel, runtime and service setting this export handles; one missing here is named, never dropped
HANDLED_SETTINGS = frozenset({
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "layer_split",
    "distributed_executor_backend", "enable_expert_parallel",
    "device", "dtype", "quantization", "kv_cache_dtype", "max_model_len", "gpu_memory_utilization",
    "max_num_seqs", "max_num_batched_tokens", "block_size", "enable_prefix_caching",
    "kv_cache_memory_bytes", "enforce_eager", "kv_offloading_size", "enable_lora", "max_loras", "max_lora_rank",
    "speculative_config", "draft_acceptance_rate", *LATENCY_TARGETS, *TRAFFIC,
})


@dataclass(frozen=True)
class EngineCommand:
    """One engine's launch command for a plan, and what of the plan it cannot take as meant."""

    engine: str  # "vllm" or "sglang"
    program: tuple[str, ...]  # ("vllm", "serve", MODEL) or ("python", "-m", "sglang.launch_server")
    flags: tuple[tuple[str, str | None], ...]  # (flag, value); value None for a switch
    env: tuple[tuple[str, str], ...] = ()  # variables set in front of the command
    how_to_run: tuple[str, ...] = ()  # comment lines before the command (several nodes)
    notes: tuple[str, ...] = ()  # flags the engine takes with another meaning; an overloaded plan
    unsupported: tuple[str, ...] = ()  # "<setting> (<why>)": what the engine cannot take

    @property
    def args(self) -> list[str]:
        """The command's argv (without the env prefix)."""
        words = list(self.program)
        for flag, value in self.flags:
            words += [flag] if value is None else [flag, value]
        return words

    @property
    def options(self) -> dict[str, str | None]:
        return dict(self.flags)

    def render(self) -> str:
        """Shell text: the command one flag a line (` \\` continued), then the comment lines."""
        first = [f"{name}={shlex.quote(value)}" for name, value in self.env]
        first += [shlex.quote(word) for word in self.program]
        lines = [" ".join(first)]
        for flag, value in self.flags:
            lines.append("    " + flag + ("" if value is None else " " + shlex.quote(value)))
        return "\n".join([*(f"# {line}" for line in self.how_to_run), " \\\n".join(lines),
                          *(f"# no equivalent: {line}" for line in self.unsupported),
                          *(f"# note: {line}" for line in self.notes)])


@dataclass
class _Draft:
    """An EngineCommand being built."""

    flags: list[tuple[str, str | None]] = field(default_factory=list)
    env: list[tuple[str, str]] = field(default_factory=list)
    how_to_run: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)

    def add(self, flag: str, value: object = None) -> None:
        self.flags.append((flag, None if value is None else str(value)))

    def done(self, engine: str, program: tuple[str, ...]) -> EngineCommand:
        return EngineCommand(engine, program, tuple(self.flags), tuple(self.env), tuple(self.how_to_run),
                             tuple(self.notes), tuple(self.unsupported))


def export_plan(plan: PlanFile, engine: str) -> EngineCommand:
    """The command that serves `plan` on `engine` (vllm or sglang), flag for flag."""
    draft = _Draft()
    if engine == "vllm":
        _hub_flags(plan, draft)
        _vllm_parallel(plan, draft)
        _vllm_runtime(plan, draft)
        program: tuple[str, ...] = ("vllm", "serve", plan.model_source)
    elif engine == "sglang":
        draft.add("--model-path", plan.model_source)
        _hub_flags(plan, draft)
        _sglang_parallel(plan, draft)
        _sglang_runtime(plan, draft)
        program = ("python", "-m", "sglang.launch_server")
    else:
        raise ValueError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
    _speculation(plan, draft, engine)
    draft.unsupported += _latency_targets(plan, ENGINE_NAMES[engine]) + _unhandled(plan)
    draft.notes += _overload(plan)
    return draft.done(engine, program)


def _overload(plan: PlanFile) -> list[str]:
    """An overloaded plan (TTFT unbounded): the engine would serve it no better, so the command says so."""
    est, rate = plan.estimates, plan.estimates.workload.request_rate
    if est.ttft_ms is not None or rate is None:
        return []
    return [f"the plan's {rate:g} req/s outrun this layout, which holds {est.max_request_rate:g} req/s before "
            "overload: requests queue without end (`shardserve plan` says how many replicas would keep up)"]


def _hub_flags(plan: PlanFile, draft: _Draft) -> None:
    """Where a Hub id is fetched, as the plan was made: both engines take --revision and --download-dir.
    Never the token: the engine reads HF_TOKEN itself, and a command line is no place for a secret."""
    if plan.model.revision is not None:
        draft.add("--revision", plan.model.revision)
    if plan.model.download_dir is not None:
        draft.add("--download-dir", plan.model.download_dir)


def _speculation(plan: PlanFile, draft: _Draft, engine: str) -> None:
    """speculative_config: vLLM takes the same JSON; SGLang's NGRAM is its own proposer (a cache of every request's
    tokens, drafts as a tree), given the same number of drafts and lookup lengths; a draft model is its STANDALONE
    algorithm, an EAGLE-3 head its EAGLE3 and DeepSeek's MTP layer its EAGLE (their draft tokens count the one
    verified first)."""
    config = SpeculativeConfig.parse(plan.runtime.speculative_config)
    if config is None:
        return
    if engine == "vllm":
        draft.add("--speculative-config", config.to_json())
    elif config.method != "ngram":  # a draft model, head or MTP layer drafting a chain, with top-k 1
        draft.add("--speculative-algorithm", {"eagle3": "EAGLE3", "mtp": "EAGLE"}.get(config.method, "STANDALONE"))
        if config.model is not None:  # (SGLang reads DeepSeek's MTP layer from the model's own folder)
            draft.add("--speculative-draft-model-path", config.model)
        draft.add("--speculative-num-steps", config.num_speculative_tokens)
        draft.add("--speculative-eagle-topk", 1)
        draft.add("--speculative-num-draft-tokens", config.num_speculative_tokens + 1)
    else:
        draft.add("--speculative-algorithm", "NGRAM")
        draft.add("--speculative-num-draft-tokens", config.num_speculative_tokens)
        draft.add("--speculative-ngram-min-match-window-size", config.prompt_lookup_min)
        draft.add("--speculative-ngram-max-match-window-size", config.prompt_lookup_max)
        draft.notes.append("SGLang's NGRAM drafts from a cache of every request's tokens, as a tree, not by prompt "
                           "lookup alone: its acceptance differs from the plan's")
    if plan.service.draft_acceptance_rate is not None:
        draft.notes.append(f"the plan's speeds assume draft_acceptance_rate {plan.service.draft_acceptance_rate:g}: "
                           f"compare {ENGINE_NAMES[engine]}'s spec-decode metrics")


def _latency_targets(plan: PlanFile, engine: str) -> list[str]:
    service = plan.service
    return [f"{name}={getattr(service, name):g} at p{service.target_percentile} (the layout was chosen to "
            f"meet it; {engine} takes no latency target: watch its own latency metrics)"
            for name in LATENCY_TARGETS if getattr(service, name) is not None]


def _unhandled(plan: PlanFile) -> list[str]:
    """Plan settings this export does not know (added to the plan after it was written)."""
    return [f"{f.name}={getattr(section, f.name)!r} (a setting this export does not map yet)"
            for section in (plan.parallel, plan.runtime, plan.service) for f in dataclasses.fields(section)
            if f.name not in HANDLED_SETTINGS]


def _layer_partition(plan: PlanFile) -> str:
    return ",".join(str(n) for n in plan.parallel.layer_split)


def _head(plan: PlanFile) -> str:
    return plan.hardware.node_ips[0] if plan.hardware.node_ips else HEAD_IP


def _vllm_parallel(plan: PlanFile, draft: _Draft) -> None:
    par, nodes = plan.parallel, plan.hardware.nodes
    draft.add("--tensor-parallel-size", par.tensor_parallel_size)
    draft.add("--pipeline-parallel-size", par.pipeline_parallel_size)
    draft.add("--data-parallel-size", par.data_parallel_size)
    if par.pipeline_parallel_size > 1:  # NOTE: vLLM's own split differs from the plan's (rule 7)
        draft.env.append(("VLLM_PP_LAYER_PARTITION", _layer_partition(plan)))
    if par.tensor_parallel_size * par.pipeline_parallel_size > 1 or par.distributed_executor_backend == "ray":
        draft.add("--distributed-executor-backend", par.distributed_executor_backend)
    if par.data_parallel_size > 1 and nodes > 1:
        draft.add("--data-parallel-backend", "ray")
    if par.enable_expert_parallel:
        draft.add("--enable-expert-parallel")
    if par.data_parallel_size > 1 and (par.enable_expert_parallel or plan.model.architecture in MOE_ARCHITECTURES):
        draft.notes.append(
            "for a mixture-of-experts model vLLM's --data-parallel-size couples the replicas (the expert "
            f"layers span all {par.data_parallel_size} x {par.tensor_parallel_size} ranks, idle replicas run "
            "dummy steps); for the plan's independent replicas run one `vllm serve` per replica with "
            "--data-parallel-size 1 behind a load balancer")
    if nodes > 1:
        head = _head(plan)
        draft.how_to_run.append(
            f"on a Ray cluster of {nodes} nodes: `ray start --head --port={RAY_PORT}` on {head}, "
            f"`ray start --address={head}:{RAY_PORT}` on each other node, then this command on {head} "
            "only (Ray places the ranks on every node)")


def _dtype_flags(plan: PlanFile, draft: _Draft, kv_names: dict[str, str]) -> None:
    """--dtype, --quantization and --kv-cache-dtype: both engines' names (`kv_names` maps a KV cache
    dtype the engine spells otherwise)."""
    rt = plan.runtime
    if rt.dtype != "auto":
        draft.add("--dtype", rt.dtype)
    if rt.quantization is not None:
        draft.add("--quantization", rt.quantization)
    if rt.kv_cache_dtype != "auto":
        draft.add("--kv-cache-dtype", kv_names.get(rt.kv_cache_dtype, rt.kv_cache_dtype))


def _vllm_runtime(plan: PlanFile, draft: _Draft) -> None:
    rt = plan.runtime
    draft.add("--max-model-len", rt.max_model_len)
    _dtype_flags(plan, draft, {})
    if rt.gpu_memory_utilization != VLLM_DEFAULT_GPU_MEMORY_UTILIZATION:
        draft.add("--gpu-memory-utilization", rt.gpu_memory_utilization)
    if rt.kv_cache_memory_bytes is not None:
        draft.add("--kv-cache-memory-bytes", rt.kv_cache_memory_bytes)
    draft.add("--max-num-seqs", rt.max_num_seqs)
    draft.add("--max-num-batched-tokens", rt.max_num_batched_tokens)
    if rt.block_size not in VLLM_BLOCK_SIZES:
        draft.unsupported.append(f"block_size={rt.block_size} (vLLM's KV blocks hold "
                                 f"{', '.join(map(str, VLLM_BLOCK_SIZES))} tokens)")
    elif rt.block_size != VLLM_DEFAULT_BLOCK_SIZE:
        draft.add("--block-size", rt.block_size)
    if not rt.enable_prefix_caching:
        draft.add("--no-enable-prefix-caching")
    if rt.kv_offloading_size is not None:
        draft.add("--kv-offloading-size", f"{rt.kv_offloading_size:g}")
        draft.add("--kv-offloading-backend", "native")
    if rt.enable_lora:
        draft.add("--enable-lora")
        draft.add("--max-loras", rt.max_loras)
        draft.add("--max-lora-rank", rt.max_lora_rank)
        draft.notes.append("the adapters themselves: --lora-modules name=path ... (as for shardserve launch)")
    if rt.enforce_eager:
        draft.add("--enforce-eager")
    if rt.device == "cpu":
        draft.unsupported.append("device=cpu (vLLM has had no --device since 0.10: it runs where its build "
                                 "targets, so a CPU plan needs vLLM's CPU build)")
    elif rt.device.startswith("cuda:"):
        draft.unsupported.append(f"device={rt.device} (vLLM has no --device: choose its GPUs with "
                                 "CUDA_VISIBLE_DEVICES)")


def _sglang_parallel(plan: PlanFile, draft: _Draft) -> None:
    par, nodes = plan.parallel, plan.hardware.nodes
    draft.add("--tp-size", par.tensor_parallel_size)
    draft.add("--pp-size", par.pipeline_parallel_size)
    draft.add("--dp-size", par.data_parallel_size)
    if par.pipeline_parallel_size > 1:
        draft.env.append(("SGLANG_PP_LAYER_PARTITION", _layer_partition(plan)))
    if par.enable_expert_parallel:  # whole experts over the tp ranks: SGLang's ep_size == tp_size
        draft.add("--ep-size", par.tensor_parallel_size)
    if nodes > 1:
        head = _head(plan)
        draft.add("--nnodes", nodes)
        draft.add("--node-rank", 0)
        draft.add("--dist-init-addr", f"{head}:{SGLANG_DIST_PORT}")
        others = "1 on the other" if nodes == 2 else f"1 to {nodes - 1} on the others"
        ranks = (", ".join(f"{i} on {ip}" for i, ip in enumerate(plan.hardware.node_ips))
                 or f"0 on {head}, {others}")
        draft.how_to_run.append(f"run this on each of the {nodes} nodes, changing --node-rank: {ranks}")
    if par.distributed_executor_backend == "ray":
        draft.notes.append("distributed_executor_backend=ray: this command starts SGLang's own processes "
                           "on each node, not Ray actors (newer SGLang's --use-ray places one replica's "
                           "schedulers as Ray actors)")


def _sglang_runtime(plan: PlanFile, draft: _Draft) -> None:
    rt = plan.runtime
    draft.add("--context-length", rt.max_model_len)
    _dtype_flags(plan, draft, SGLANG_KV_CACHE_DTYPES)
    _sglang_memory(plan, draft)
    draft.add("--max-running-requests", rt.max_num_seqs)
    draft.add("--chunked-prefill-size", rt.max_num_batched_tokens)
    draft.notes.append(
        "--chunked-prefill-size caps the prompt tokens one request adds to a prefill step (SGLang runs "
        "prefill and decode as separate steps, a prefill step up to --max-prefill-tokens); "
        "max_num_batched_tokens caps a step's prompt and decode tokens together")
    if rt.block_size != SGLANG_DEFAULT_PAGE_SIZE:
        draft.add("--page-size", rt.block_size)
    if not rt.enable_prefix_caching:
        draft.add("--disable-radix-cache")
    if rt.kv_offloading_size is not None:
        _sglang_host_cache(plan, draft)
    if rt.enable_lora:
        draft.add("--enable-lora")
        draft.add("--max-loras-per-batch", rt.max_loras)
        draft.add("--max-lora-rank", rt.max_lora_rank)
        draft.notes.append("the adapters themselves: --lora-paths name=path ... (shardserve's --lora-modules)")
    if rt.enforce_eager:
        draft.add("--disable-cuda-graph")
    if rt.device == "cpu":
        draft.add("--device", "cpu")
    elif rt.device.startswith("cuda:"):
        draft.add("--base-gpu-id", rt.device.removeprefix("cuda:"))


def _sglang_memory(plan: PlanFile, draft: _Draft) -> None:
    """SGLang sizes memory as a static fraction (weights and KV pool) and its pool in tokens."""
    rt, gpu, per_gpu = plan.runtime, plan.hardware.gpu, plan.memory.per_gpu
    if not gpu.is_cpu:
        static = per_gpu.weights_bytes + per_gpu.kv_cache_bytes
        fraction = math.floor(static / gpu.memory_bytes * 1000) / 1000
        draft.add("--mem-fraction-static", f"{fraction:.3f}")
        draft.notes.append(
            f"--mem-fraction-static {fraction:.3f} is the plan's weights plus KV cache per GPU (the "
            "tightest stage) over GPU memory: SGLang's fraction holds only those, while "
            f"gpu_memory_utilization {rt.gpu_memory_utilization:g} also covers activations, CUDA graphs "
            "and the CUDA context")
    if rt.kv_cache_memory_bytes is not None:
        draft.add("--max-total-tokens", plan.memory.kv_cache_tokens)
        draft.notes.append(
            f"--max-total-tokens {plan.memory.kv_cache_tokens} is the plan's KV pool of "
            f"kv_cache_memory_bytes {rt.kv_cache_memory_bytes} per rank, in tokens: SGLang caps its pool "
            "in tokens, not bytes")


def _sglang_host_cache(plan: PlanFile, draft: _Draft) -> None:
    """SGLang's hierarchical cache sizes each rank's host pool in whole GB; ours is GiB per replica."""
    rt, par = plan.runtime, plan.parallel
    assert rt.kv_offloading_size is not None  # the caller's check
    ranks = par.tensor_parallel_size * par.pipeline_parallel_size
    per_rank_gb = int(rt.kv_offloading_size * 2**30 / ranks / 1e9)
    if per_rank_gb < 1:
        draft.unsupported.append(f"kv_offloading_size={rt.kv_offloading_size:g} (under 1 GB per rank over "
                                 f"{ranks} ranks: SGLang's --hicache-size takes whole GB per rank)")
        return
    draft.add("--enable-hierarchical-cache")
    draft.add("--hicache-size", per_rank_gb)
    draft.notes.append(f"--hicache-size {per_rank_gb} is kv_offloading_size {rt.kv_offloading_size:g} GiB per "
                       f"replica over its {ranks} rank(s), in whole GB: SGLang sizes each rank's host pool")
