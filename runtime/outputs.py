"""What the engine gives back: per-step deltas of each prompt's samples, and the complete outputs built from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from shardserve.runtime.input_processor import ProcessedPrompt
    from shardserve.runtime.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1-based rank under the model's raw distribution
    decoded_token: str | None = None


@dataclass(slots=True, frozen=True)
class SampleTimes:
    """Where a sample's time went before its first token (vLLM's queue and prefill times)."""

    queue_s: float  # arrival -> first scheduled
    prefill_s: float  # first scheduled -> first token (chunked prefill and preemptions included)


@dataclass(slots=True)
class SampleDelta:
    """What one sample gained in one step; its size does not grow with the generation. Read-only
    by convention (NOTE: not frozen, as messages.CachedRequestData says why: one per sample per step)."""

    sample_index: int  # 0 .. n-1 within its prompt
    new_token_ids: tuple[int, ...]
    new_text: str  # may be "" while text is held back (an unfinished character, a possible stop string)
    new_logprobs: tuple[dict[int, Logprob], ...] | None  # one per new token, when logprobs were asked
    finish_reason: str | None = None  # "stop" or "length" on the sample's last delta
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    times: SampleTimes | None = None  # on the delta that carries the sample's first token
    new_prompt_logprobs: tuple[dict[int, Logprob], ...] | None = None  # prompt tokens scored this step
    num_cached_tokens: int | None = None  # with the first token: prompt tokens the prefix cache served
    pooled: np.ndarray | None = None  # a pooling prompt's vector ([hidden_size] float32), on its one delta
    spec_counts: tuple[int, int, int] | None = None  # on the last delta, drafting: (verify steps, drafts, kept)


@dataclass(slots=True)
class PromptDelta:
    """The samples of one prompt that advanced in one step."""

    prompt_id: str
    samples: tuple[SampleDelta, ...]
    finished: bool  # every sample has finished: the prompt's last delta


@dataclass(slots=True)
class CompletionOutput:
    index: int  # the sample index
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list[dict[int, Logprob]] | None = None  # per output token, when requested
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    cumulative_logprob: float | None = None  # sum over the sampled tokens, when logprobs were asked

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """One prompt, complete: one CompletionOutput per sample (vLLM's shape; request_id is the prompt's id)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # per prompt token when prompt_logprobs was asked: None for the first, then {token: Logprob}
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served (the first sample's)


class RequestOutputBuilder:
    """Folds one prompt's deltas into its RequestOutput (LLM.generate, non-streamed responses)."""

    def __init__(self, prompt_id: str, prompt: ProcessedPrompt, params: SamplingParams):
        completions = [CompletionOutput(i, "", [], None, [] if params.logprobs is not None else None)
                       for i in range(params.n)]
        self.output = RequestOutput(prompt_id, prompt.prompt, list(prompt.prompt_token_ids), completions,
                                    prompt_logprobs=None if params.prompt_logprobs is None else [None])
        self._texts: list[list[str]] = [[] for _ in range(params.n)]  # joined once, in build()

    def add(self, delta: PromptDelta) -> None:
        for sample in delta.samples:
            completion = self.output.outputs[sample.sample_index]
            if sample.new_prompt_logprobs and sample.sample_index == 0:  # every sample scores the same prompt
                assert self.output.prompt_logprobs is not None  # made a list: the params ask for them
                self.output.prompt_logprobs.extend(sample.new_prompt_logprobs)
            if sample.num_cached_tokens is not None and sample.sample_index == 0:
                self.output.num_cached_tokens = sample.num_cached_tokens
            completion.token_ids.extend(sample.new_token_ids)
            self._texts[sample.sample_index].append(sample.new_text)
            if completion.logprobs is not None and sample.new_logprobs:
                completion.logprobs.extend(sample.new_logprobs)
                completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + sum(
                    entries[token].logprob for token, entries in zip(sample.new_token_ids, sample.new_logprobs))
            if sample.finish_reason is not None:
                completion.finish_reason, completion.stop_reason = sample.finish_reason, sample.stop_reason
        self.output.finished = delta.finished

    def build(self) -> RequestOutput:
        for completion, pieces in zip(self.output.outputs, self._texts):
            completion.text += "".join(pieces)
            pieces.clear()
        return self.output


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # the pooled (and, as asked, normalized) final hidden state: [hidden_size]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """One pooled prompt (vLLM's shape: LLM.embed's result; request_id is the prompt's id)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def embedding_output(prompt_id: str, prompt: ProcessedPrompt, delta: PromptDelta) -> EmbeddingRequestOutput:
    """A pooling prompt's one delta as its output."""
    pooled = delta.samples[0].pooled
    if pooled is None:
        raise ValueError(f"prompt {prompt_id!r} ended without a pooled vector")
    return EmbeddingRequestOutput(prompt_id, list(prompt.prompt_token_ids), EmbeddingOutput(pooled.tolist()))
