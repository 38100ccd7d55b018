"""Turn per-step token updates into user outputs: detokenize, apply stop strings, group n samples."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardserve.runtime.detokenizer import IncrementalDetokenizer
from shardserve.runtime.messages import RequestUpdate, TokenLogprobs
from shardserve.runtime.outputs import CompletionOutput, Logprob, RequestOutput
from shardserve.runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class _Sample:
    """One of the n samples of a request (one scheduler request)."""

    completion: CompletionOutput  # what users see; its text may lag `text` (see _apply)
    detokenizer: IncrementalDetokenizer | None
    text: str = ""  # everything detokenized so far


@dataclass(slots=True)
class _Parent:
    output: RequestOutput
    params: SamplingParams
    samples: dict[str, _Sample] = field(default_factory=dict)  # scheduler request id -> sample


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._parent_of: dict[str, str] = {}  # scheduler request id -> user request id

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, sample_ids: list[str]) -> None:
        parent = _Parent(RequestOutput(request_id, prompt, list(prompt_token_ids)), params)
        for index, sample_id in enumerate(sample_ids):
            completion = CompletionOutput(index=index, text="", token_ids=[], finish_reason=None,
                                          logprobs=[] if params.logprobs is not None else None)
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            parent.samples[sample_id] = _Sample(completion, detokenizer)
            parent.output.outputs.append(completion)
            self._parent_of[sample_id] = request_id
        self._parents[request_id] = parent

    def sample_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.samples) if parent else []

    def abort(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        for sample_id in parent.samples if parent else ():
            self._parent_of.pop(sample_id, None)

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of requests that changed, and the scheduler requests a stop string
        ended (the scheduler must finish those)."""
        touched: dict[str, _Parent] = {}
        stopped = []
        for update in updates:
            parent_id = self._parent_of.get(update.request_id)
            if parent_id is None:
                continue
            parent = self._parents[parent_id]
            if self._apply(parent, parent.samples[update.request_id], update):
                stopped.append(update.request_id)
            touched[parent_id] = parent
        results = []
        for parent_id, parent in touched.items():
            parent.output.finished = all(s.completion.is_finished for s in parent.samples.values())
            if parent.output.finished:
                self.abort(parent_id)  # forget it
            results.append(_snapshot(parent.output))
        return results, stopped

    def _apply(self, parent: _Parent, sample: _Sample, update: RequestUpdate) -> bool:
        """Append one update to a sample; True if a stop string ended it here.
        NOTE: while a request with stop strings runs, its visible text holds back the last
        (longest stop - 1) characters, so streamed text never shows a stop string's beginning
        that is later cut off."""
        completion, params = sample.completion, parent.params
        completion.token_ids.extend(update.new_token_ids)
        if completion.logprobs is not None:
            completion.logprobs.extend(self._logprob_dicts(update.new_logprobs))
        if update.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = update.finish_reason, update.stop_reason
        if sample.detokenizer is None:
            return False
        old_length = len(sample.text)
        sample.text += "".join(sample.detokenizer.push(token) for token in update.new_token_ids)
        if update.finish_reason is not None:
            sample.text += sample.detokenizer.flush()
        stopped = False
        if params.stop and len(completion.token_ids) >= params.min_tokens:
            stopped = self._apply_stop_strings(sample, params, old_length)
        hold = max(len(s) for s in params.stop) - 1 if params.stop and not completion.is_finished else 0
        completion.text = sample.text[: len(sample.text) - hold]
        return stopped and update.finish_reason is None

    @staticmethod
    def _apply_stop_strings(sample: _Sample, params: SamplingParams, old_length: int) -> bool:
        longest = max(len(s) for s in params.stop)
        search_from = max(0, old_length - longest + 1)
        found = [(sample.text.find(s, search_from), s) for s in params.stop]
        found = [(i, s) for i, s in found if i >= 0]
        if not found:
            return False
        index, stop = min(found)
        sample.text = sample.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
        sample.completion.finish_reason, sample.completion.stop_reason = "stop", stop
        return True

    def _logprob_dicts(self, entries: tuple[TokenLogprobs, ...]) -> list[dict[int, Logprob]]:
        """{token: Logprob}: the top-k by rank, plus the sampled token (with its own rank) if not among them."""
        result = []
        for entry in entries:
            sampled, top = entry.token_ids[0], zip(entry.token_ids[1:], entry.logprobs[1:])
            ranked = {token: Logprob(value, rank, self._token_text(token))
                      for rank, (token, value) in enumerate(top, start=1)}
            if sampled not in ranked:
                ranked[sampled] = Logprob(entry.logprobs[0], entry.sampled_rank, self._token_text(sampled))
            result.append(ranked)
        return result

    def _token_text(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])


def _snapshot(output: RequestOutput) -> RequestOutput:
    """A copy the caller may keep while the live one keeps growing."""
    completions = [CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason,
                                    None if c.logprobs is None else list(c.logprobs), c.stop_reason)
                   for c in output.outputs]
    return RequestOutput(output.request_id, output.prompt, output.prompt_token_ids, completions, output.finished)
