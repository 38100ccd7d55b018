"""The client's side of a step: the engine core's token updates -> per-prompt deltas (detokenize, apply stop
strings, logprobs' text, group a prompt's samples). Each client of a core has one (runtime/llm.py's,
runtime/core/client.py's); the core never sees text."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from shardserve.runtime.detokenizer import IncrementalDetokenizer, StreamDetokenizer, make_detokenizer, special_token_ids
from shardserve.runtime.core.messages import RequestUpdate, TokenLogprobs
from shardserve.runtime.core.request import sample_request_ids
from shardserve.runtime.outputs import Logprob, PromptDelta, SampleDelta
from shardserve.runtime.pooling_params import PROMPT_ONLY, PoolingParams
from shardserve.runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class _Sample:
    """One sample of a prompt (one scheduler request): only what the next step needs."""

    prompt_id: str
    sample_index: int
    detokenizer: StreamDetokenizer | IncrementalDetokenizer | None
    num_tokens: int = 0
    held_text: str = ""  # detokenized, not yet emitted: it may begin a stop string
    is_finished: bool = False


@dataclass(slots=True)
class _Prompt:
    params: SamplingParams
    request_ids: list[str]  # one scheduler request per sample
    num_unfinished: int


class OutputProcessor:
    """NOTE: nothing here keeps a sample's text or tokens so far: each step costs the same at the
    end of a long generation as at its start (the caller accumulates deltas if it wants them)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._prompts: dict[str, _Prompt] = {}
        self._samples: dict[str, _Sample] = {}  # scheduler request id -> sample

    def add_prompt(self, prompt_id: str, params: SamplingParams | PoolingParams) -> None:
        """A prompt handed to the core: its samples' updates become its deltas from now on."""
        request_ids = sample_request_ids(prompt_id, params)
        if isinstance(params, PoolingParams):
            params = PROMPT_ONLY  # (its one update carries the vector: no text)
        self._prompts[prompt_id] = _Prompt(params, request_ids, len(request_ids))
        for index, request_id in enumerate(request_ids):
            detokenizer = None if self.tokenizer is None else self._detokenizer(params)
            self._samples[request_id] = _Sample(prompt_id, index, detokenizer)

    def _detokenizer(self, params: SamplingParams) -> StreamDetokenizer | IncrementalDetokenizer:
        """With kept_special_token_ids, skip_special_tokens drops every special token but those."""
        if params.skip_special_tokens and params.kept_special_token_ids:
            return make_detokenizer(self.tokenizer, False, self._special_ids - set(params.kept_special_token_ids))
        return make_detokenizer(self.tokenizer, params.skip_special_tokens)

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return special_token_ids(self.tokenizer)

    def has_prompt(self, prompt_id: str) -> bool:
        return prompt_id in self._prompts

    def abort(self, prompt_id: str) -> None:
        """Forget the prompt: no more deltas (a finished one is forgotten already)."""
        prompt = self._prompts.pop(prompt_id, None)
        for request_id in prompt.request_ids if prompt else ():
            self._samples.pop(request_id, None)

    def process(self, updates: list[RequestUpdate]) -> tuple[list[PromptDelta], list[str]]:
        """Returns a delta per prompt that advanced, and the requests a stop string ended (the client tells
        its core to stop them: until it has, their later updates are dropped here)."""
        grouped: dict[str, list[SampleDelta]] = {}
        stopped = []
        for update in updates:
            sample = self._samples.get(update.request_id)
            if sample is None or sample.is_finished:
                continue
            prompt = self._prompts[sample.prompt_id]
            delta = self._sample_delta(sample, prompt.params, update)
            if delta.finish_reason is not None:
                prompt.num_unfinished -= 1
                if update.finish_reason is None:
                    stopped.append(update.request_id)
            grouped.setdefault(sample.prompt_id, []).append(delta)
        deltas = []
        for prompt_id, samples in grouped.items():
            finished = self._prompts[prompt_id].num_unfinished == 0
            if finished:
                self.abort(prompt_id)  # forget it
            deltas.append(PromptDelta(prompt_id, tuple(samples), finished))
        return deltas, stopped

    def _sample_delta(self, sample: _Sample, params: SamplingParams, update: RequestUpdate) -> SampleDelta:
        token_ids = update.new_token_ids
        sample.num_tokens += len(token_ids)
        if (len(token_ids) == 1 and update.finish_reason is None and not params.stop and params.logprobs is None
                and not update.new_prompt_logprobs and sample.detokenizer is not None):
            # the common step (one token, nothing to search or score): constant work per token
            return SampleDelta(sample.sample_index, token_ids, sample.detokenizer.push(token_ids[0]), None, None, None,
                               update.times, None, num_cached_tokens=update.num_cached_tokens)
        if update.pooled is not None:  # a pooling prompt's one update: its vector, no tokens, no text
            sample.is_finished = True
            return SampleDelta(sample.sample_index, (), "", None, update.finish_reason, None, update.times,
                               pooled=update.pooled)
        finish_reason, stop_reason = update.finish_reason, update.stop_reason
        text, stop = self._new_text(sample, params, update.new_token_ids, finish_reason is not None)
        if stop is not None:
            finish_reason, stop_reason = "stop", stop
        sample.is_finished = finish_reason is not None
        logprobs = None if params.logprobs is None else self._logprob_dicts(update.new_logprobs)
        prompt_logprobs = self._logprob_dicts(update.new_prompt_logprobs) if update.new_prompt_logprobs else None
        return SampleDelta(sample.sample_index, update.new_token_ids, text, logprobs, finish_reason, stop_reason,
                           update.times, prompt_logprobs, num_cached_tokens=update.num_cached_tokens,
                           spec_counts=update.spec_counts)

    @staticmethod
    def _new_text(sample: _Sample, params: SamplingParams, token_ids: tuple[int, ...],
                  is_last: bool) -> tuple[str, str | None]:
        """The text to emit now, and the stop string that ended the sample here, if any.
        NOTE: while a sample with stop strings runs, its last (longest stop - 1) characters are held
        back, so streamed text never shows a stop string's beginning that is later cut off. A stop
        string found now must end in the new text, so it lies within held + new text: the search
        never looks further back."""
        if sample.detokenizer is None:
            return "", None
        pieces = [sample.detokenizer.push(token) for token in token_ids]
        if is_last:
            pieces.append(sample.detokenizer.flush())
        text, sample.held_text = sample.held_text + "".join(pieces), ""
        if not params.stop:
            return text, None
        if sample.num_tokens >= params.min_tokens:
            found = min(((text.find(s), s) for s in params.stop if s in text), default=None)
            if found is not None:
                index, stop = found
                return text[: index + (len(stop) if params.include_stop_str_in_output else 0)], stop
        if is_last:
            return text, None
        num_held = min(len(text), max(len(s) for s in params.stop) - 1)
        sample.held_text = text[len(text) - num_held:]
        return text[: len(text) - num_held], None

    def _logprob_dicts(self, entries: tuple[TokenLogprobs, ...]) -> tuple[dict[int, Logprob], ...]:
        """{token: Logprob}: the top-k by rank, plus the sampled token (with its own rank) if not among them."""
        result = []
        for entry in entries:
            sampled, top = entry.token_ids[0], zip(entry.token_ids[1:], entry.logprobs[1:])
            ranked = {token: Logprob(value, rank, self._token_text(token))
                      for rank, (token, value) in enumerate(top, start=1)}
            if sampled not in ranked:
                ranked[sampled] = Logprob(entry.logprobs[0], entry.sampled_rank, self._token_text(sampled))
            result.append(ranked)
        return tuple(result)

    def _token_text(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])
