"""The plan as a typed record: frozen sections that `plan -o` writes and `launch` and `doctor` read.

`PlanFile.from_dict(data, source)` checks the version, every key and every type, and its errors
name the file and the key (`plan.yaml: parallel.layer_split: ...`); `to_dict()` gives the mapping
written as YAML or JSON. Sections whose keys are settings (runtime, parallel) are also checked
against the settings table, so a plan edited by hand meets the same rules as a flag.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass

from shardserve.planner.errors import PlanError
from shardserve.planner.settings import BY_NAME, PLAN, SettingError

SCHEMA_VERSION = 2  # 2: the service section and the workload's estimates


@dataclass(frozen=True)
class ModelSection:
    id: str
    path: str | None  # a local folder; None for a catalog entry (no weights)
    architecture: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    weight_bytes: int
    dtype: str
    quantization: dict | None  # {"method", "bits", "group_size"}
    kv_bytes_per_token: int
    # where a Hub id is fetched from, as `plan` was told (--revision, --download-dir; never the token);
    # None: the defaults, a local folder, or a plan written before plans had them
    revision: str | None = None
    download_dir: str | None = None


@dataclass(frozen=True)
class GpuSection:
    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    bf16_flops: float
    fp16_flops: float
    fp8: bool
    is_cpu: bool


@dataclass(frozen=True)
class HardwareSection:
    source: str
    nodes: int
    gpus_per_node: int
    gpu: GpuSection
    interconnect: str
    node_ips: tuple[str, ...]

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class ParallelSection:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    layer_split: tuple[int, ...]  # layers per pipeline stage
    distributed_executor_backend: str
    enable_expert_parallel: bool  # MoE experts whole per tp rank (False for dense models)

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


@dataclass(frozen=True)
class StageSection:
    total_bytes: int
    weights_bytes: int
    activation_bytes: int
    overhead_bytes: int
    kv_cache_bytes: int
    lora_bytes: int | None = None  # the LoRA adapter slots (enable_lora); None: none
    # linear-attention layers' state (one row per request, and a scratch row); None: no such layers
    recurrent_state_bytes: int | None = None


@dataclass(frozen=True)
class MemorySection:
    per_gpu: StageSection  # the tightest stage
    per_stage: tuple[StageSection, ...]
    block_size: int
    num_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    offload_tokens: int | None = None  # the CPU tier's capacity per replica (kv_offloading_size)
    offload_bytes: int | None = None  # the host memory it takes per replica


@dataclass(frozen=True)
class RuntimeSection:
    device: str
    dtype: str
    quantization: str | None  # the --quantization override; None: config.json's quantization_config
    kv_cache_dtype: str
    max_model_len: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None
    enforce_eager: bool
    kv_offloading_size: float | None = None  # GiB per replica for the CPU tier; None: none (older plans)
    # LoRA's slots; None without enable_lora (so a plan without adapters reads as older plans do)
    enable_lora: bool | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    speculative_config: str | None = None  # vLLM's JSON, every key written; None: no speculative decoding


@dataclass(frozen=True)
class ServiceSection:
    """The traffic and the targets the plan is for, as settings (launch checks itself against them)."""
    input_len: int
    output_len: int
    prefix_len: int
    concurrency: float | None    # None with request_rate, or for full batches
    request_rate: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    target_percentile: int
    draft_acceptance_rate: float | None = None  # with speculative_config: what the estimates assume


@dataclass(frozen=True)
class WorkloadSection:
    """The load the estimates are for: the service's, with full batches written out as a concurrency."""
    input_len: int
    output_len: int
    prefix_len: int
    concurrency: float | None
    request_rate: float | None
    percentile: int


@dataclass(frozen=True)
class Spread:
    """A latency's percentiles over the requests of a replayed trace, in ms."""
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True)
class PercentilesSection:
    ttft_ms: Spread
    tpot_ms: Spread | None  # None: no request generated more than one token
    itl_ms: Spread | None   # every gap between two tokens of a request
    e2e_ms: Spread


@dataclass(frozen=True)
class TraceSection:
    """The trace the percentiles come from, replayed through the engine's scheduler (runtime/core/replay.py)."""
    source: str
    num_requests: int
    offline: bool
    output_tokens_per_s: float  # the whole deployment, over the trace's span
    replay_seconds: float  # how long the replays took, every layout's
    concurrency: int | None = None  # a closed loop of this many in flight; None: sent as they arrived
    num_layouts_replayed: int = 1  # the search's best few, each replayed; the plan's layout won
    plan_seconds: float | None = None  # the whole plan, the search and the replays; None: a plan written before


@dataclass(frozen=True)
class SpeedSection:
    """The speed of the same layout and load under other settings (the plan's without speculative decoding), from
    the steady-state model (a plan from a trace too)."""
    ttft_ms: float | None  # None: overloaded
    tpot_ms: float
    output_tokens_per_s: float
    decode_tokens_per_s_batch1: float


