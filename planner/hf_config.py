"""Values of a transformers config.json under every name transformers has saved them, with one-line errors."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any, overload

from shardserve.planner.errors import PlanError

# NOTE: transformers renames keys between releases (Qwen3-MoE saves `num_local_experts` since 5.0,
# `dtype` replaced `torch_dtype`, `rope_parameters` folds `rope_theta` and `rope_scaling`); each value
# is looked up under all of its names, the newest first.
ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "dtype": ("dtype", "torch_dtype"),
}

REQUIRED = object()  # default= for a value that must be present


class ConfigReader:
    """Typed reads from one config.json; a missing or malformed value raises a PlanError naming it."""

    def __init__(self, model_id: str, config: dict):
        self.model_id, self.config = model_id, config

    def names(self, key: str) -> tuple[str, ...]:
        return ALIASES.get(key, (key,))

    def get(self, *keys: str, default: Any = REQUIRED) -> Any:
        """The first of `keys` (each under any of its names) present and not null."""
        return self.find(*keys, default=default)[1]

    def find(self, *keys: str, default: Any = REQUIRED) -> tuple[str, Any]:
        """(the name it was saved under, the value)."""
        for key in keys:
            for name in self.names(key):
                if self.config.get(name) is not None:
                    return name, self.config[name]
        if default is REQUIRED:
            wanted = " or ".join(n for key in keys for n in self.names(key))
            raise PlanError(f"{self.model_id}: config.json has no {wanted} (required)")
        return keys[0], default

    # NOTE: in this class `int` names the method below, so annotations spell the type builtins.int
    @overload
    def int(self, *keys: str) -> builtins.int: ...
    @overload
    def int(self, *keys: str, default: builtins.int) -> builtins.int: ...
    @overload
    def int(self, *keys: str, default: None) -> builtins.int | None: ...

    def int(self, *keys: str, default: Any = REQUIRED) -> builtins.int | None:
        name, value = self.find(*keys, default=default)
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise self.bad(name, value, "an integer")
        return int(value)

    def count(self, *keys: str, default: Any = REQUIRED) -> builtins.int:
        """An integer of at least 1 (layers, heads, sizes)."""
        name, _ = self.find(*keys, default=default)
        value = self.int(*keys, default=default)
        if value < 1:
            raise self.bad(name, value, "a positive integer")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.get(key, default=default)
        if not isinstance(value, bool):
            raise self.bad(key, value, "true or false")
        return value

    def ints(self, key: str) -> tuple[builtins.int, ...]:
        value = self.get(key, default=[])
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self.bad(key, value, "a list of integers")
        return tuple(value)

    def bad(self, key: str, value: Any, expected: str) -> PlanError:
        return PlanError(f"{self.model_id}: config.json {key} is {value!r}; expected {expected}")

    def rope_parameters(self) -> dict:
        return rope_parameters(self.config, self.model_id)


ROPE_TYPES_STRETCHING_CONTEXT = ("linear", "dynamic", "yarn")


# NOTE: transformers saves a multimodal model's text_config without the values that equal the text
# config class's defaults; the planner reads config.json alone, so those defaults are written here.
TEXT_CONFIG_DEFAULTS: dict[str, dict] = {
    "gemma3_text": {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2304,
                    "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True},
    "qwen3_5_text": {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096,
                     "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
                     "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 32768,
                     "tie_word_embeddings": False, "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                     "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                     "linear_num_key_heads": 16, "linear_num_value_heads": 32},
    "qwen3_5_moe_text": {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
                         "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                         "head_dim": 256, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                         "rope_theta": 10_000.0, "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4,
                         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                         "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
                         "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
}
CHECKPOINT_WIDE_KEYS = ("architectures", "dtype", "torch_dtype", "quantization_config")


def language_model_config(config: dict, model_id: str = "model") -> dict:
    """A multimodal config.json's language model as a text model's config.json: its text_config with
    transformers' defaults filled in, and the checkpoint-wide keys (architectures, dtype, quantization)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise PlanError(f"{model_id}: config.json text_config is {text!r}; expected a mapping")
    defaults = TEXT_CONFIG_DEFAULTS.get(text.get("model_type", "gemma3_text"), {})
    wide = {key: config[key] for key in CHECKPOINT_WIDE_KEYS if config.get(key) is not None}
    return {**defaults, **{k: v for k, v in text.items() if v is not None}, **wide}


