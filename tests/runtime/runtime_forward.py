"""Running a loaded model over a prompt in chunks through a paged cache, outside the engine."""

from __future__ import annotations

import torch

from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.attention.torch_backend import TorchAttentionBackend
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context
from shardserve.runtime.worker.inputs import RequestState, prepare_inputs
from shardserve.runtime.sampling_params import SamplingParams

PROMPT = [(17 * i + 5) % 300 + 3 for i in range(37)]
BLOCK_SIZE = 4


def run_chunks(model, chunks: list[int], backend=None) -> torch.Tensor:
    """Feed PROMPT in chunks through the paged cache; returns logits for every position."""
    backend = backend or TorchAttentionBackend()
    for layer in [m for m in model.modules() if isinstance(m, Attention)]:
        layer.kv_cache = torch.zeros(2, 16, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim)
        layer.kv_group = 0  # a cache of its own per layer: one block table serves them all
    blocks = list(range(15, 15 - 10, -1))  # deliberately out of order
    state = RequestState("r", list(PROMPT), len(PROMPT), SamplingParams(), 0, frozenset(), blocks, 0)
    logits = []
    for size in chunks:
        inputs = prepare_inputs([state], {"r": size}, BLOCK_SIZE, torch.device("cpu"))
        with torch.inference_mode(), forward_context(ForwardContext(inputs.attn_metadata, backend)):
            hidden = model(inputs.input_ids, inputs.positions)
        logits.append(model.compute_logits(hidden))
        state.num_computed_tokens += size
    return torch.cat(logits)
