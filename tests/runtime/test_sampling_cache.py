"""The sampler's per-batch cache: reused while a batch keeps its rows, rebuilt when they change, never stale."""

from __future__ import annotations

import numpy as np
import torch

from shardserve.runtime.worker.inputs import RequestState
from shardserve.runtime.worker.sampler import sample_on_device, sampled_logprobs
from shardserve.runtime.worker.sampling_batch import BatchSampling, SamplingCache, sample_seed, seeded_uniforms
from shardserve.runtime.sampling_params import SamplingParams

VOCAB = 64
CPU = torch.device("cpu")


def state(params: SamplingParams, seed: int = 0, index: int = 0, num_outputs: int = 0) -> RequestState:
    tokens = [1, 2, 3] + [5] * num_outputs
    return RequestState(f"r{index}", tokens, 3, params, seed, frozenset({7}), [0, 1], len(tokens) - 1)


def logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def hot_batch(num: int = 6) -> list[RequestState]:
    return [state(SamplingParams(temperature=3.0, top_k=[None, 9][i % 2]), seed=i, index=i) for i in range(num)]


def test_a_cached_batch_draws_what_a_fresh_one_draws_step_after_step():
    states, cache = hot_batch(), SamplingCache()
    first = cache.get(states, VOCAB)
    draws = []
    for step in range(4):
        scores = logits(len(states), step)
        cached = sample_on_device(scores, states, cache=cache)
        assert torch.equal(cached, sample_on_device(scores, states))
        draws.append(cached)
        for s in states:  # each request samples one more token: its draw must move on
            s.token_ids.append(int(cached[0]))
    assert cache.get(states, VOCAB) is first, "the same rows reuse one BatchSampling"
    scores = logits(len(states), 9)
    assert not torch.equal(sample_on_device(scores, states, cache=cache), scores.argmax(dim=-1))  # control


def test_the_draw_follows_each_request_s_output_index_and_seed_exactly():
    seeds = [0, 2**62 + 12345, -7, 2**63 - 2, 10**30]
    states = [state(SamplingParams(temperature=1.0), seed=s, index=i, num_outputs=i * 3)
              for i, s in enumerate(seeds)]
    for s in states[:2]:
        s.num_pending_tokens = 1
    params = BatchSampling(states, VOCAB).tensors(states, CPU)
    expected = seeded_uniforms(np.array([sample_seed(s.seed, s.num_output_tokens) for s in states], dtype=np.uint64))
    assert params.uniform.tolist() == expected.tolist()


def test_a_changed_batch_of_the_same_size_is_rebuilt():
    """An all-greedy batch, then other requests in the same number of rows: a stale cache would
    still take the argmax."""
    cache = SamplingCache()
    greedy = [state(SamplingParams(temperature=0.0), index=i) for i in range(6)]
    scores = logits(6, 3)
    assert torch.equal(sample_on_device(scores, greedy, cache=cache), scores.argmax(dim=-1))
    hot = hot_batch()
    tokens = sample_on_device(scores, hot, cache=cache)
    assert torch.equal(tokens, sample_on_device(scores, hot))
    assert not torch.equal(tokens, scores.argmax(dim=-1)), "control: the hot rows leave the argmax"


def test_reordered_or_rebuilt_rows_are_not_served_from_the_cache():
    cache, states = SamplingCache(), hot_batch()
    scores = logits(len(states), 4)
    sample_on_device(scores, states, cache=cache)
    reordered = states[::-1]
    assert torch.equal(sample_on_device(scores, reordered, cache=cache), sample_on_device(scores, reordered))
    # a request preempted and rebuilt is a new state under the same id (here with another seed and params)
    rebuilt = list(reordered)
    rebuilt[2] = state(SamplingParams(temperature=0.0), seed=99, index=int(reordered[2].request_id[1:]))
    tokens = sample_on_device(scores, rebuilt, cache=cache)
    assert torch.equal(tokens, sample_on_device(scores, rebuilt))
    assert int(tokens[2]) == int(scores[2].argmax())


def test_logprob_rows_and_min_tokens_come_from_the_current_batch():
    cache = SamplingCache()
    plain = hot_batch(3)
    scores = logits(3, 5)
    assert sampled_logprobs(scores, plain, sample_on_device(scores, plain, cache=cache), cache) == {}
    asking = [state(SamplingParams(temperature=0.0, logprobs=1), index=i) for i in range(3)]
    assert set(sampled_logprobs(scores, asking, scores.argmax(dim=-1), cache)) == {"r0", "r1", "r2"}
    # min_tokens masks the stop token 7 until one output exists; it is the argmax here
    scores[:, 7] = 100.0
    waiting = [state(SamplingParams(temperature=0.0, min_tokens=1), index=i) for i in range(3)]
    assert 7 not in sample_on_device(scores, waiting, cache=cache).tolist()
    for s in waiting:
        s.token_ids.append(4)  # one output now: the same cached batch no longer masks
    assert sample_on_device(scores, waiting, cache=cache).tolist() == [7, 7, 7]