# NOTE: the kind of recurrent layer each linear-attention family has; their state is one per request
RECURRENT_KINDS = {"qwen3_next": "Gated DeltaNet", "qwen3_5_text": "Gated DeltaNet", "qwen3_5_moe_text": "Gated DeltaNet"}


def recurrent_layer_kind(config: dict) -> str | None:
    """The kind of this (text) config's recurrent layers ("Gated DeltaNet"), None if it has none."""
    types = config.get("layer_types") or ()
    if "linear_attention" in types or config.get("full_attention_interval"):
        return RECURRENT_KINDS.get(config.get("model_type") or "", "linear attention")
    return None


LAYER_TYPES = ("full_attention", "sliding_attention")
# NOTE: configs saved before `layer_types` existed give the local/global alternation as a period
# (Gemma 3's `sliding_window_pattern`: every 6th layer global) or not at all (Gemma 2: every 2nd
# layer global); transformers fills in layer_types from the same rule.
DEFAULT_SLIDING_PATTERN = {"gemma2": 2, "gemma3_text": 6}
# linear-attention hybrids (Qwen3-Next, Qwen3.5): "linear_attention" layers but every full_attention_interval-th
SAVED_LAYER_TYPES = (*LAYER_TYPES, "linear_attention")
DEFAULT_FULL_ATTENTION_INTERVAL = {"qwen3_next": 4, "qwen3_5_text": 4, "qwen3_5_moe_text": 4}


def layer_types(config: dict, model_id: str = "model", family: str | None = None) -> tuple[str, ...] | None:
    """Each layer's attention, "full_attention", "sliding_attention" or "linear_attention", under every
    spelling (`layer_types`, Qwen3-Next's `full_attention_interval`, Gemma 3's `sliding_window_pattern`,
    Gemma 2's implicit alternation); None: the
    config does not say (every layer alike). `family`: the model_type when config.json lacks it."""
    num_layers = config.get("num_hidden_layers")
    saved = config.get("layer_types")
    if saved is not None:
        is_list = isinstance(saved, list)
        is_miscounted = is_list and isinstance(num_layers, int) and len(saved) != num_layers
        if not is_list or is_miscounted or any(t not in SAVED_LAYER_TYPES for t in saved):
            raise PlanError(f"{model_id}: config.json layer_types is {saved!r}; expected "
                            f"{num_layers or 'one per layer'} entries of {' or '.join(SAVED_LAYER_TYPES)}")
        return tuple(saved)
    interval = config.get("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL.get(
        config.get("model_type") or family or "")
    if interval is not None and isinstance(num_layers, int):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise PlanError(f"{model_id}: config.json full_attention_interval is {interval!r}; expected a positive integer")
        return tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers))
    pattern = config.get("sliding_window_pattern")
    if pattern is None:
        pattern = DEFAULT_SLIDING_PATTERN.get(config.get("model_type") or family or "")
    if pattern is None or not isinstance(num_layers, int):
        return None
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise PlanError(f"{model_id}: config.json sliding_window_pattern is {pattern!r}; expected a positive integer")
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def _is_per_layer_type(value: dict) -> bool:
    return bool(value) and all(isinstance(v, dict) or v is None for v in value.values())


def _per_layer_type(value: dict, key: str, layer_type: str, model_id: str) -> dict:
    """transformers 5 saves Gemma 3's rope as one entry per layer type: the one for `layer_type`."""
    unknown = [t for t in value if t not in LAYER_TYPES]
    if unknown or layer_type not in value:
        raise PlanError(f"{model_id}: config.json {key} has entries for {', '.join(value)}; expected "
                        f"{' and '.join(LAYER_TYPES)}")
    return dict(value[layer_type] or {})


