"""Quantized experts (AWQ, GPTQ, fp8 per tensor, per channel and in blocks) of Mixtral, Qwen2-MoE and
Qwen3-MoE: greedy tokens equal and logits close to transformers' on the dequantized weights, at tensor
parallel 1, 2 and with expert parallel; the layer's rank shares summing to the dequantized layer; what is
refused, by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from quant_checkpoints import MOE_FORMATS, save_mxfp4_gpt_oss, save_quantized_experts, save_quantized_moe
from runtime_forward import PROMPT, run_chunks
from shardserve.planner.model_source import load_model as load_model_info
from shardserve.planner.sharding import summarize, total_weight_bytes
from shardserve.planner.tensors import derive_tensors
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.worker.checkpoint import CheckpointTensor
from shardserve.runtime.layers.moe import FusedMoE, expert_weight
from shardserve.runtime.layers.quantization.config import QuantConfig
from shardserve.runtime.layers.quantization.methods import quantized_layers
from shardserve.runtime.distributed.parallel_state import ParallelState, get_parallel_state, set_parallel_state
from test_parallel_generate import rank_pids
from test_runtime_matches_transformers import random_prompts, reference, token_outputs

PROMPTS = random_prompts(13, [1, 5, 17, 30])
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]
# a quantized expert's parameters, by format: what the checkpoint's packed tensors load into
EXPERT_PARAMS = {"awq": "w13_qweight", "gptq4": "w13_g_idx", "gptq8-sym": "w13_qzeros",
                 "fp8-tensor": "w13_input_scale", "fp8-channel": "w13_weight_scale", "fp8-block": "w13_weight_scale_inv",
                 "mxfp4": "w13_blocks"}


@pytest.fixture(scope="session")
def quantized_moe(tmp_path_factory):
    """(family, format) -> (folder, transformers model on the dequantized weights, its greedy tokens)."""
    cache = {}

    def make(family: str, fmt: str):
        if (family, fmt) not in cache:
            folder = str(tmp_path_factory.mktemp(f"{family}_{fmt}".replace("-", "_")) / "model")
            hf_model = save_mxfp4_gpt_oss(folder) if fmt == "mxfp4" else save_quantized_moe(folder, family, fmt)
            cache[family, fmt] = folder, hf_model, reference(hf_model, PROMPTS, MAX_TOKENS)
        return cache[family, fmt]

    return make


@pytest.fixture(autouse=True)
def restore_parallel_state():
    saved = get_parallel_state()
    yield
    set_parallel_state(saved)


# DeepSeek's releases: V3/R1 ship fp8 blocks (kv_b_proj dequantized per step for MLA's absorption);
# gpt-oss's: MXFP4 experts, one tensor of every expert
RELEASES = [("deepseek_v3", "fp8-block"), ("deepseek_v2_lite", "awq"), ("deepseek_v2", "gptq4"), ("gpt_oss", "mxfp4")]


@pytest.mark.parametrize("family, fmt", [(f, q) for f in FAMILIES for q in MOE_FORMATS] + RELEASES)
def test_greedy_and_logits_match_dequantized_transformers(family, fmt, quantized_moe):
    folder, hf_model, expected = quantized_moe(family, fmt)
    assert len({t for seq in expected for t in seq}) > 5
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4)
    assert token_outputs(llm, PROMPTS, GREEDY) == expected
    model = llm.engine.executor.worker.model
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(EXPERT_PARAMS[fmt] in dict(m.named_parameters()) for m in experts)
    logits = run_chunks(model, [len(PROMPT)])  # after generating: the engine's cache is not needed again
    with torch.no_grad():
        reference_logits = hf_model(torch.tensor([PROMPT])).logits[0]
    assert (logits - reference_logits).abs().max().item() < 1e-4
    assert reference_logits.std().item() > 0.5  # control: far from flat


# (family, format, expert parallel): tp 2 splits each expert's features, or deals whole experts out
PARALLEL = [("mixtral", "fp8-block", False), ("qwen3_moe", "awq", False), ("mixtral", "gptq4", True),
            ("qwen2_moe", "fp8-tensor", True), ("deepseek_v3", "fp8-block", False), ("deepseek_v3", "fp8-block", True),
            ("gpt_oss", "mxfp4", False), ("gpt_oss", "mxfp4", True)]


@pytest.mark.slow
@pytest.mark.parametrize("family, fmt, ep", PARALLEL, ids=[f"{f}-{q}-{'ep' if e else 'tp'}2" for f, q, e in PARALLEL])
def test_parallel_greedy_matches_dequantized_transformers(family, fmt, ep, quantized_moe):
    folder, _, expected = quantized_moe(family, fmt)
    with LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4, tensor_parallel_size=2,
             distributed_executor_backend="mp", enable_expert_parallel=ep) as llm:
        assert token_outputs(llm, PROMPTS, GREEDY) == expected
    assert rank_pids() == []


@pytest.mark.parametrize("fmt", list(MOE_FORMATS))
def test_planner_derives_the_stored_bytes_of_quantized_experts(fmt, quantized_moe):
    """The planner's weight bytes from the checkpoint's headers equal those it derives from config.json
    alone (fp8 per tensor is derived as per channel: a few scales more)."""
    for family in FAMILIES:
        folder, _, _ = quantized_moe(family, fmt)
        info = load_model_info(folder)
        assert info.tensors_from == "safetensors"
        stored = total_weight_bytes(info.spec, info.groups, info.spec.dtype)
        derived = total_weight_bytes(info.spec, summarize(derive_tensors(info.spec)), info.spec.dtype)
        if fmt == "fp8-tensor":
            assert stored < derived < 1.01 * stored
        else:
            assert derived == stored


def test_planner_derives_gpt_oss_tensors_exactly(quantized_moe):
    """gpt-oss's tensors of every expert (MXFP4 blocks and scales, or float) with their biases, the router's
    bias and the attention sinks: the names, sizes and dtypes config.json alone gives are the checkpoint's."""
    folder, _, _ = quantized_moe("gpt_oss", "mxfp4")
    for path in (folder, folder + "-float"):
        info = load_model_info(path)
        assert info.tensors_from == "safetensors"
        assert set(derive_tensors(info.spec)) == set(info.tensors), path
    assert any(t.name.endswith("gate_up_proj_blocks") and t.dtype == "U8" for t in load_model_info(folder).tensors)


