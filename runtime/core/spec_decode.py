"""Speculative decoding's engine side (torch-free): the n-gram proposer, the acceptance rule and the counters
behind vLLM's spec-decode metrics (the setting itself, --speculative-config, is planner/speculative.py's).

A step verifies a request's k drafted tokens in one forward: the worker scores the last known token and the
drafts (k + 1 rows), samples every row as a plain step would (the same seeded draw for the same output index),
and keeps the drafts up to the first one the target did not sample, then the target's token at that row. For
an n-gram draft (one token, probability 1) that is rejection sampling exactly: the draft is kept with the
target's probability of it, and a rejected row's sample is the target's distribution without the draft. So
greedy output is the same as without speculation, and seeded sampling too, token for token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardserve.runtime.core.messages import TokenLogprobs


def propose_ngram(tokens: list[int], k: int, low: int, high: int) -> tuple[int, ...]:
    """Prompt lookup: the longest suffix of `tokens` (high down to low tokens) that occurred earlier, and the
    up to k tokens that followed its latest earlier occurrence; () when no suffix recurs."""
    num = len(tokens)
    for n in range(min(high, num - 1), low - 1, -1):
        suffix = tokens[num - n:]
        first = suffix[0]
        # the latest start before the suffix itself, so the continuation is the most recent one
        for start in range(num - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == suffix:
                return tuple(tokens[start + n:start + n + k])
    return ()


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
