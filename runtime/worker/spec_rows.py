"""Speculative decoding on the worker: a request's drafted tokens join its known ones for the step's inputs,
and every one of its k + 1 rows samples (runtime/core/spec_decode.py verifies them and says why that keeps
the target's distribution)."""

from __future__ import annotations

import dataclasses

import numpy as np

from shardserve.runtime.worker.inputs import HostInputs, RequestState, token_view


def add_drafts(states: dict[str, RequestState], drafts: dict[str, tuple[int, ...]]) -> None:
    for request_id, tokens in drafts.items():
        states[request_id].token_ids.extend(tokens)


def draft_rows(host: HostInputs, drafts: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, tuple[int, ...]]]:
    """With the drafts in the states' token ids (add_drafts): every row of a request with drafts samples, and
    the drafts leave the states again. Row i of such a request samples as a view of it with its first i drafts
    known (penalties, min_tokens and the seeded draw of output index n + i); row 0 is the request itself.
    Returns request id -> (its first row among the sampled ones, its drafts)."""
    indices: list[int] = []
    states: list[RequestState] = []
    first: dict[str, tuple[int, tuple[int, ...]]] = {}
    for index, state in zip(host.logits_indices.tolist(), host.sampled_states):
        tokens = drafts.get(state.request_id, ())
        k = len(tokens)
        if k:
            first[state.request_id] = (len(states), tokens)
            del state.token_ids[-k:]
            states.append(state)
            known = state.token_ids
            states.extend(dataclasses.replace(state, token_ids=token_view(known, 0, tokens[:i])) for i in range(1, k + 1))
            indices.extend(range(index - k, index + 1))
        else:
            indices.append(index)
            states.append(state)
    assert len(first) == len(drafts), "a request with drafts samples this step (they were within its budget)"
    host.logits_indices = np.asarray(indices, dtype=np.int64)
    host.sampled_states = states
    return first
