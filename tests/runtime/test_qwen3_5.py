"""Qwen3.5 / Qwen3.5-MoE (text and multimodal checkpoints) and Qwen3-Next, hybrid Gated DeltaNet models:
greedy tokens and logits equal transformers' on the same weights, whatever the steps a prompt is cut
into, across concurrent requests, preemption, tensor and pipeline parallel ranks."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.layers.recurrent_state import RecurrentLayer
from test_parallel_generate import rank_pids
from test_runtime_matches_transformers import MIXED, SHARED, logprobs_within, random_prompts, reference, token_outputs

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl", "qwen3_next"]
NUM_LAYERS = 4  # linear, linear, linear, full attention
# one block of the KV pool: K and V of 2 heads of 32 in the one full-attention layer, float32, 4 tokens
BLOCK_BYTES = 2 * 4 * 2 * 32 * 4
# one request's states in the 3 linear layers: conv (2 * 2 * 16 + 4 * 8 channels, kernel 4 - 1) and
# recurrent (4 value heads of 16 x 8), float32; the KV cache's memory holds them first
STATE_BYTES_PER_SLOT = 3 * ((2 * 2 * 16 + 4 * 8) * 3 + 4 * 16 * 8) * 4


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, checkpoint_factory):
    folder, hf_model = checkpoint_factory(request.param, num_layers=NUM_LAYERS)
    expected = reference(hf_model, MIXED)
    assert len({t for seq in expected for t in seq}) > 10, "degenerate test model: outputs barely vary"
    return request.param, folder, hf_model, expected


def test_greedy_matches_transformers(family):
    name, folder, _, expected = family
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22)
    recurrent = [m for m in llm.engine.executor.worker.model.modules() if isinstance(m, RecurrentLayer)]
    assert len(recurrent) == 3 and all(layer.states is not None for layer in recurrent)
    assert token_outputs(llm, MIXED) == expected, name  # 10 requests of 1 to 40 tokens decoded together
    llm.engine.block_manager.check_integrity()
    assert llm.engine.block_manager.num_free_blocks == llm.kv_cache_info.num_blocks


def test_greedy_with_tiny_chunked_prefill(family):
    """Prompts cut into steps of at most 5 tokens, prefill chunks and decodes mixed in one step."""
    name, folder, _, expected = family
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4, max_num_batched_tokens=5,
              max_num_seqs=3)
    assert token_outputs(llm, MIXED) == expected, name


def test_logprobs_match_transformers_logits(family):
    """Every step's top-5 log-probabilities within 5e-4 of transformers' full forward. NOTE: not the 1e-4 of
    the 2-layer families: through 4 layers float32 rounding reaches 2.4e-4 here (qwen3_5_moe_vl, 33 tokens;
    against a float64 transformers, transformers' own float32 is off by 3.5e-5 there, the runtime's fused
    gate_up and qkv matmuls round differently), while a wrong state or position is off by far more."""
    name, folder, hf_model, _ = family
    logprobs_within(LLM(folder, device="cpu", kv_cache_memory_bytes=2**22), hf_model, MIXED[3:7], 5e-4, name)


def test_shared_prefixes_and_preemption(checkpoint_factory):
    """Prompts sharing prefixes (no prefix cache for recurrent layers: each starts from a zero state), and
    a pool of 16 blocks of 4 tokens that preempts: a preempted request recomputes from token 0."""
    folder, hf_model = checkpoint_factory("qwen3_5", num_layers=NUM_LAYERS)
    llm = LLM(folder, device="cpu", block_size=4, max_model_len=56, max_num_seqs=8,
              kv_cache_memory_bytes=16 * BLOCK_BYTES + (8 + 1) * STATE_BYTES_PER_SLOT)  # + scratch slot
    assert llm.kv_cache_info.num_blocks == 16
    assert token_outputs(llm, SHARED) == reference(hf_model, SHARED)
    assert token_outputs(llm, MIXED) == reference(hf_model, MIXED)
    assert llm.engine.get_stats().num_preemptions > 0
    llm.engine.block_manager.check_integrity()


def test_states_that_leave_no_room_name_max_num_seqs(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3_5", num_layers=NUM_LAYERS)
    with pytest.raises(ValueError, match=r"or lower max_num_seqs \(8\): the Gated DeltaNet layers' states"):
        LLM(folder, device="cpu", block_size=4, max_model_len=56, max_num_seqs=8,
            kv_cache_memory_bytes=2 * BLOCK_BYTES + (8 + 1) * STATE_BYTES_PER_SLOT)


def test_mtp_head_is_skipped_and_named_once(checkpoint_factory, tmp_path, caplog):
    """Real checkpoints ship a multi-token-prediction head (mtp.*): not loaded, said once in the log."""
    source, hf_model = checkpoint_factory("qwen3_5_vl", num_layers=NUM_LAYERS)
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(source, name), tmp_path / name)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    tensors |= {"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.input_layernorm.weight": torch.zeros(64),
                "mtp.norm.weight": torch.zeros(64)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="shardserve.runtime.models.qwen3_5"):
        llm = LLM(str(tmp_path), device="cpu", kv_cache_memory_bytes=2**22)
    assert [r.message for r in caplog.records if "MTP" in r.message] == [
        "MTP head (mtp.*) not loaded: it drafts with speculative_config method mtp"]
    assert token_outputs(llm, MIXED[:3]) == reference(hf_model, MIXED[:3])


PROMPTS = random_prompts(7, [1, 6, 17, 33])
MAX_TOKENS = 8
# (family, tensor_parallel_size, pipeline_parallel_size, enable_expert_parallel)
LAYOUTS = [
    ("qwen3_5", 2, 1, False),  # key and value heads, the conv channels in three parts, z/b/a and A_log split
    ("qwen3_next", 2, 1, False),  # the fused qkvz / ba projections split by key-head group
    ("qwen3_5_moe", 2, 1, False),  # experts and the gated shared expert split too
    ("qwen3_5_moe", 2, 1, True),  # whole experts dealt out to the ranks
    ("qwen3_5", 1, 2, False),  # a stage of linear layers only (no KV pool), then linear + full attention
    ("qwen3_5_vl", 1, 2, False),  # the tied head: the last stage loads its own copy of the embedding
]


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, pp, ep", LAYOUTS, ids=[f"{f}-tp{t}-pp{p}" + ("-ep" if e else "")
                                                          for f, t, p, e in LAYOUTS])
def test_parallel_greedy_matches_transformers(name, tp, pp, ep, checkpoint_factory):
    folder, hf_model = checkpoint_factory(name, num_layers=NUM_LAYERS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4, tensor_parallel_size=tp,
             pipeline_parallel_size=pp, distributed_executor_backend="mp", enable_expert_parallel=ep) as llm:
        assert token_outputs(llm, PROMPTS, params) == reference(hf_model, PROMPTS, MAX_TOKENS)
    assert rank_pids() == []