def loaded_experts(path: str, fmt: str, state: ParallelState, num_experts: int = 4, hidden: int = 64,
                   inter: int = 32) -> FusedMoE:
    """A quantized FusedMoE of this rank, each tensor of the file through its weight_loader."""
    set_parallel_state(state)
    with quantized_layers(QuantConfig.from_dict(MOE_FORMATS[fmt])):
        moe = FusedMoE(num_experts, 2, hidden, inter)
    params = dict(moe.named_parameters())
    handle = safe_open(path, framework="pt")
    for name in handle.keys():
        expert, kind, leaf = name.split(".")
        target = expert_weight(f"layers.0.mlp.experts.{expert}.{kind}.{leaf}", {k: k for k in ("w1", "w2", "w3")})
        assert target is not None
        param_name, shard = target[0].rpartition(".")[2], target[1]
        moe.weight_loader(params[param_name], CheckpointTensor(handle.get_slice(name)), shard)
    moe.quant_method.process_after_loading(moe)
    return moe


def dequantized_loop(dequantized: dict, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor):
    """The routed experts' sum from the dequantized float weights, token by token (the reference)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot, e in enumerate(experts[t].tolist()):
            h = F.silu(F.linear(x[t], dequantized[e, "w1"])) * F.linear(x[t], dequantized[e, "w3"])
            out[t] += weights[t, slot] * F.linear(h, dequantized[e, "w2"])
    return out


@pytest.mark.parametrize("fmt", list(MOE_FORMATS))
@pytest.mark.parametrize("is_expert_parallel", [False, True])
def test_rank_shares_sum_to_the_dequantized_layer(fmt, is_expert_parallel, tmp_path):
    """Every format, both layouts: each rank reads its share of the packed tensors (whole groups, blocks,
    or whole experts), and the ranks' partial outputs add up to the dequantized layer's."""
    path = str(tmp_path / "experts.safetensors")
    dequantized = save_quantized_experts(path, fmt, 4, 64, 32)
    whole = loaded_experts(path, fmt, ParallelState())
    x, logits = torch.randn(9, 64), torch.randn(9, 4)
    weights, experts = whole.route(logits)
    expected = dequantized_loop(dequantized, x, weights, experts)
    torch.testing.assert_close(whole.forward_loop(x, weights, experts), expected, atol=1e-5, rtol=1e-5)
    total = torch.zeros_like(expected)
    for rank in range(2):
        moe = loaded_experts(path, fmt, ParallelState(rank, 2, enable_expert_parallel=is_expert_parallel))
        assert moe.num_local_experts == (2 if is_expert_parallel else 4)
        total += moe.forward_loop(x, weights, experts)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


def test_online_fp8_experts_quantize_each_row(tmp_path):
    """--quantization fp8 on float experts: fp8 weights with one scale per row, within fp8's rounding."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {f"{e}.{kind}.weight": torch.randn(*shape) * 0.2 for e in range(4)
               for kind, shape in (("w1", (32, 64)), ("w3", (32, 64)), ("w2", (64, 32)))}
    save_file(tensors, str(tmp_path / "experts.safetensors"))
    set_parallel_state(ParallelState())
    with quantized_layers(QuantConfig.from_dict(None, "fp8")):
        moe = FusedMoE(4, 2, 64, 32)
    handle = safe_open(str(tmp_path / "experts.safetensors"), framework="pt")
    for name in handle.keys():
        expert, kind, _ = name.split(".")
        param = moe.w2 if kind == "w2" else moe.w13
        moe.weight_loader(param, CheckpointTensor(handle.get_slice(name)), (int(expert), kind))
    moe.quant_method.process_after_loading(moe)
    assert moe.w13.dtype == torch.float8_e4m3fn and moe.w13_weight_scale.shape == (4, 64, 1)
    w13, w2 = moe.expert_weights(1)
    torch.testing.assert_close(w13, torch.cat([tensors["1.w1.weight"], tensors["1.w3.weight"]]), atol=0.02, rtol=0.07)
    torch.testing.assert_close(w2, tensors["1.w2.weight"], atol=0.02, rtol=0.07)


def test_act_order_experts_are_refused_by_name(quantized_moe, tmp_path):
    folder, _, _ = quantized_moe("qwen3_moe", "gptq4")
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["desc_act"] = True
    for file in os.listdir(folder):
        if file != "config.json":
            os.symlink(os.path.join(folder, file), tmp_path / file)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gptq act-order \(desc_act\) experts are not served"):
        LLM(str(tmp_path), device="cpu", kv_cache_memory_bytes=2**22)
