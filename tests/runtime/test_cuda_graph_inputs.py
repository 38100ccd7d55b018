"""The CPU-testable half of decode CUDA graphs: capture sizes, padding, the static inputs, and the
static forward (what a graph records) against an eager step, on the Triton backend under its interpreter."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at the imports below

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from shardserve.runtime.attention.layer import Attention  # noqa: E402
from shardserve.runtime.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from shardserve.runtime.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from shardserve.runtime.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,  # noqa: E402
                                       SchedulerConfig, load_model_config)
from shardserve.planner.graph_memory import capture_sizes  # noqa: E402
from shardserve.runtime.worker.cuda_graph_plan import local_decision  # noqa: E402
from shardserve.runtime.worker.cuda_graphs import DecodeGraphRunner, pad_decode_batch, padded_size  # noqa: E402
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context  # noqa: E402
from shardserve.runtime.worker.inputs import RequestState, build_host_inputs, to_device  # noqa: E402
from shardserve.runtime.worker.loader import load_model  # noqa: E402
from shardserve.runtime.models.llama import LlamaForCausalLM  # noqa: E402
from shardserve.runtime.models.mixtral import MixtralForCausalLM  # noqa: E402
from shardserve.runtime.sampling_params import SamplingParams  # noqa: E402
from shardserve.runtime.worker.staging import StagingBuffer  # noqa: E402

BLOCK_SIZE, NUM_BLOCKS = 4, 40
SCRATCH = NUM_BLOCKS  # the block after the pool, as the worker allocates it


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(1) == [1] and capture_sizes(5) == [1, 2, 4, 5] and capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(100)[-3:] == [88, 96, 100]
    sizes = capture_sizes(100)
    for n in range(1, 101):
        size = padded_size(n, sizes)
        assert size >= n and all(s < n for s in sizes if s < size)
    assert padded_size(101, sizes) is None


def engine_config(device="cuda", enforce_eager=False, tensor_parallel_size=1):
    model = ModelConfig(model="m", hf_config=None, architecture="LlamaForCausalLM", dtype=torch.bfloat16,
                        max_model_len=128, enforce_eager=enforce_eager)
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.9, kv_cache_memory_bytes=None,
                        enable_prefix_caching=True, kv_cache_dtype="auto")
    return EngineConfig(model=model, cache=cache, scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192),
                        parallel=ParallelConfig(tensor_parallel_size, 1), device=device)


def test_graphs_only_where_they_can_be_captured():
    llama, moe = LlamaForCausalLM.__new__(LlamaForCausalLM), MixtralForCausalLM.__new__(MixtralForCausalLM)
    cuda = torch.device("cuda")
    assert local_decision(engine_config(), cuda, llama).sizes == tuple(capture_sizes(256))
    assert "cpu" in local_decision(engine_config("cpu"), torch.device("cpu"), llama).reason
    assert "enforce_eager" in local_decision(engine_config(enforce_eager=True), cuda, llama).reason
    assert local_decision(engine_config(tensor_parallel_size=2), cuda, llama).captures  # TP ranks capture too
    assert local_decision(engine_config(), cuda, moe).captures  # the Triton MoE kernel syncs nothing
    assert "Linear" in local_decision(engine_config(), cuda, torch.nn.Linear(2, 2)).reason


def make_states(lengths, seed=0):
    """Requests whose prompts are fully cached but for the last token (a decode step), blocks shuffled."""
    rng = np.random.default_rng(seed)
    free = rng.permutation(NUM_BLOCKS).tolist()
    states = []
    for i, length in enumerate(lengths):
        blocks = [free.pop() for _ in range(-(-length // BLOCK_SIZE))]
        tokens = rng.integers(3, 300, length).tolist()
        states.append(RequestState(f"r{i}", tokens, length, SamplingParams(), 0, frozenset(), blocks, 0))
    return states


def test_padding_rows_point_at_the_scratch_block():
    states = make_states([7, 13, 2])
    for state in states:
        state.num_computed_tokens = len(state.token_ids) - 1
    host = build_host_inputs(states, {s.request_id: 1 for s in states}, BLOCK_SIZE)
    batch = pad_decode_batch(host, 8, SCRATCH, BLOCK_SIZE)
    assert batch.size == 8 and batch.block_tables.shape == (8, 4)
    assert batch.input_ids[:3].tolist() == host.input_ids.tolist() and batch.input_ids[3:].tolist() == [0] * 5
    assert batch.slot_mapping[3:].tolist() == [SCRATCH * BLOCK_SIZE] * 5
    assert batch.seq_lens.tolist() == [7, 13, 2, 1, 1, 1, 1, 1]
    assert (batch.block_tables[3:, 0] == SCRATCH).all() and (batch.block_tables[:3] == host.block_tables).all()
    with pytest.raises(ValueError, match="decode step"):
        pad_decode_batch(host, 2, SCRATCH, BLOCK_SIZE)
    prefill = build_host_inputs(make_states([7]), {"r0": 2}, BLOCK_SIZE)
    with pytest.raises(ValueError, match="decode step"):
        pad_decode_batch(prefill, 4, SCRATCH, BLOCK_SIZE)


def bind_cache(model) -> torch.Tensor:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    cache = torch.zeros(len(layers), 2, NUM_BLOCKS + 1, BLOCK_SIZE, layers[0].num_kv_heads, layers[0].head_dim)
    for index, layer in enumerate(layers):
        layer.kv_cache = cache[index]
    return cache


def eager_step(model, states, backend) -> torch.Tensor:
    """Run every state's uncomputed tokens; returns the hidden state of each request's last token."""
    scheduled = {s.request_id: len(s.token_ids) - s.num_computed_tokens for s in states}
    host = build_host_inputs(states, scheduled, BLOCK_SIZE)
    inputs = to_device(host, StagingBuffer(torch.device("cpu")))
    with forward_context(ForwardContext(inputs.attn_metadata, backend)):
        hidden = model(inputs.input_ids, inputs.positions)
    for state in states:
        state.num_computed_tokens = len(state.token_ids)
    return hidden[torch.from_numpy(host.logits_indices)]


def written_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """Slots (block * BLOCK_SIZE + offset) whose K or V changed in any layer."""
    changed = (before != after).flatten(4).any(dim=-1).any(dim=1).any(dim=0)  # [num_blocks + 1, BLOCK_SIZE]
    return set(torch.nonzero(changed.flatten()).flatten().tolist())


@pytest.mark.parametrize("family, max_model_len", [("llama3", 64), ("qwen3", 2048)])  # 2048: 8 decode splits
def test_static_decode_forward_matches_an_eager_step(family, max_model_len, checkpoint_factory):
    folder, _ = checkpoint_factory(family)
    model = load_model(load_model_config(folder), torch.device("cpu"))
    cache = bind_cache(model)
    states = make_states([37, 9, 22])
    with torch.inference_mode():
        eager_step(model, states, TorchAttentionBackend())  # prefill, then one new token each
        for i, state in enumerate(states):
            state.token_ids.append(11 + i)
        runner = DecodeGraphRunner(model, TritonAttentionBackend(), [2, 4], max_model_len, BLOCK_SIZE,
                                   scratch_block=SCRATCH, device=torch.device("cpu"))
        for batch in (states, states[1:2]):  # 3 requests -> 4 rows, then 1 -> 2 (over a stale real row)
            eager_cache = cache.clone()
            host = build_host_inputs(batch, {s.request_id: 1 for s in batch}, BLOCK_SIZE)
            size, pending = runner.load(host, StagingBuffer(torch.device("cpu")))
            assert pending is None
            assert size == (4 if len(batch) == 3 else 2)
            static = runner.forward_static(size)[: len(batch)]
            static_cache = cache.clone()
            cache.copy_(eager_cache)
            expected = eager_step(model, [RequestState(s.request_id, s.token_ids, s.num_prompt_tokens,
                                                       s.sampling_params, 0, frozenset(), s.block_ids,
                                                       len(s.token_ids) - 1) for s in batch],
                                  TorchAttentionBackend())
            torch.testing.assert_close(model.compute_logits(static), model.compute_logits(expected),
                                       atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(static_cache, cache.index_copy(2, torch.tensor([SCRATCH]),
                                                                      static_cache[:, :, SCRATCH:]))
            assert written_slots(eager_cache, static_cache) == set(host.slot_mapping.tolist()) | {SCRATCH * BLOCK_SIZE}
            assert written_slots(eager_cache, cache) == set(host.slot_mapping.tolist())
            for state in batch:  # the step's token is cached; the next one is new
                state.num_computed_tokens = len(state.token_ids)
                state.token_ids.append(len(state.token_ids) % 300)