def rope_parameters(config: dict, model_id: str = "model", layer_type: str = "full_attention") -> dict:
    """The rope settings, old style (rope_theta + rope_scaling) or transformers 5 (rope_parameters),
    as one dict with `rope_type` and `rope_theta` always set, and `original_max_position_embeddings`
    (the pretraining length) wherever the scaling reads it, as transformers fills it in.
    `layer_type`: which layers' rope, for models whose local (sliding) layers have their own (Gemma 3:
    per-type rope_parameters, or `rope_local_base_freq` with the scaling on global layers only)."""
    params = config.get("rope_parameters") or {}
    legacy = config.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if not isinstance(value, dict):
            raise PlanError(f"{model_id}: config.json {key} is {value!r}; expected a mapping")
    if _is_per_layer_type(params) or _is_per_layer_type(legacy):
        params = _per_layer_type(params, "rope_parameters", layer_type, model_id) if params else {}
        legacy = _per_layer_type(legacy, "rope_scaling", layer_type, model_id) if legacy else {}
    elif layer_type == "sliding_attention" and config.get("rope_local_base_freq") is not None:
        return {"rope_type": "default", "rope_theta": config["rope_local_base_freq"]}
    merged = {**legacy, **params} if not params.get("rope_type") else dict(params)
    merged.setdefault("rope_theta", config.get("rope_theta") or 10000.0)
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    if config.get("partial_rotary_factor") is not None:  # Phi-3's, before transformers 5 moved it here
        merged.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    merged.pop("type", None)
    if merged["rope_type"] == "su":  # Phi-3's first name for longrope
        merged["rope_type"] = "longrope"
    max_positions = config.get("max_position_embeddings")
    if merged["rope_type"] == "dynamic":  # transformers' dynamic NTK stretches from here
        merged["original_max_position_embeddings"] = max_positions
    elif merged["rope_type"] in ("llama3", "yarn", "longrope"):
        merged["original_max_position_embeddings"] = (config.get("original_max_position_embeddings")
                                                      or merged.get("original_max_position_embeddings")
                                                      or max_positions)
        if merged.get("factor") is None and max_positions and merged["rope_type"] != "llama3":
            merged["factor"] = max_positions / merged["original_max_position_embeddings"]
    return merged


# NOTE: Gemma 3's max_position_embeddings already counts its global layers' linear stretch
POSITIONS_ALREADY_STRETCHED = ("gemma3_text",)


def max_context_length(max_position_embeddings: int, rope: dict | None, model_type: str | None = None) -> int:
    """The longest context a model serves. NOTE: vLLM's rule: linear, dynamic and yarn scaling
    stretch the (pretraining) length by `factor`; llama3 and longrope configs (and Gemma 3's)
    already count the stretched length in max_position_embeddings."""
    kind = rope["rope_type"] if rope else "default"
    if (not rope or kind not in ROPE_TYPES_STRETCHING_CONTEXT or not rope.get("factor")
            or model_type in POSITIONS_ALREADY_STRETCHED):
        return max_position_embeddings
    start = rope.get("original_max_position_embeddings") if kind == "yarn" else None
    return int((start or max_position_embeddings) * float(rope["factor"]))


# NOTE: how each architecture's layers take config.json's sliding_window (as transformers applies it):
# "every" layer; "qwen": the layers from max_window_layers on, only with use_sliding_window (off by
# default); "interleaved": local and global layers alternate (Gemma 2/3). An architecture missing here
# (Llama, GPT-2, OPT) ignores the key. A saved `layer_types` list overrides the rule.
WINDOW_RULES = {
    "MistralForCausalLM": "every", "MixtralForCausalLM": "every", "Phi3ForCausalLM": "every",
    "Qwen2ForCausalLM": "qwen", "Qwen3ForCausalLM": "qwen", "Qwen2MoeForCausalLM": "qwen",
    "Qwen3MoeForCausalLM": "qwen", "Gemma2ForCausalLM": "interleaved", "Gemma3ForCausalLM": "interleaved",
    "Gemma3ForConditionalGeneration": "interleaved", "GptOssForCausalLM": "interleaved",
}


def read_config_json(path: Path, name: str) -> dict[str, Any]:
    """A config.json as a mapping; a PlanError naming `name` (the file, or the model it came from) when it is
    not valid JSON or not an object."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise PlanError(f"{name} must hold a JSON object")
    return config
