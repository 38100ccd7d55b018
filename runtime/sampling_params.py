"""How a prompt's samples are drawn and when each stops (vLLM's field names)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardserve.runtime.core.structured_output import StructuredOutputs


class InvalidSamplingParamsError(ValueError):
    """A SamplingParams value out of its range; `field` names it."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int | None = None  # None keeps all tokens (-1 and 0 are accepted as None, like vLLM)
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF style, over prompt and output tokens
    presence_penalty: float = 0.0  # OpenAI style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI style, over output tokens
    seed: int | None = None
    # NOTE: stop also takes a str or a list, stop_token_ids a list, logit_bias a dict {token id: bias}
    # (vLLM's shapes); each is normalised to the tuple declared here when the record is made
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per output token
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token (vLLM's name)
    structured_outputs: StructuredOutputs | None = None  # output constrained to a grammar (xgrammar)
    skip_special_tokens: bool = True
    # special tokens the text keeps where skip_special_tokens drops the others (a reasoning parser's markers)
    kept_special_token_ids: tuple[int, ...] = ()
    # token id -> added to its logit, clamped to [-100, 100]; kept as sorted (id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: sample only among these ids (None: all)
    # vLLM's: the logprobs of these ids at each position, in place of the top `logprobs` (then their count)
    logprob_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # normalise inputs once; the record stays frozen afterwards
        if isinstance(self.stop, str):
            set_(self, "stop", (self.stop,))
        set_(self, "stop", tuple(self.stop or ()))
        set_(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        set_(self, "kept_special_token_ids", tuple(self.kept_special_token_ids or ()))
        if self.allowed_token_ids is not None:
            set_(self, "allowed_token_ids", tuple(sorted(set(self.allowed_token_ids))))
        if self.logprob_token_ids:
            set_(self, "logprob_token_ids", tuple(self.logprob_token_ids))
            set_(self, "logprobs", len(self.logprob_token_ids))
        if self.top_k in (-1, 0):
            set_(self, "top_k", None)
        bias: Any = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias or ()
        # min over max keeps NaN as NaN (refused below); max over min would make it +100
        set_(self, "logit_bias", tuple(sorted((int(t), min(max(float(b), -100.0), 100.0)) for t, b in pairs)))
        self._validate()

    def _validate(self) -> None:
        checks = [  # (ok, field, message)
            (self.n >= 1, "n", f"n must be >= 1, got {self.n}"),
            (0.0 <= self.temperature < math.inf, "temperature",
             f"temperature must be >= 0 and finite, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k is None or self.top_k >= 1, "top_k", f"top_k must be >= 1 or None, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (0.0 < self.repetition_penalty < math.inf, "repetition_penalty",
             f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens",
             f"max_tokens must be >= 0, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", f"logprobs must be >= 0, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}"),
            (all(self.stop), "stop", "stop strings must not be empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be >= 0"),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias", "logit_bias token ids must be >= 0"),
            (not any(math.isnan(b) for _, b in self.logit_bias), "logit_bias", "logit_bias values must not be NaN"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids",
             "allowed_token_ids is not allowed to be empty"),
            (all(t >= 0 for t in self.allowed_token_ids or ()), "allowed_token_ids",
             "allowed_token_ids must be >= 0"),
            (all(t >= 0 for t in self.logprob_token_ids or ()), "logprob_token_ids", "logprob_token_ids must be >= 0"),
        ]
        for ok, field, message in checks:
            if not ok:
                raise InvalidSamplingParamsError(message, field)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
