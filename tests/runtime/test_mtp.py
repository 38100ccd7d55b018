"""Speculative decoding with DeepSeek-V3's own multi-token-prediction layer (method mtp): its arithmetic against a
reference built from transformers' DeepSeek-V3 decoder layer, the tokens of no speculation (greedy, seeded, at
tp 2), and its refusals."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_heads import save_mtp_checkpoint
from runtime_forward import PROMPT
from shardserve.planner.settings import SettingError
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.config import load_model_config
from shardserve.runtime.models.deepseek_mtp import DeepseekMTP
from shardserve.runtime.worker.loader import load_model
from test_eagle3_head import CPU, _run
from test_spec_decode import generate, same_logprobs

MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mtp"))
    return folder, save_mtp_checkpoint(folder)


def test_the_layer_computes_deepseeks_multi_token_prediction(mtp_checkpoint):
    folder, reference = mtp_checkpoint
    config = load_model_config(folder)
    mtp = load_model(config, CPU, DeepseekMTP)
    assert isinstance(mtp, DeepseekMTP)
    mtp.share_embedding(load_model(config, CPU))
    hidden = torch.randn(len(PROMPT), config.hf_config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        normed, prenorm = _run(mtp, PROMPT, hidden)
    weights = dict(mtp.named_parameters())
    prefix = f"model.layers.{config.num_layers}."

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.hf_config.rms_norm_eps) * weights[prefix + name]

    n = len(PROMPT)
    with torch.no_grad():
        embeds = reference.model.embed_tokens(torch.tensor(PROMPT))
        embeds[0] = 0.0  # position 0's token, as the layer was trained
        x = torch.cat([rms(embeds, "enorm.weight"), rms(hidden, "hnorm.weight")], dim=-1) @ weights[
            prefix + "eh_proj.weight"].T
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        reference.config._attn_implementation = "eager"
        out = reference.model.layers[-1](x[None], attention_mask=mask, position_ids=positions,
                                         position_embeddings=reference.model.rotary_emb(x[None], positions))
        expected = (out[0] if isinstance(out, tuple) else out)[0]
    torch.testing.assert_close(prenorm, expected, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(normed, rms(expected, "shared_head.norm.weight"), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True, seed=7),
], ids=["greedy", "seeded"])
def test_tokens_are_those_without_speculation(mtp_checkpoint, params):
    folder, _ = mtp_checkpoint
    plain, plain_logprobs, _ = generate(folder, params)
    tokens, logprobs, stats = generate(folder, params, MTP)
    assert tokens == plain and stats.spec_decode.num_drafts > 0
    if params.logprobs:
        assert same_logprobs(logprobs, plain_logprobs, tokens)


def test_a_model_without_the_layer_is_refused_by_name(checkpoint_factory):
    settings = dict(device="cpu", kv_cache_memory_bytes=1 << 22, speculative_config=MTP)
    with pytest.raises(SettingError, match="method mtp drafts with the model's own multi-token-prediction layers, "
                                           "served for DeepseekV3ForCausalLM; LlamaForCausalLM has none"):
        LLM(checkpoint_factory("llama3")[0], **settings)
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.2\."):
        LLM(checkpoint_factory("deepseek_v3")[0], **settings)


@pytest.mark.slow
def test_tensor_parallel_ranks_draft_alike(mtp_checkpoint):
    folder, _ = mtp_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain, _, _ = generate(folder, params)
    tokens, _, stats = generate(folder, params, MTP, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert tokens == plain and stats.spec_decode.num_drafts > 0


def test_the_plan_sizes_the_pool_the_engine_makes(mtp_checkpoint):
    """plan = launch: a page holds the MTP layer's latent beside the model's layers', in both."""
    from shardserve.planner import PlanOptions, load_model as plan_model, make_plan, parse_declared

    folder, _ = mtp_checkpoint
    pool = 1 << 22
    plan = make_plan(plan_model(folder), parse_declared("cpu"), PlanOptions(
        kv_cache_memory_bytes=pool, block_size=4, max_model_len=256, speculative_config=MTP,
        draft_acceptance_rate=0.7)).record()
    plain = make_plan(plan_model(folder), parse_declared("cpu"), PlanOptions(
        kv_cache_memory_bytes=pool, block_size=4, max_model_len=256)).record()
    with LLM(folder, device="cpu", kv_cache_memory_bytes=pool, block_size=4, max_model_len=256,
             speculative_config=MTP) as llm:
        assert llm.kv_cache_info.num_blocks == plan.memory.num_blocks < plain.memory.num_blocks