@dataclass(frozen=True)
class SpeculationSection:
    """What speculative decoding does in the estimates: the tokens a verify step yields, and the layout's speed
    without it."""
    method: str
    num_speculative_tokens: int
    draft_acceptance_rate: float
    tokens_per_step: float
    without: SpeedSection


@dataclass(frozen=True)
class EstimatesSection:
    workload: WorkloadSection
    ttft_ms: float | None  # None: overloaded, the rate outruns the layout and TTFT grows without bound
    tpot_ms: float
    output_tokens_per_s: float  # the whole deployment
    output_tokens_per_s_per_gpu: float
    output_tokens_per_s_per_user: float
    max_request_rate: float     # requests/s within the targets (without targets: before overload)
    decode_tokens_per_s_batch1: float
    source: str
    percentiles: PercentilesSection | None = None  # with --trace: the chosen layout's, replayed
    trace: TraceSection | None = None
    speculation: SpeculationSection | None = None  # with speculative_config
    api_max_request_rate: float | None = None  # requests/s its one API process keeps up with; None: not counted


@dataclass(frozen=True)
class PlanFile:
    version: int
    model: ModelSection
    hardware: HardwareSection
    parallel: ParallelSection
    memory: MemorySection
    runtime: RuntimeSection
    service: ServiceSection
    estimates: EstimatesSection
    rationale: tuple[str, ...]
    warnings: tuple[str, ...]
    alternatives: tuple[dict, ...]  # the layouts that lost, each with why_not
    # inputs_digest() of the settings, hardware and model the predictions were made for; launch plans
    # again when they differ (a layout edited by hand). None: a plan written before plans had one
    inputs_digest: str | None = None

    @property
    def model_source(self) -> str:
        return self.model.path or self.model.id

    def setting_values(self) -> dict:
        """The settings its runtime, parallel and service sections fix, by the table's names."""
        return {**_to_plain(self.runtime), **_to_plain(self.parallel), **_to_plain(self.service)}

    def digest(self) -> str:
        """inputs_digest() of this plan's own sections."""
        return inputs_digest(self.setting_values(), self.hardware, self.model.id)

    def to_dict(self) -> dict:
        return _to_plain(self)

    @classmethod
    def from_dict(cls, data: object, source: str) -> PlanFile:
        if not isinstance(data, dict) or data.get("version") != SCHEMA_VERSION:
            found = data.get("version") if isinstance(data, dict) else None
            raise PlanError(f"{source}: not a shardserve plan of version {SCHEMA_VERSION} (version: {found!r}); "
                            "make one with `shardserve plan -o plan.yaml`")
        return _from_plain(cls, data, source, "")


_CHECKED_BY_TABLE = (RuntimeSection, ParallelSection, ServiceSection)


def inputs_digest(values: dict, hardware: HardwareSection, model_id: str) -> str:
    """A short digest of what a plan's predictions are made from: the planner's settings and the layer split
    in `values` (None and other names left out), the hardware and the model id."""
    kept = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()
            if v is not None and k in BY_NAME and (k == "layer_split" or PLAN in BY_NAME[k].layers)}
    text = json.dumps([kept, _to_plain(hardware), model_id], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _to_plain(value):
    if dataclasses.is_dataclass(value):  # a key added later and left at None is not written: as older plans
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (f.default is None and getattr(value, f.name) is None)}
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    return value


def _from_plain(cls, data: object, source: str, prefix: str):
    if not isinstance(data, dict):
        raise PlanError(f"{source}: {prefix.rstrip('.') or 'the plan'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise PlanError(f"{source}: {prefix}{unknown[0]}: unknown key (a {cls.__name__} has: {', '.join(names)})")
    values = {}
    for name in names:
        key = prefix + name
        if name not in data and defaults.get(name, dataclasses.MISSING) is not dataclasses.MISSING:
            values[name] = defaults[name]  # a key added later: older plans lack it
            continue
        if name not in data:
            raise PlanError(f"{source}: {key}: missing; make the plan again with `shardserve plan`")
        setting = BY_NAME.get(name) if cls in _CHECKED_BY_TABLE else None
        value = data[name]
        try:
            if setting is not None and setting.human_readable and isinstance(value, str):
                value = setting.check(value)  # a hand-written 32k
            values[name] = _convert(hints[name], value, source, key)
            if setting is not None:
                setting.check(values[name])
        except SettingError as e:
            raise PlanError(f"{source}: {key}: {e}") from None
    return cls(**values)


def _convert(hint, value, source: str, key: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _from_plain(hint, value, source, key + ".")
    if origin is tuple:
        if not isinstance(value, list):
            raise PlanError(f"{source}: {key}: expected a list, got {value!r}")
        return tuple(_convert(args[0], v, source, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise PlanError(f"{source}: {key}: expected {hint.__name__}, got {value!r}")
    return value
