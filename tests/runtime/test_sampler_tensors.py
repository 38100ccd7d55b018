"""The sampler's batched pieces on plain tensors: seeded uniforms, one-sort top-k/top-p, mixed batches, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve.runtime.worker.inputs import RequestState
from shardserve.runtime.worker.sampler import _sample_random, _top_k, _top_k_top_p, sample, sample_on_device
from shardserve.runtime.worker.sampling_batch import SamplingTensors, sample_seed, seeded_uniforms
from shardserve.runtime.sampling_params import SamplingParams

VOCAB = 50


def state(params: SamplingParams, seed: int = 0, index: int = 0) -> RequestState:
    return RequestState(f"r{index}", [1, 2, 3], 3, params, seed, frozenset(), [0], 2)


def test_seeded_uniforms_are_deterministic_and_uniform():
    seeds = np.array([sample_seed(s, step) for s in range(100) for step in range(100)], dtype=np.uint64)
    draws = seeded_uniforms(seeds)
    assert np.array_equal(draws, seeded_uniforms(seeds))
    assert draws.min() >= 0.0 and draws.max() < 1.0
    counts = np.histogram(draws, bins=10, range=(0, 1))[0]
    assert counts.min() > 850 and counts.max() < 1150  # 1000 expected per bin
    assert len(np.unique(draws)) == len(draws)


def reference_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Two sorts, row by row: the tokens below the k-th best, then those past the top_p mass."""
    out = logits.clone()
    for row, (k, p) in enumerate(zip(top_k, top_p)):
        kth = logits[row].sort(descending=True).values[k - 1]
        out[row][logits[row] < kth] = float("-inf")
        values, order = out[row].sort(descending=True)
        probs = values.softmax(dim=-1)
        drop = ((probs.cumsum(dim=-1) - probs) >= p) & (p < 1.0)
        out[row][order[drop]] = float("-inf")
    return out


def test_one_sort_top_k_top_p_matches_two_sorts():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    top_k, top_p = [VOCAB, 5, 1, 20, VOCAB, 3], [1.0, 1.0, 0.9, 0.5, 0.2, 0.99]
    actual = _top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p))
    expected = reference_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(actual.isinf(), expected.isinf())
    assert torch.equal(actual[~actual.isinf()], logits[~expected.isinf()])
    assert (~actual.isinf()).sum(dim=-1).tolist()[:3] == [VOCAB, 5, 1]  # control: the filters cut


def test_parameters_travel_as_one_block():
    states = [state(SamplingParams(temperature=0.0)), state(SamplingParams(temperature=0.5, top_k=7), 9),
              state(SamplingParams(temperature=2.0, top_p=0.3, min_p=0.1), 4)]
    params = SamplingTensors.from_states(states, VOCAB, torch.device("cpu"))
    assert params.temperature.tolist() == [1.0, 0.5, 2.0]  # greedy rows divide by 1
    assert params.top_k.tolist() == [VOCAB, 7, VOCAB]
    assert params.top_p.tolist() == pytest.approx([1.0, 1.0, 0.3])
    assert params.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert params.is_greedy.tolist() == [True, False, False]
    assert params.uniform[1].item() == seeded_uniforms(np.array([sample_seed(9, 0)], dtype=np.uint64))[0]
    plain = SamplingTensors.from_states(states[:1], VOCAB, torch.device("cpu"))
    assert plain.top_k is None and plain.top_p is None and plain.min_p is None


def test_mixed_batch_keeps_greedy_rows_greedy_and_draws_the_rest():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)] * 2 + \
             [SamplingParams(temperature=5.0, seed=s) for s in range(4)]
    states = [state(p, seed=i, index=i) for i, p in enumerate(params)]
    tokens = sample_on_device(logits, states)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(tokens[:4], argmax[:4])
    assert not torch.equal(tokens[4:], argmax[4:]), "control: hot rows should leave the argmax somewhere"
    assert torch.equal(tokens, sample_on_device(logits, states))  # seeded: the same draw again


def test_logprobs_of_several_rows_come_back_together():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    states = [state(SamplingParams(temperature=0.0, logprobs=2), index=0),
              state(SamplingParams(temperature=0.0), index=1),
              state(SamplingParams(temperature=1.0, logprobs=0, seed=3), index=2)]
    tokens, logprobs = sample(logits, states)
    assert set(logprobs) == {"r0", "r2"}
    expected = torch.log_softmax(logits, dim=-1)
    first = logprobs["r0"]
    assert first.token_ids[0] == tokens[0] and first.sampled_rank == 1
    assert list(first.token_ids[1:]) == expected[0].topk(2).indices.tolist()
    assert first.logprobs == pytest.approx([expected[0, tokens[0]].item()] + expected[0].topk(2).values.tolist())
    third = logprobs["r2"]
    assert third.token_ids == (tokens[2],) and third.logprobs == pytest.approx((expected[2, tokens[2]].item(),))
    assert third.sampled_rank == int((expected[2] > expected[2, tokens[2]]).sum()) + 1


def test_top_k_alone_needs_no_sort_and_matches_the_reference():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    top_k = [VOCAB, 5, 1, 20, 3]
    actual = _top_k(logits, torch.tensor(top_k), max(top_k))
    expected = reference_top_k_top_p(logits, top_k, [1.0] * 5)
    assert torch.equal(actual.isinf(), expected.isinf())
    assert (~actual.isinf()).sum(dim=-1).tolist() == top_k


def test_a_draw_never_lands_on_a_token_of_zero_probability():
    """The float32 inverse CDF with the largest possible uniform still picks a kept token."""
    logits = torch.full((2, VOCAB), float("-inf"))
    logits[:, 3] = 0.0  # only token 3 has probability; everything after it has none
    params = SamplingTensors(temperature=torch.ones(2), top_k=None, max_top_k=None, top_p=None, min_p=None,
                             uniform=torch.tensor([1.0 - 2.0**-53, 0.0], dtype=torch.float64),
                             is_greedy=torch.zeros(2, dtype=torch.bool))
    assert _sample_random(logits, params).tolist() == [3, 3]


def test_greedy_is_the_top1_of_its_logprobs_on_exact_and_rounded_ties():
    tied = torch.full((VOCAB,), -3.0)
    tied[[7, 31, 40]] = 2.5  # an exact tie, as bfloat16 logits often have
    close = torch.full((VOCAB,), -3.0)
    close[9], close[4] = 20.0, torch.nextafter(torch.tensor(20.0), torch.tensor(21.0))  # equal after log_softmax
    logits = torch.stack([tied, close])
    states = [state(SamplingParams(temperature=0.0, logprobs=3), index=i) for i in range(2)]
    tokens, logprobs = sample(logits, states)
    assert tokens == [7, 4]
    for row, token in enumerate(tokens):
        reported = logprobs[f"r{row}"]
        assert reported.token_ids[1] == token and reported.sampled_rank == 1
        assert reported.logprobs[1] == max(reported.logprobs[1:])
    assert logprobs["r0"].token_ids[1:] == (7, 31, 40)
    assert logprobs["r1"].token_ids[1:3] == (4, 9)
