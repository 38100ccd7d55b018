"""What a pooling request asks for (vLLM's PoolingParams) and the engine's pooling defaults, read from a
sentence-transformers checkpoint's modules.json and 1_Pooling/config.json where it has them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from shardserve.planner.settings import BY_NAME
from shardserve.runtime.sampling_params import SamplingParams

POOLING_TYPES: tuple[str, ...] = BY_NAME["pooling_type"].choices or ()  # LAST, MEAN, CLS (the first token)
DEFAULT_POOLING_TYPE = "LAST"  # vLLM's for a decoder run as an embedding model
# what a pooling request is to the scheduler: its prompt is computed and one "token" (the pooled vector)
# comes back, after which it finishes; nothing is ever sampled from it
PROMPT_ONLY = SamplingParams(max_tokens=1, temperature=0.0)
# sentence-transformers' Pooling config keys -> ours (the `pooling_mode` string of newer versions too)
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                "pooling_mode_cls_token": "CLS", "lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """The engine's resolved pooling: what a request that sets nothing gets."""

    pooling_type: str
    normalize: bool  # L2-normalize the pooled vector


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """A pooling request's parameters; None takes the engine's PoolerConfig."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type={self.pooling_type!r} must be one of {', '.join(POOLING_TYPES)}")

    def resolved(self, defaults: PoolerConfig) -> PoolingParams:
        """Every field set: the request's where it gives one, else the engine's."""
        return replace(self, pooling_type=self.pooling_type or defaults.pooling_type,
                       normalize=defaults.normalize if self.normalize is None else self.normalize)

    @property
    def needs_every_prompt_token(self) -> bool:
        """MEAN reads every position and CLS the first: no prompt token may come from the prefix cache
        (LAST reads the last token, which the cache always leaves to compute)."""
        return self.pooling_type != "LAST"


def pooler_config(folder: str, pooling_type: str | None, normalize: bool | None) -> PoolerConfig:
    """The settings where given, else the checkpoint's sentence-transformers files, else LAST and
    normalized (vLLM's defaults for an embedding model)."""
    saved_type, saved_normalize = sentence_transformers_pooling(folder)
    return PoolerConfig(pooling_type or saved_type or DEFAULT_POOLING_TYPE,
                        normalize if normalize is not None else (saved_normalize if saved_type else True))


def sentence_transformers_pooling(folder: str) -> tuple[str | None, bool]:
    """(pooling type, whether a Normalize module follows) from modules.json and its Pooling module's
    config.json; (None, False) for a folder without them or with a pooling mode not served here."""
    modules = _read_json(os.path.join(folder, "modules.json"))
    if not isinstance(modules, list):
        return None, False
    types = [str(module.get("type", "")) for module in modules if isinstance(module, dict)]
    pooling = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling")), None)
    if pooling is None:
        return None, False
    config = _read_json(os.path.join(folder, str(pooling.get("path", "")), "config.json"))
    if not isinstance(config, dict):
        return None, False
    modes = [config["pooling_mode"]] if isinstance(config.get("pooling_mode"), str) else \
        [key for key, value in config.items() if key.startswith("pooling_mode_") and value is True]
    found = {_SENTENCE_TRANSFORMERS_MODES.get(mode) for mode in modes}
    if len(found) != 1 or None in found:
        return None, False
    return found.pop(), any(t.endswith("Normalize") for t in types)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
