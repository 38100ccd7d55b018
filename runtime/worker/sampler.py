"""Turn a batch's last-token logits into next tokens (and the log-probabilities asked for).

Order: penalties, min_tokens mask, then greedy argmax or temperature -> top-k -> top-p -> min-p ->
a seeded draw. Everything per token stays on the logits' device; the common path (no penalties,
no min_tokens, no logprobs) makes one host->device copy of the per-request parameters and one
device->host copy of the sampled ids."""

from __future__ import annotations

from typing import cast

import numpy as np
import torch

from shardserve.runtime.worker.inputs import RequestState, host_to_device
from shardserve.runtime.core.messages import TokenLogprobs
from shardserve.runtime.worker.sampling_batch import BatchSampling, SamplingCache, SamplingTensors

_MASK = float("-inf")


def sample(logits: torch.Tensor, states: list[RequestState],
           token_bitmask: torch.Tensor | None = None) -> tuple[list[int], dict[str, TokenLogprobs]]:
    """logits: [num_sampled, vocab_size] float32, rows in the order of `states`; token_bitmask:
    xgrammar's [rows, vocab / 32] allowed tokens of constrained rows (logprobs stay the raw ones)."""
    tokens = sample_on_device(logits, states, token_bitmask)
    token_list = tokens.tolist()  # the step's one device->host copy
    return token_list, sampled_logprobs(logits, states, tokens)


def _batch(states: list[RequestState], vocab_size: int, cache: SamplingCache | None) -> BatchSampling:
    return BatchSampling(states, vocab_size) if cache is None else cache.get(states, vocab_size)


def sample_on_device(logits: torch.Tensor, states: list[RequestState], token_bitmask: torch.Tensor | None = None,
                     cache: SamplingCache | None = None) -> torch.Tensor:
    """[num_sampled] int64 token ids on the logits' device. Without penalties or min_tokens it waits
    for nothing on the device: the decisions on the host come from the sampling parameters alone
    (made once per batch composition with a `cache`)."""
    batch = _batch(states, logits.shape[1], cache)
    if (token_bitmask is not None or batch.has_static_edits
            or (batch.has_min_tokens and any(_masks_stop_tokens(s) for s in states))):
        logits = logits.clone()
        _apply_penalties(logits, states)
        _apply_logit_bias(logits, states)
        _keep_allowed_tokens(logits, states)
        _mask_stop_tokens_before_min(logits, states)
        if token_bitmask is not None:
            import xgrammar as xgr
            xgr.apply_token_bitmask_inplace(logits, token_bitmask.to(logits.device, non_blocking=True))
    tokens = logits.argmax(dim=-1)
    if batch.is_all_greedy:
        return tokens
    params = batch.tensors(states, logits.device)
    return torch.where(params.is_greedy, tokens, _sample_random(logits, params))


def _masks_stop_tokens(state: RequestState) -> bool:
    return state.num_output_tokens < state.sampling_params.min_tokens and bool(state.stop_token_ids)


def _apply_penalties(logits: torch.Tensor, states: list[RequestState]) -> None:
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


def _apply_logit_bias(logits: torch.Tensor, states: list[RequestState]) -> None:
    """OpenAI's logit_bias, added before greedy and sampling alike (+100 forces a token, -100 bans it);
    every row's biases go to the device in one copy."""
    rows, tokens, biases = [], [], []
    for row, state in enumerate(states):
        for token, bias in state.sampling_params.logit_bias:
            rows.append(row)
            tokens.append(token)
            biases.append(bias)
    if rows:
        packed = host_to_device(np.array([rows, tokens, biases], dtype=np.float64), logits.device)
        logits.index_put_((packed[0].long(), packed[1].long()), packed[2].to(logits.dtype), accumulate=True)


def _keep_allowed_tokens(logits: torch.Tensor, states: list[RequestState]) -> None:
    """vLLM's allowed_token_ids: every other token of the row masked out."""
    for row, state in enumerate(states):
        allowed = state.sampling_params.allowed_token_ids
        if allowed:
            keep = torch.tensor(allowed, device=logits.device)
            kept = logits[row, keep]
            logits[row] = _MASK
            logits[row, keep] = kept


def _mask_stop_tokens_before_min(logits: torch.Tensor, states: list[RequestState]) -> None:
    for row, state in enumerate(states):
        if state.num_output_tokens < state.sampling_params.min_tokens and state.stop_token_ids:
            ids = [t for t in state.stop_token_ids if t < logits.shape[1]]
            logits[row, ids] = _MASK


