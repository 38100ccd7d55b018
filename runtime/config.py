"""Frozen engine configuration, composed by concern, and the record of values measured at start-up."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

from shardserve.planner.hf_config import max_context_length, recurrent_layer_kind
from shardserve.planner.kv_groups import KVGroups, model_kv_groups, tokens_held
from shardserve.planner.hub import HubOptions, hf_cache_dir
from shardserve.planner.model_spec import canonical_dtype
from shardserve.planner.served import ARCHITECTURES, unserved_layers_problem
from shardserve.planner.speculative import eagle3_head_config
from shardserve.runtime.layers.quantization.config import QuantConfig
from shardserve.runtime.layers.rotary import rope_parameters
from shardserve.runtime.pooling_params import PoolerConfig
from shardserve.runtime.core.scheduler_config import SchedulerConfig as SchedulerConfig  # (torch-free: the plan's replay)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a local folder with config.json and *.safetensors
    hf_config: Any  # transformers PretrainedConfig, read once (a multimodal checkpoint's text_config)
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False  # True: no CUDA graphs, every step runs eagerly
    quantization: QuantConfig | None = None  # the checkpoint's weight format; None: float weights
    chat_template: str | None = None  # replaces the tokenizer's (inline Jinja or a file's path)
    generation_config: str = "auto"  # where sampling defaults come from (runtime/generation_config.py)
    # how the attention layers share the KV pool: a block table per kind of layer (planner/kv_groups.py)
    kv_groups: KVGroups = KVGroups((None,), (), 1)
    recurrent_kind: str | None = None  # its recurrent layers' kind ("Gated DeltaNet"); None: it has none
    is_max_model_len_auto: bool = False  # max_model_len is the model's until the KV cache is measured
    pooler: PoolerConfig | None = None  # runner "pooling": prompts are pooled, never sampled; None: generate
    load_format: str = "auto"  # auto | safetensors: the checkpoint's weights; dummy: random weights of its shapes
    # where a Hub id was looked up (`model` is then its snapshot folder); its token is never in a repr
    hub: HubOptions = HubOptions()

    @property
    def runner(self) -> str:
        """vLLM's runner: "generate" (sample tokens) or "pooling" (a vector per prompt; no LM head)."""
        return "generate" if self.pooler is None else "pooling"

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


def load_model_config(model: str, dtype: str = "auto", max_model_len: int | Literal["auto"] | None = None,
                      skip_tokenizer_init: bool = False, enforce_eager: bool = False,
                      device: str = "cpu", quantization: str | None = None) -> ModelConfig:
    from transformers import AutoConfig, LlamaConfig

    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model must be a local folder with a config.json or an id in the local Hugging Face "
                         f"cache ({hf_cache_dir()}); {config_path!r} does not exist")
    with open(config_path) as f:
        raw = json.load(f)
    head = eagle3_head_config(raw)  # a speculators-format EAGLE-3 head, as the EAGLE authors lay it out
    architectures = head.get("architectures") or []
    if len(architectures) != 1:
        raise ValueError(f"config.json must name exactly one architecture, found {architectures}")
    problem = unserved_layers_problem(architectures)  # a hybrid with layers the runtime lacks (Mamba-2), named
    if problem:
        raise ValueError(problem)
    checkpoint_config = AutoConfig.from_pretrained(model) if head is raw else LlamaConfig.from_dict(head)
    served = ARCHITECTURES.get(architectures[0])
    # a multimodal checkpoint: the language model's config (the checkpoint's dtype and quantization stay)
    hf_config = checkpoint_config.text_config if served and served.has_text_config else checkpoint_config
    longest = _max_positions(hf_config)
    text = hf_config.to_dict()
    is_auto = max_model_len == "auto"  # kv_sizing picks the length once the pool is measured
    if max_model_len is None or max_model_len == "auto":
        max_model_len = longest
    elif max_model_len > longest:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's {longest} positions; "
                         f"set max_model_len <= {longest}")
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    return ModelConfig(model=model, hf_config=hf_config, architecture=architectures[0],
                       dtype=_resolve_dtype(dtype, checkpoint_config, device), max_model_len=max_model_len,
                       skip_tokenizer_init=skip_tokenizer_init, enforce_eager=enforce_eager,
                       quantization=QuantConfig.from_dict(getattr(checkpoint_config, "quantization_config", None),
                                                          quantization),
                       recurrent_kind=recurrent_layer_kind(text),
                       kv_groups=model_kv_groups({**text, "architectures": architectures},
                                                 hf_config.num_hidden_layers),
                       is_max_model_len_auto=is_auto)


