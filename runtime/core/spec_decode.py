"""Speculative decoding's engine side (torch-free): the n-gram proposer, the acceptance rule and the counters
behind vLLM's spec-decode metrics (the setting itself, --speculative-config, is planner/speculative.py's).

A step verifies a request's k drafted tokens in one forward: the worker scores the last known token and the
drafts (k + 1 rows), samples every row as a plain step would (the same seeded draw for the same output index),
and keeps the drafts up to the first one the target did not sample, then the target's token at that row. For
an n-gram draft (one token, probability 1) that is rejection sampling exactly: the draft is kept with the
target's probability of it, and a rejected row's sample is the target's distribution without the draft. So
greedy output is the same as without speculation, and seeded sampling too, token for token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from shardserve.planner.speculative import SpeculativeConfig
    from shardserve.runtime.core.messages import TokenLogprobs
    from shardserve.runtime.core.request import Request


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, low: int, high: int) -> tuple[int, ...]:
    """Prompt lookup: the longest suffix of `tokens` (high down to low tokens) that occurred earlier, and the
    up to k tokens that followed its latest earlier occurrence; () when no suffix recurs.

    Vectorized: the places where the last token occurred before (one comparison over the history), narrowed
    to those where the token before matches too, and so on; a match of n tokens is one of n - 1 that goes
    on, so the longest is the last length any place survives to."""
    history = np.asarray(tokens, dtype=np.int64)
    num = len(history)
    ends = np.flatnonzero(history[:num - 1] == history[num - 1]) if num > 1 else history[:0]
    best = None  # (n, the latest end of an earlier occurrence of the last n tokens)
    for n in range(1, min(high, num - 1) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[history[ends - (n - 1)] == history[num - n]]
        if not len(ends):
            break
        if n >= low:
            best = n, int(ends[-1])
    if best is None:
        return ()
    end = best[1]
    return tuple(int(t) for t in history[end + 1:end + 1 + k])


# a draft the ranks make (method draft_model): the scheduler counts it and the worker's draft model fills it in
PLACEHOLDER = -1


def propose(request: Request, spec: SpeculativeConfig, k: int) -> tuple[int, ...]:
    """Up to k drafts for a request about to decode its next token: by prompt lookup over its tokens (under a
    grammar, those it allows), or k placeholders for the ranks' draft model or head to fill (none under a grammar: the
    engine could not check drafts it has not seen)."""
    if spec.method != "ngram":  # a draft model, an EAGLE-3 head or an MTP layer on the ranks
        return () if request.sampling_params.structured_outputs is not None else (PLACEHOLDER,) * k
    if request.token_history is None:
        request.token_history = TokenHistory()
    drafts = propose_ngram(request.token_history.of(request), k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    matcher = request.grammar_matcher
    return drafts if matcher is None or not drafts else allowed_drafts(matcher, drafts)


def allowed_drafts(matcher, drafts: tuple[int, ...]) -> tuple[int, ...]:
    """A request under a grammar: its drafts up to the first the grammar refuses or that would end it, the
    matcher (xgrammar's) left where it was."""
    num = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        if matcher.is_terminated():  # (a draft that ends the grammar is not kept: the next row has no state)
            matcher.rollback(1)
            break
        num += 1
    if num:
        matcher.rollback(num)
    return drafts[:num]


def propose_ngram_reference(tokens: list[int], k: int, low: int, high: int) -> tuple[int, ...]:
    """propose_ngram as a plain loop over the history (what the tests and bench/spec_decode.py compare it with)."""
    num = len(tokens)
    for n in range(min(high, num - 1), low - 1, -1):
        suffix = tokens[num - n:]
        first = suffix[0]
        for start in range(num - n - 1, -1, -1):  # the latest start before the suffix itself
            if tokens[start] == first and tokens[start:start + n] == suffix:
                return tuple(tokens[start + n:start + n + k])
    return ()


class TokenHistory:
    """A request's tokens as one int64 array for prompt lookup, extended by the tokens added since the last
    step (they are only ever appended), so a step costs its new tokens rather than the whole history."""

    __slots__ = ("array", "size")

    def __init__(self) -> None:
        self.array, self.size = np.empty(0, dtype=np.int64), 0

    def of(self, request: Request) -> np.ndarray:
        num = request.num_tokens
        if num > len(self.array):
            grown = np.empty(max(num, 2 * len(self.array)), dtype=np.int64)
            grown[:self.size] = self.array[:self.size]
            self.array = grown
        if num > self.size:
            self.array[self.size:num] = request.token_ids_slice(self.size, num)
            self.size = num
        return self.array[:num]


@dataclass
class SpecDecodeStats:
    """vLLM's counters: drafts made, tokens drafted, tokens accepted, and accepted tokens per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


def verify(request_ids: list[str], tokens: list[int], drafts: dict[str, tuple[int, tuple[int, ...]]],
           row_logprobs: dict[int, TokenLogprobs]) -> tuple[dict, dict, dict, dict]:
    """A step's sampled rows (request id per row; k + 1 rows from its first for a request with k drafts) as
    ModelRunnerOutput's fields, each by request id: the sampled token, the accepted drafts (each kept while the
    target sampled it too; the sampled token is the target's at the first mismatch), their logprobs."""
    sampled = dict(zip(request_ids, tokens))
    logprobs = {request_ids[row]: entry for row, entry in row_logprobs.items()}
    accepted: dict[str, tuple[int, ...]] = {}
    draft_logprobs: dict[str, tuple[TokenLogprobs, ...]] = {}
    for request_id, (row, proposed) in drafts.items():
        num = 0
        while num < len(proposed) and tokens[row + num] == proposed[num]:
            num += 1
        sampled[request_id], accepted[request_id] = tokens[row + num], proposed[:num]
        if row in row_logprobs:
            logprobs[request_id] = row_logprobs[row + num]
            draft_logprobs[request_id] = tuple(row_logprobs[row + i] for i in range(num))
    return sampled, accepted, logprobs, draft_logprobs