def _sample_random(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    logits = logits / params.temperature[:, None]
    if params.top_p is not None:
        logits = _top_k_top_p(logits, params.top_k, params.top_p)
    elif params.top_k is not None:
        assert params.max_top_k is not None  # known whenever top_k is
        logits = _top_k(logits, params.top_k, params.max_top_k)
    probs = torch.softmax(logits, dim=-1)
    if params.min_p is not None:
        threshold = params.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    # Inverse CDF with one seeded uniform per row, in float32. NOTE: the draw is scaled below the
    # row's total (u <= 1 - 2^-23 keeps target < cdf[-1] after rounding), so right=True always lands
    # on a step of the CDF: a token of non-zero probability.
    cdf = probs.cumsum(dim=-1)  # [rows, vocab] float32
    uniform = params.uniform.clamp(max=1.0 - 2.0**-23).to(cdf.dtype)
    targets = uniform[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's top_k logits (ties at the k-th kept). NOTE: topk(max_top_k), not a sort of
    the whole vocabulary: a batch's largest k is known on the host."""
    largest = logits.topk(max_top_k, dim=-1).values  # [rows, max_top_k], descending
    kth = largest.gather(1, (top_k - 1)[:, None])  # [rows, 1]
    return logits.masked_fill(logits < kth, _MASK)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """NOTE: one sort serves both filters: masking the top-k tail moves no token, so the sorted
    order stays valid for the top-p mass that follows."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1)[:, None])  # [rows, 1]
        logits = logits.masked_fill(logits < kth, _MASK)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _MASK)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        # the first token is always kept; top_p = 1 keeps all, even where rounding sums past 1
        drop_sorted = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), _MASK)
    return logits


def sampled_logprobs(raw: torch.Tensor, states: list[RequestState], tokens: torch.Tensor,
                     cache: SamplingCache | None = None) -> dict[str, TokenLogprobs]:
    """Log-probabilities under the model's raw distribution (before penalties and temperature),
    for the rows that ask, computed together and copied to the host once."""
    return {states[row].request_id: entry for row, entry in logprobs_by_row(raw, states, tokens, cache).items()}


def logprobs_by_row(raw: torch.Tensor, states: list[RequestState], tokens: torch.Tensor,
                    cache: SamplingCache | None = None) -> dict[int, TokenLogprobs]:
    """sampled_logprobs by row (a request with drafts has several)."""
    rows = _batch(states, raw.shape[1], cache).logprob_rows
    if not rows:
        return {}
    index = host_to_device(np.array(rows, dtype=np.int64), raw.device)
    wanted = cast("list[int]", [states[row].sampling_params.logprobs for row in rows])  # rows that ask: no None
    listed = [states[row].sampling_params.logprob_token_ids for row in rows]
    entries = token_logprobs(raw[index], tokens[index], wanted, listed if any(listed) else None)
    return dict(zip(rows, entries))


def token_logprobs(raw: torch.Tensor, chosen: torch.Tensor, wanted: list[int],
                   listed: list[tuple[int, ...] | None] | None = None) -> list[TokenLogprobs]:
    """raw: [rows, vocab] logits; chosen: [rows] the token each row scores; wanted[i]: how many of
    row i's most likely tokens to add, or with listed[i] (vLLM's logprob_token_ids) those ids, in their
    order. One copy to the host for all rows.
    NOTE: ranks and the order of the top tokens come from the raw scores with ties going to the lower
    id, as greedy's argmax picks: greedy is always the top-1 it reports, even at bf16 ties."""
    scores = raw.float()  # [rows, vocab]
    logprobs = torch.log_softmax(scores, dim=-1)
    chosen_score = scores.gather(1, chosen[:, None])  # [rows, 1]
    vocab_ids = torch.arange(scores.shape[1], device=scores.device)
    tied_before = (scores == chosen_score) & (vocab_ids[None, :] < chosen[:, None])
    ranks = (scores > chosen_score).sum(dim=-1, keepdim=True) + tied_before.sum(dim=-1, keepdim=True) + 1
    k = max(wanted)
    top_ids = _top_ids(scores, k)  # [rows, k]
    if listed is not None:  # rows naming their ids take those in place of their best
        rows = [(row, ids) for row, ids in enumerate(listed) if ids]
        named = np.array([list(ids) + [ids[0]] * (k - len(ids)) for _, ids in rows], dtype=np.int64)
        top_ids[[row for row, _ in rows]] = host_to_device(named, scores.device)
    # [rows, 3 + 2k] float64: token, logprob, rank, top ids, top logprobs (ids are exact below 2^53)
    packed = torch.cat([chosen[:, None].double(), logprobs.gather(1, chosen[:, None]).double(), ranks.double(),
                        top_ids.double(), logprobs.gather(1, top_ids).double()], dim=1).tolist()
    result = []
    for values, num in zip(packed, wanted):
        ids = (int(values[0]),) + tuple(int(i) for i in values[3: 3 + num])
        logs = (values[1],) + tuple(values[3 + k: 3 + k + num])
        result.append(TokenLogprobs(ids, logs, int(values[2])))
    return result


def _top_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best ids of each row, by score then by lower id (topk, then a sort of k, not of the vocabulary)."""
    candidates = scores.topk(k, dim=-1).indices.sort(dim=-1).values  # ascending ids
    order = scores.gather(1, candidates).sort(dim=-1, descending=True, stable=True).indices
    return candidates.gather(1, order)
