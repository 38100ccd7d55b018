"""The pipeline seam in one process: two stage models chained through IntermediateTensors.

Each stage loads only its layers; together they give transformers' logits. (Distributed stages
arrive with the executors.)"""

from __future__ import annotations

import pytest
import torch

from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.attention.torch_backend import TorchAttentionBackend
from shardserve.runtime.config import load_model_config
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context
from shardserve.runtime.worker.inputs import RequestState, prepare_inputs
from shardserve.runtime.worker.loader import load_model
from shardserve.runtime.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state
from shardserve.runtime.worker.pipeline import IntermediateTensors, MissingLayer, split_layers
from shardserve.runtime.sampling_params import SamplingParams

PROMPT = [(11 * i + 7) % 290 + 5 for i in range(21)]


def test_split_layers_is_contiguous_and_balanced():
    assert split_layers(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_layers(2, 2) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="3 layers into 4"):
        split_layers(3, 4)


@pytest.fixture
def restore_parallel_state():
    saved = get_parallel_state()
    yield
    set_parallel_state(saved)


def build_stage(folder: str, pp_rank: int):
    set_parallel_state(ParallelState(pp_rank=pp_rank, pp_size=2))
    model = load_model(load_model_config(folder), torch.device("cpu"))
    for layer in [m for m in model.modules() if isinstance(m, Attention)]:
        layer.kv_cache = torch.zeros(2, 8, 4, layer.num_kv_heads, layer.head_dim)
    return model


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gpt2", "opt"])  # untied and tied heads
def test_two_stages_chain_to_transformers_logits(family, checkpoint_factory, restore_parallel_state):
    folder, hf_model = checkpoint_factory(family)
    first, last = build_stage(folder, 0), build_stage(folder, 1)
    assert sum(isinstance(m, MissingLayer) for m in first.modules()) == 1
    assert not hasattr(first, "lm_head") and hasattr(last, "lm_head")
    state = RequestState("r", PROMPT, len(PROMPT), SamplingParams(), 0, frozenset(), list(range(6)), 0)
    inputs = prepare_inputs([state], {"r": len(PROMPT)}, 4, torch.device("cpu"))
    with torch.inference_mode():
        with forward_context(ForwardContext(inputs.attn_metadata, TorchAttentionBackend())):
            handoff = first(inputs.input_ids, inputs.positions)
        assert isinstance(handoff, IntermediateTensors)
        with forward_context(ForwardContext(inputs.attn_metadata, TorchAttentionBackend())):
            hidden = last(None, inputs.positions, handoff)
        logits = last.compute_logits(hidden)
        expected = hf_model(torch.tensor([PROMPT])).logits[0]
    assert (logits - expected).abs().max().item() < 1e-4


def test_a_rank_is_named_as_logs_name_it():
    assert str(ParallelState(1, 2, 0, 2)) == "tp 1/2, pp 0/2"
