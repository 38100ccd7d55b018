"""Values of a transformers config.json under every name transformers has saved them, with one-line errors."""

from __future__ import annotations

from typing import Any

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

    def int(self, *keys: str, default: Any = REQUIRED) -> int:
        name, value = self.find(*keys, default=default)
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise self.bad(name, value, "an integer")
        return int(value)

    def count(self, *keys: str, default: Any = REQUIRED) -> int:
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

    def ints(self, key: str) -> tuple[int, ...]:
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


def rope_parameters(config: dict, model_id: str = "model") -> dict:
    """The rope settings, old style (rope_theta + rope_scaling) or transformers 5 (rope_parameters),
    as one dict with `rope_type` and `rope_theta` always set, and `original_max_position_embeddings`
    (the pretraining length) wherever the scaling reads it, as transformers fills it in."""
    params = config.get("rope_parameters") or {}
    legacy = config.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if not isinstance(value, dict):
            raise PlanError(f"{model_id}: config.json {key} is {value!r}; expected a mapping")
        if value and all(isinstance(v, dict) for v in value.values()):
            raise PlanError(f"{model_id}: config.json {key} has one entry per layer type "
                            f"({', '.join(value)}), which is not supported")
    merged = {**legacy, **params} if not params.get("rope_type") else dict(params)
    merged.setdefault("rope_theta", config.get("rope_theta") or 10000.0)
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    merged.pop("type", None)
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


def max_context_length(max_position_embeddings: int, rope: dict | None) -> int:
    """The longest context a model serves. NOTE: vLLM's rule: linear, dynamic and yarn scaling
    stretch the (pretraining) length by `factor`; llama3 and longrope configs already count the
    stretched length in max_position_embeddings."""
    kind = rope["rope_type"] if rope else "default"
    if kind not in ROPE_TYPES_STRETCHING_CONTEXT or not rope.get("factor"):
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
    "Gemma3ForConditionalGeneration": "interleaved",
}


def uniform_sliding_window(config: dict) -> int | None:
    """The attention window that every layer applies, or None when some layer sees the whole context.
    Only then can KV blocks behind the window be freed: one full-attention layer still reads them all."""
    window = config.get("sliding_window")
    rule = next((WINDOW_RULES[a] for a in config.get("architectures") or () if a in WINDOW_RULES), None)
    if not window or rule is None:
        return None
    if rule == "qwen" and not config.get("use_sliding_window", False):
        return None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return window if all(t == "sliding_attention" for t in layer_types) else None
    if rule == "qwen":
        return window if config.get("max_window_layers", 28) <= 0 else None
    return window if rule == "every" else None
