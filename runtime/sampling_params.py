"""How a prompt's samples are drawn and when each stops (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.runtime.structured_output import StructuredOutputs


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
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per output token
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token (vLLM's name)
    structured_outputs: StructuredOutputs | None = None  # output constrained to a grammar (xgrammar)
    skip_special_tokens: bool = True
    # token id -> added to its logit, clamped to [-100, 100]; kept as sorted (id, bias) pairs
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # normalise inputs once; the record stays frozen afterwards
        if isinstance(self.stop, str):
            set_(self, "stop", (self.stop,))
        set_(self, "stop", tuple(self.stop or ()))
        set_(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k in (-1, 0):
            set_(self, "top_k", None)
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        set_(self, "logit_bias", tuple(sorted((int(t), max(-100.0, min(100.0, float(b)))) for t, b in pairs)))
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k is None or self.top_k >= 1, f"top_k must be >= 1 or None, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}"),
            (all(self.stop), "stop strings must not be empty"),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias token ids must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
