"""The model's sampling defaults (generation_config.json), applied where a request sets none."""

from __future__ import annotations

import json
import os

from shardserve.runtime.config import ModelConfig

# generation_config.json key -> SamplingParams field (vLLM reads the same keys)
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_config: ModelConfig) -> dict:
    """SamplingParams fields the model's generation config sets. generation_config "auto" reads
    the model folder's file, "vllm" none (SamplingParams' own defaults), anything else is a folder."""
    source = model_config.generation_config
    if source == "vllm":
        return {}
    folder = model_config.model if source == "auto" else source
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if source != "auto":
            raise ValueError(f"generation_config {source!r}: no generation_config.json there; give a folder "
                             "holding one, 'auto' (the model's) or 'vllm' (no defaults)")
        return {}
    with open(path) as f:
        config = json.load(f)
    return {field: config[key] for key, field in _KEYS.items() if config.get(key) is not None}
