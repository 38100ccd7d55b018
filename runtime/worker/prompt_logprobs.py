"""Log-probabilities of prompt tokens (vLLM's prompt_logprobs), scored in the prefill that reads them.

Within a step, request r's chunk holds positions [first, first + num_new). The logits at position p
score prompt token p + 1, so the chunk scores prompt tokens first + 1 .. min(first + num_new,
num_prompt_tokens - 1); token 0 has no score. Chunked prefill scores the prompt piece by piece."""

from __future__ import annotations

import numpy as np
import torch

from shardserve.runtime.worker.inputs import HostInputs, RequestState, host_to_device
from shardserve.runtime.core.messages import TokenLogprobs
from shardserve.runtime.worker.sampler import token_logprobs


def wants_prompt_logprobs(batch: list[RequestState]) -> bool:
    return any(state.sampling_params.prompt_logprobs is not None for state in batch)


def score_prompts(model, host: HostInputs, batch: list[RequestState], hidden: torch.Tensor,
                  is_output_rank: bool) -> dict[str, tuple[int, tuple[TokenLogprobs, ...]]]:
    """request id -> (first prompt token scored, entries); every TP rank of the last stage calls it
    (the logits gather is a collective), the output rank alone gets the entries."""
    rows: list[int] = []  # the hidden rows scored
    targets: list[int] = []  # the prompt token each row scores
    wanted: list[int] = []  # top tokens to report per row
    spans: list[tuple[str, int, int]] = []  # (request id, first prompt position scored, count)
    starts = host.query_start_loc
    for row, state in enumerate(batch):
        k = state.sampling_params.prompt_logprobs
        first = int(host.positions[starts[row]])
        last = min(first + int(starts[row + 1] - starts[row]), state.num_prompt_tokens - 1)
        if k is None or last <= first:
            continue
        rows.extend(range(int(starts[row]), int(starts[row]) + last - first))
        targets.extend(state.token_ids[first + 1:last + 1])
        wanted.extend([k] * (last - first))
        spans.append((state.request_id, first + 1, last - first))
    if not rows:
        return {}
    logits = model.compute_logits(hidden[host_to_device(np.array(rows, dtype=np.int64), hidden.device)])
    if not is_output_rank:
        return {}
    entries = token_logprobs(logits, host_to_device(np.array(targets, dtype=np.int64), hidden.device), wanted)
    out, at = {}, 0
    for request_id, start, count in spans:
        out[request_id] = (start, tuple(entries[at:at + count]))
        at += count
    return out
