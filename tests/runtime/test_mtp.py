"""Speculative decoding with the model's own multi-token-prediction layer (method mtp), DeepSeek-V3's and Qwen3.5's /
Qwen3-Next's: its arithmetic against a reference built from transformers' decoder layers, the tokens of no
speculation (greedy, seeded, at tp 2), the pool the plan sizes, and its refusals."""

from __future__ import annotations


import pytest
import torch

from draft_heads import save_mtp_checkpoint, save_qwen_mtp_checkpoint
from runtime_forward import PROMPT
from shardserve.planner.settings import SettingError
from shardserve.planner.speculative import SpeculativeConfig
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.config import load_model_config
from shardserve.runtime.models.deepseek_mtp import DeepseekMTP
from shardserve.runtime.models.qwen3_5_mtp import Qwen3_5MTP
from shardserve.runtime.worker.loader import load_model
from test_eagle3_head import CPU, _run
from test_spec_decode import PROMPTS, generate, same_logprobs

MTP = SpeculativeConfig("mtp", 3).to_json()
QWEN_LAYERS = 4  # three linear-attention layers, then full attention


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
                                           "served for DeepseekV3ForCausalLM, Qwen3NextForCausalLM, .*; "
                                           "LlamaForCausalLM has none served"):
        LLM(checkpoint_factory("llama3")[0], **settings)
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.2\."):
        LLM(checkpoint_factory("deepseek_v3")[0], **settings)
    with pytest.raises(SettingError, match="method mtp needs the model's multi-token-prediction layer, and its "
                                           r"config.json counts none \(num_nextn_predict_layers or mtp_num_hidden"):
        LLM(checkpoint_factory("qwen3_5", num_layers=QWEN_LAYERS)[0], **settings)


def test_preemption_keeps_the_tokens(mtp_checkpoint, kv_bytes_for):
    """A pool too small for every request: the newest are preempted and come back, their features computed again."""
    folder, _ = mtp_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    plain, _, _ = generate(folder, params, prompts=prompts)
    one_more_layer = kv_bytes_for(folder, 1, 4) * 3 // 2  # the MTP layer's latent beside the model's two layers'
    tokens, _, stats = generate(folder, params, MTP, prompts=prompts, kv_cache_memory_bytes=30 * one_more_layer,
                                max_model_len=80)
    assert tokens == plain and stats.num_preemptions > 0 and stats.spec_decode.num_drafts > 0


@pytest.mark.slow
def test_tensor_parallel_ranks_draft_alike(mtp_checkpoint, checkpoint_factory, tmp_path):
    folder, _ = mtp_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain, _, _ = generate(folder, params)
    tokens, _, stats = generate(folder, params, MTP, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert tokens == plain and stats.spec_decode.num_drafts > 0
    qwen = str(tmp_path / "qwen")
    save_qwen_mtp_checkpoint(qwen, "qwen3_5", QWEN_LAYERS)
    plain, _, _ = generate(qwen, params, max_num_seqs=8)
    tokens, _, stats = generate(qwen, params, MTP, max_num_seqs=8, tensor_parallel_size=2,
                                distributed_executor_backend="mp")
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


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "qwen3_5_moe_vl"])
def qwen_mtp_checkpoint(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param + "_mtp"))
    return folder, save_qwen_mtp_checkpoint(folder, request.param, QWEN_LAYERS)


def test_qwens_layer_computes_its_multi_token_prediction(qwen_mtp_checkpoint):
    """fc over the zero-centred-normed [embedding, feature], the gated full-attention layer (transformers' own,
    whose weights the MTP layer copies here), mtp.norm; the model's LM head drafts from it."""
    folder, reference = qwen_mtp_checkpoint
    config = load_model_config(folder)
    target = load_model(config, CPU)
    mtp = load_model(config, CPU, Qwen3_5MTP)
    assert isinstance(mtp, Qwen3_5MTP)
    mtp.share_embedding(target)
    hidden = torch.randn(len(PROMPT), config.hf_config.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        normed, carried = _run(mtp, PROMPT, hidden)
    weights = dict(mtp.named_parameters())

    def rms(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.hf_config.rms_norm_eps) * (
            1 + weights[f"mtp.{name}.weight"])

    n = len(PROMPT)
    text = getattr(reference.model, "language_model", reference.model)  # (a multimodal checkpoint's language model)
    with torch.no_grad():
        embeds = text.embed_tokens(torch.tensor(PROMPT))
        x = torch.cat([rms(embeds, "pre_fc_norm_embedding"), rms(hidden, "pre_fc_norm_hidden")], dim=-1) @ weights[
            "mtp.fc.weight"].T
        positions = torch.arange(n)[None]
        reference.config._attn_implementation = text.config._attn_implementation = "eager"
        out = text.layers[-1](x[None], attention_mask=torch.full((n, n), float("-inf")).triu(1)[None, None],
                              position_ids=positions, position_embeddings=text.rotary_emb(x[None], positions))
        expected = rms((out[0] if isinstance(out, tuple) else out)[0], "norm")
    torch.testing.assert_close(normed, expected, atol=2e-4, rtol=2e-4)
    assert carried is normed  # the normed states are the next draft's feature too
    assert mtp.draft_tokens(normed).tolist() == target.compute_logits(normed).argmax(-1).tolist()


def test_qwens_tokens_are_those_without_speculation(qwen_mtp_checkpoint):
    folder, _ = qwen_mtp_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    plain, plain_logprobs, _ = generate(folder, params, max_num_seqs=8)
    tokens, logprobs, stats = generate(folder, params, MTP, max_num_seqs=8)
    assert tokens == plain and stats.spec_decode.num_drafts > 0
    assert same_logprobs(logprobs, plain_logprobs, tokens)
    with LLM(folder, device="cpu", kv_cache_memory_bytes=1 << 22, max_model_len=96, max_num_seqs=8) as llm:
        assert llm.kv_cache_info.num_blocks > 0  # (the count read, the layer left unloaded without speculation)


def test_qwens_plan_sizes_the_pool_the_engine_makes(qwen_mtp_checkpoint):
    from shardserve.planner import PlanOptions, load_model as plan_model, make_plan, parse_declared

    folder, _ = qwen_mtp_checkpoint
    settings = dict(kv_cache_memory_bytes=1 << 22, block_size=4, max_model_len=96, max_num_seqs=8)
    plan = make_plan(plan_model(folder), parse_declared("cpu"), PlanOptions(
        speculative_config=MTP, draft_acceptance_rate=0.7, **settings)).record()
    with LLM(folder, device="cpu", speculative_config=MTP, **settings) as llm:
        assert llm.kv_cache_info.num_blocks == plan.memory.num_blocks


def test_every_architecture_the_plan_serves_mtp_for_has_its_layer():
    from shardserve.planner.speculative import MTP_ARCHITECTURES
    from shardserve.runtime.worker.eagle import MTP_LAYERS

    assert set(MTP_LAYERS) == set(MTP_ARCHITECTURES)
