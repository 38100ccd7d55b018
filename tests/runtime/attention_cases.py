"""Attention metadata for kernel tests: requests with cached and new tokens on shuffled blocks."""

from __future__ import annotations

import torch

from shardserve.runtime.inputs import RequestState, prepare_inputs
from shardserve.runtime.sampling_params import SamplingParams


def make_batch(shapes, block_size: int, num_blocks: int, device: torch.device, seed: int = 0):
    """shapes: (num_cached, num_new) per request -> its AttentionMetadata on `device`."""
    generator = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    states, scheduled = [], {}
    for i, (num_cached, num_new) in enumerate(shapes):
        total = num_cached + num_new
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        states.append(RequestState(f"r{i}", [1] * total, total, SamplingParams(), 0, frozenset(), blocks, num_cached))
        scheduled[f"r{i}"] = num_new
    return prepare_inputs(states, scheduled, block_size, device).attn_metadata
