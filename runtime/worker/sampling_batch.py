"""A batch's sampling parameters as arrays, decided once per batch composition and reused while it lasts."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch

from shardserve.runtime.worker.inputs import RequestState, host_to_device

_SEED_MODULUS = 2**63 - 1


def sample_seed(seed: int, step: int) -> int:
    """NOTE: each draw is seeded from (request seed, output index) alone, so a request samples the
    same tokens whatever it is batched with and even after preemption and recompute."""
    return (seed * 1_000_003 + step) % _SEED_MODULUS


def seeded_uniforms(seeds: np.ndarray) -> np.ndarray:
    """[rows] uint64 seeds -> [rows] float64 in [0, 1): SplitMix64's output function.
    NOTE: a counter-based hash rather than a generator object per row: all rows in a few numpy
    operations, and the same draw on every machine and device."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


@dataclass(slots=True)
class SamplingTensors:
    """The per-request sampling parameters, on the logits' device ([rows] each). Greedy rows get
    temperature 1 and no filters; their draw is discarded."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor | None  # int64 in [1, vocab]; None when no row sets top_k
    max_top_k: int | None  # the largest top_k of the batch, known on the host (no device read)
    top_p: torch.Tensor | None  # float32; 1.0 (no filter) for rows without top_p
    min_p: torch.Tensor | None  # float32
    uniform: torch.Tensor  # float64, the seeded draw of each row
    is_greedy: torch.Tensor  # bool

    @classmethod
    def from_states(cls, states: list[RequestState], vocab_size: int, device: torch.device) -> SamplingTensors:
        return BatchSampling(states, vocab_size).tensors(states, device)


class BatchSampling:
    """Everything the sampler decides from the parameters of a batch's rows (which never change while
    a request runs): the flags that pick its path, the rows asking for logprobs, and the packed
    [6, rows] block of temperature, top_k, top_p, min_p, the draw, is_greedy, of which only the
    draw (row 4: seeded by each request's output index) is refilled per step."""

    def __init__(self, states: list[RequestState], vocab_size: int):
        params = [s.sampling_params for s in states]
        greedy = np.array([p.is_greedy for p in params], dtype=bool)
        self.is_all_greedy = bool(greedy.all())
        self.has_static_edits = any(p.has_penalties or p.logit_bias or p.allowed_token_ids for p in params)
        self.has_min_tokens = any(p.min_tokens > 0 and s.stop_token_ids for p, s in zip(params, states))
        self.logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.packed = np.empty((6, len(states)), dtype=np.float64)  # one copy to the device for all six
        self.packed[0] = np.where(greedy, 1.0, [p.temperature for p in params])
        self.packed[1] = [min(p.top_k or vocab_size, vocab_size) for p in params]
        self.packed[2] = [p.top_p for p in params]
        self.packed[3] = [p.min_p for p in params]
        self.packed[5] = greedy
        self.has_top_k = any(p.top_k is not None for p in params)
        self.has_top_p = any(p.top_p < 1.0 for p in params)
        self.has_min_p = any(p.min_p > 0.0 for p in params)
        # sample_seed(seed, 0) per row: sample_seed(seed, n) is this plus n, modulo 2^63 - 1
        self.seed_bases = np.array([sample_seed(s.seed, 0) for s in states], dtype=np.uint64)
        self.num_prompt_tokens = np.array([s.num_prompt_tokens for s in states], dtype=np.int64)

    def tensors(self, states: list[RequestState], device: torch.device) -> SamplingTensors:
        """This step's draws packed with the fixed rows, on `device` in one copy."""
        num_outputs = np.fromiter((len(s.token_ids) + s.num_pending_tokens for s in states), np.int64,
                                  len(states)) - self.num_prompt_tokens
        seeds = self.seed_bases + num_outputs.astype(np.uint64)  # < 2^64: both terms are below 2^63
        seeds = np.where(seeds >= np.uint64(_SEED_MODULUS), seeds - np.uint64(_SEED_MODULUS), seeds)
        self.packed[4] = seeded_uniforms(seeds)
        values = host_to_device(self.packed, device)
        if device.type == "cpu":  # (the tensor shares the host array, which the next step refills)
            values = values.clone()
        return SamplingTensors(temperature=values[0].float(),
                               top_k=values[1].long() if self.has_top_k else None,
                               max_top_k=int(self.packed[1].max()) if self.has_top_k else None,
                               top_p=values[2].float() if self.has_top_p else None,
                               min_p=values[3].float() if self.has_min_p else None,
                               uniform=values[4], is_greedy=values[5].bool())


class SamplingCache:
    """The last batch's BatchSampling, kept while the next batch has the same rows: the same
    RequestState objects in the same order (a request rebuilt after preemption is a new object).
    NOTE: the states are compared by identity, and held so that no id is reused while cached."""

    def __init__(self) -> None:
        self._states: list[RequestState] = []
        self._vocab_size = 0
        self._batch: BatchSampling | None = None

    def get(self, states: list[RequestState], vocab_size: int) -> BatchSampling:
        if (self._batch is None or vocab_size != self._vocab_size or len(states) != len(self._states)
                or not all(map(operator.is_, states, self._states))):
            self._batch, self._states, self._vocab_size = BatchSampling(states, vocab_size), list(states), vocab_size
        return self._batch
