"""A pipeline stage's decode CUDA graphs on one GPU: both stages of a pp=2 split in one process (no
collectives cross a stage's graph; the handoff is copied into the later stage's static buffers, as
recv_intermediate_into does), replayed against the eager stages, and the graphs' memory against the
planner's estimate. TP graphs (NCCL inside the capture) need two GPUs and are not checked here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve.planner.graph_memory import GraphShape, capture_sizes, cuda_graph_bytes
from shardserve.planner.memory import activation_bytes_per_token
from shardserve.planner.model_source import load_model as load_model_info
from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.attention.triton_backend import TritonAttentionBackend
from shardserve.runtime.config import load_model_config
from shardserve.runtime.worker.cuda_graphs import DecodeGraphRunner, static_intermediate
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context
from shardserve.runtime.worker.inputs import RequestState, build_host_inputs, prepare_inputs
from shardserve.runtime.worker.loader import load_model
from shardserve.runtime.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state
from shardserve.runtime.sampling_params import SamplingParams
from shardserve.runtime.worker.staging import StagingBuffer

from gpu_checkpoints import VOCAB_SIZE

CUDA = torch.device("cuda")
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN, MAX_NUM_SEQS = 16, 64, 512, 8


@pytest.fixture
def restore_parallel_state():
    saved = get_parallel_state()
    yield
    set_parallel_state(saved)


def build_stage(folder: str, pp_rank: int):
    set_parallel_state(ParallelState(pp_rank=pp_rank, pp_size=2))
    model = load_model(load_model_config(folder, dtype="bfloat16"), CUDA)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    cache = torch.zeros(len(layers), 2, NUM_BLOCKS + 1, BLOCK_SIZE, layers[0].num_kv_heads, layers[0].head_dim,
                        dtype=torch.bfloat16, device=CUDA)
    for index, layer in enumerate(layers):
        layer.kv_cache = cache[index]
    return model, cache, len(layers)


def eager_chain(first, last, states) -> torch.Tensor:
    scheduled = {s.request_id: len(s.token_ids) - s.num_computed_tokens for s in states}
    inputs = prepare_inputs(states, scheduled, BLOCK_SIZE, CUDA)
    with forward_context(ForwardContext(inputs.attn_metadata, TritonAttentionBackend())):
        handoff = first(inputs.input_ids, inputs.positions)
    with forward_context(ForwardContext(inputs.attn_metadata, TritonAttentionBackend())):
        hidden = last(None, inputs.positions, handoff)
    return last.compute_logits(hidden[inputs.logits_indices]).float()


def replay(runner: DecodeGraphRunner, host):
    """What the worker does: the step into the runner's static inputs, then its graph."""
    size, _ = runner.load(host, StagingBuffer(CUDA))
    return runner.replay(size, host.num_requests)


def test_a_later_stage_replays_its_graph_from_static_buffers(gpu_checkpoint, restore_parallel_state):
    folder, _ = gpu_checkpoint("llama")
    (first, first_cache, _), (last, last_cache, num_last_layers) = build_stage(folder, 0), build_stage(folder, 1)
    rng = np.random.default_rng(0)
    lengths = [5, 40, 130]
    states = [RequestState(f"r{i}", rng.integers(3, VOCAB_SIZE, n).tolist(), n, SamplingParams(), 0, frozenset(),
                           list(range(10 * i, 10 * i + 10)), 0) for i, n in enumerate(lengths)]
    hidden_size = load_model_config(folder).hf_config.hidden_size
    sizes = capture_sizes(MAX_NUM_SEQS)
    buffers = static_intermediate(sizes[-1], hidden_size, torch.bfloat16, CUDA)
    runners = [DecodeGraphRunner(model, TritonAttentionBackend(), sizes, MAX_MODEL_LEN, BLOCK_SIZE,
                                 scratch_block=NUM_BLOCKS, device=CUDA, intermediate=intermediate)
               for model, intermediate in ((first, None), (last, buffers))]
    with torch.inference_mode():
        runners[0].capture()
        measured = runners[1].capture()
        eager_chain(first, last, states)  # prefill
        for step in range(4):
            for state in states:
                state.num_computed_tokens = len(state.token_ids)
                state.token_ids.append(int(rng.integers(3, VOCAB_SIZE)))
            saved = first_cache.clone(), last_cache.clone()
            expected = eager_chain(first, last, states)
            first_cache.copy_(saved[0])
            last_cache.copy_(saved[1])
            host = build_host_inputs(states, {s.request_id: 1 for s in states}, BLOCK_SIZE)
            handoff = replay(runners[0], host)
            buffers.hidden_states[:3].copy_(handoff.hidden_states)
            buffers.residual[:3].copy_(handoff.residual)
            logits = last.compute_logits(replay(runners[1], host)).float()
            torch.testing.assert_close(logits, expected, atol=2e-2, rtol=2e-2)
    spec = load_model_info(folder, None).spec
    reserved = cuda_graph_bytes(GraphShape(MAX_NUM_SEQS, MAX_MODEL_LEN, BLOCK_SIZE, hidden_size, 2, num_last_layers,
                                           activation_bytes_per_token(spec, 1, 2), is_first_stage=False))
    assert 0 <= measured <= reserved, (measured, reserved)
