"""Turn a batch's last-token logits into next tokens (and the log-probabilities asked for).

Order: penalties, min_tokens mask, then greedy argmax or temperature -> top-k -> top-p -> min-p ->
a seeded draw."""

from __future__ import annotations

import torch

from shardserve.runtime.inputs import RequestState
from shardserve.runtime.messages import TokenLogprobs

_MASK = float("-inf")


def sample_seed(seed: int, step: int) -> int:
    """NOTE: each draw is seeded from (request seed, output index) alone, so a request samples the
    same tokens whatever it is batched with and even after preemption and recompute."""
    return (seed * 1_000_003 + step) % (2**63 - 1)


def sample(logits: torch.Tensor, states: list[RequestState]) -> tuple[list[int], dict[str, TokenLogprobs]]:
    """logits: [num_sampled, vocab_size] float32, rows in the order of `states`."""
    raw = logits
    logits = _apply_penalties(logits.clone(), states)
    _mask_stop_tokens_before_min(logits, states)
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, s in enumerate(states) if not s.sampling_params.is_greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        chosen = _sample_random(logits[index], [states[i] for i in random_rows])
        tokens[index] = chosen
    token_list = tokens.tolist()
    return token_list, _logprobs(raw, states, token_list)


def _apply_penalties(logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
    for row, state in enumerate(states):  # NOTE: per row; only rows with penalties pay for it
        params = state.sampling_params
        if not params.has_penalties:
            continue
        vocab = logits.shape[1]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in state.token_ids if t < vocab}), device=logits.device)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / params.repetition_penalty,
                                            values * params.repetition_penalty)
        outputs = [t for t in state.token_ids[state.num_prompt_tokens:] if t < vocab]
        if outputs and (params.presence_penalty or params.frequency_penalty):
            counts = torch.bincount(torch.tensor(outputs, device=logits.device), minlength=vocab).to(logits.dtype)
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _mask_stop_tokens_before_min(logits: torch.Tensor, states: list[RequestState]) -> None:
    for row, state in enumerate(states):
        if state.num_output_tokens < state.sampling_params.min_tokens and state.stop_token_ids:
            ids = [t for t in state.stop_token_ids if t < logits.shape[1]]
            logits[row, ids] = _MASK


def _sample_random(logits: torch.Tensor, states: list[RequestState]) -> torch.Tensor:
    temperature = torch.tensor([s.sampling_params.temperature for s in states], device=logits.device)
    logits = logits / temperature[:, None]
    logits = _top_k(logits, [s.sampling_params.top_k for s in states])
    logits = _top_p(logits, [s.sampling_params.top_p for s in states])
    probs = torch.softmax(logits, dim=-1)
    probs = _min_p(probs, [s.sampling_params.min_p for s in states])
    # Inverse CDF with one uniform per row, drawn on the CPU from (seed, output index): cheap, and
    # the same draw on every device. right=True never lands on a zero-probability token.
    uniforms = [torch.rand(1, generator=torch.Generator().manual_seed(sample_seed(s.seed, s.num_output_tokens)),
                           dtype=torch.float64).item() for s in states]
    cdf = probs.double().cumsum(dim=-1)  # [rows, vocab]
    targets = torch.tensor(uniforms, dtype=torch.float64, device=probs.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _top_k(logits: torch.Tensor, top_k: list[int | None]) -> torch.Tensor:
    if all(k is None for k in top_k):
        return logits
    vocab = logits.shape[1]
    k = torch.tensor([min(k or vocab, vocab) for k in top_k], device=logits.device)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])  # [rows, 1]
    return logits.masked_fill(logits < kth, _MASK)


def _top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_p):
        return logits
    p = torch.tensor(top_p, device=logits.device)[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    drop_sorted = mass_before >= p  # the first token is always kept
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, _MASK)


def _min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    if all(m == 0.0 for m in min_p):
        return probs
    threshold = torch.tensor(min_p, device=probs.device)[:, None] * probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < threshold, 0.0)


def _logprobs(raw: torch.Tensor, states: list[RequestState], tokens: list[int]) -> dict[str, TokenLogprobs]:
    """Log-probabilities under the model's raw distribution (before penalties and temperature)."""
    rows = [i for i, s in enumerate(states) if s.sampling_params.logprobs is not None]
    result = {}
    if not rows:
        return result
    logprobs = torch.log_softmax(raw[rows].float(), dim=-1)
    for local, row in enumerate(rows):
        k = states[row].sampling_params.logprobs
        sampled = logprobs[local, tokens[row]]
        rank = int((logprobs[local] > sampled).sum()) + 1
        top = logprobs[local].topk(k) if k else None
        ids = (tokens[row],) + (tuple(top.indices.tolist()) if top is not None else ())
        values = (float(sampled),) + (tuple(top.values.tolist()) if top is not None else ())
        result[states[row].request_id] = TokenLogprobs(ids, values, rank)
    return result