def _max_positions(hf_config) -> int:
    """The model's positions (stretched by linear, dynamic and yarn rope scaling, as the planner counts)."""
    learned = getattr(hf_config, "n_positions", None)  # GPT-2: no rotary embedding
    if learned:
        return int(learned)
    positions = getattr(hf_config, "max_position_embeddings", None)
    if not positions:
        raise ValueError("config.json names no max_position_embeddings; pass max_model_len")
    has_rope = any(getattr(hf_config, key, None) for key in ("rope_parameters", "rope_scaling", "rope_theta"))
    return max_context_length(int(positions), rope_parameters(hf_config) if has_rope else None,
                              getattr(hf_config, "model_type", None))


def _resolve_dtype(dtype: str | torch.dtype, hf_config, device: str) -> torch.dtype:
    """NOTE: "auto" on CPU is float32, as the planner plans it (planner/options.py), so LLM(...) and
    `shardserve launch` compute the same numbers; on a GPU it is the checkpoint's dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" and device == "cpu":
        return torch.float32
    if dtype == "auto":
        saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(saved, torch.dtype):
            return saved
        return _DTYPES.get(str(saved), torch.float32)
    return _DTYPES[canonical_dtype(dtype)]  # bf16, half, fp32 ... as the planner reads them


# NOTE: the configs below are resolved values: names, defaults and checks live in the settings
# table (planner/settings.py), applied by EngineArgs before any of them is made.
@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    enable_prefix_caching: bool
    kv_cache_dtype: str  # "auto": the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2
    kv_offloading_size: float | None = None  # GiB of host memory per engine (all ranks) for the CPU tier

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV pool is allocated in."""
        return _KV_DTYPES.get(self.kv_cache_dtype, model_dtype)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    distributed_executor_backend: str | None = None
    layer_split: tuple[int, ...] | None = None  # layers per stage (a plan's); None: the planner's rule
    enable_expert_parallel: bool = False  # MoE experts whole on tp ranks instead of split across them

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int  # adapter slots on every rank: the most adapters in one batch
    max_lora_rank: int  # each slot's rank
    max_cpu_loras: int  # adapters each rank keeps in host memory (at least max_loras)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str  # "cuda" or "cpu", resolved from "auto"
    seed: int = 0
    lora: LoRAConfig | None = None  # enable_lora's slots; None: no adapters
    draft: ModelConfig | None = None  # speculative_config's draft model, EAGLE-3 head or (mtp) the model; None: none


def resolve_device(device: str) -> str:
    """'auto', 'cpu', 'cuda', or 'cuda:N' (N: the first GPU of this engine's ranks)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA device; use device='cpu'")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: torch sees {torch.cuda.device_count()} GPUs")
    return device


def first_device_index(device: str) -> int:
    """0 for 'cuda', N for 'cuda:N'."""
    return int(device.partition(":")[2] or 0)


@dataclass(frozen=True)
class KVCacheInfo:
    """Measured at start-up: how big the KV block pool came out."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int  # as set, or with max_model_len auto the longest that fits
    blocks_per_request: int  # the most blocks a request of max_model_len holds (planner/memory.py's rule)
    num_offload_blocks: int = 0  # the CPU tier's (kv_offloading_size)

    @property
    def num_tokens(self) -> int:
        """Tokens the pool holds as requests of max_model_len (more than num_blocks x block_size where windowed
        layers hold only their window; planner/kv_groups.py)."""
        return tokens_held(self.num_blocks, self.block_size, self.max_model_len, self.blocks_per_request)

    @property
    def memory_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens fit in the pool at once."""
        return self.num_blocks / self.blocks_per_request
