"""AWQ, GPTQ and FP8 checkpoints: greedy tokens equal transformers' on the dequantized float weights, at
tensor parallel 1 and 2 and pipeline parallel 2, for Llama- and Qwen2-shaped models, Gemma 3 and Phi-3
(its fused tensors split per rank)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from quant_checkpoints import FORMATS, pack_int32, save_quantized
from shardserve.planner.model_source import load_model as load_model_info
from shardserve.planner.rules import tensor_parallel_problem
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.config import ParallelConfig, load_model_config
from shardserve.runtime.distributed.parallel_layout import check_parallel_layout
from shardserve.runtime.layers.quantization.packed_int import AWQ_ORDER, unpack_int32
from test_runtime_matches_transformers import random_prompts, reference, token_outputs

PROMPTS = random_prompts(11, [1, 5, 17, 30])
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="session")
def quantized(tmp_path_factory):
    """(family, format) -> (folder, transformers model on the dequantized weights, its greedy tokens)."""
    cache = {}

    def make(family: str, fmt: str, **kwargs):
        key = (family, fmt, tuple(sorted(kwargs.items())))
        if key not in cache:
            folder = str(tmp_path_factory.mktemp(f"{family}_{fmt}".replace("-", "_")) / "model")
            hf_model = save_quantized(folder, family, fmt, **kwargs)
            cache[key] = folder, hf_model, reference(hf_model, PROMPTS, MAX_TOKENS)
        return cache[key]

    return make


def test_unpack_inverts_the_format_packers():
    values = torch.randint(0, 16, (6, 16))
    assert torch.equal(unpack_int32(pack_int32(values, 4, 1, AWQ_ORDER), 4, 1, AWQ_ORDER), values)
    tall = torch.randint(0, 16, (16, 6))
    assert torch.equal(unpack_int32(pack_int32(tall, 4, 0), 4, 0), tall)
    wide = torch.randint(0, 256, (8, 3))
    assert torch.equal(unpack_int32(pack_int32(wide, 8, 0), 8, 0), wide)
    # AWQ's order spelled out: the low nibble is column 0, the next column 2, then 4, 6, 1, 3, 5, 7
    row = torch.arange(8).reshape(1, 8)
    assert pack_int32(row, 4, 1, AWQ_ORDER).item() == sum(c << (4 * j) for j, c in enumerate(AWQ_ORDER))


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gemma3", "phi3"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_greedy_matches_dequantized_transformers(family, fmt, quantized):
    folder, _, expected = quantized(family, fmt)
    assert len({t for seq in expected for t in seq}) > 5
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4)
    assert llm.engine.config.model.quantization.format == FORMATS[fmt]["quant_method"]
    assert token_outputs(llm, PROMPTS, GREEDY) == expected


PARALLEL = [("llama3", "awq", 2, 1), ("qwen2", "gptq4-act-order", 2, 1), ("llama3", "gptq8-sym", 2, 1),
            ("qwen2", "fp8-tensor", 2, 1), ("llama3", "fp8-channel", 2, 1), ("qwen2", "fp8-block", 2, 1),
            ("qwen2", "awq", 1, 2), ("llama3", "gptq4-act-order", 1, 2), ("qwen2", "fp8-channel", 1, 2),
            ("phi3", "awq", 2, 1), ("phi3", "gptq4-act-order", 2, 1), ("phi3", "fp8-block", 2, 1),  # fused, cut per rank
            ("llama3", "gptq4-act-order-g32", 2, 1), ("qwen2", "gptq4-act-order-g32", 1, 2)]  # g32: 96 / 2 = 48


@pytest.mark.slow
@pytest.mark.parametrize("family, fmt, tp, pp", PARALLEL, ids=[f"{f}-{q}-tp{t}-pp{p}" for f, q, t, p in PARALLEL])
def test_parallel_greedy_matches_dequantized_transformers(family, fmt, tp, pp, quantized):
    folder, _, expected = quantized(family, fmt, num_layers=3 if pp > 1 else 2)
    with LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4, tensor_parallel_size=tp,
             pipeline_parallel_size=pp, distributed_executor_backend="mp") as llm:
        assert token_outputs(llm, PROMPTS, GREEDY) == expected


def test_group_split_refused_with_the_planners_reason(quantized, tmp_path):
    folder, _, _ = quantized("llama3", "awq")
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["group_size"] = 32  # 96 intermediate features / 2 ranks = 48
    odd = tmp_path / "odd"
    odd.mkdir()
    for file in os.listdir(folder):
        if file != "config.json":
            os.symlink(os.path.join(folder, file), odd / file)
    (odd / "config.json").write_text(json.dumps(config))
    reason = tensor_parallel_problem(load_model_info(str(odd)).spec, 2)
    assert reason == "awq group_size 32 does not divide the intermediate size per rank (96 / 2 = 48)"
    model_config = load_model_config(str(odd))
    check_parallel_layout(model_config, ParallelConfig(1, 1), None)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 cannot shard this model: " + re.escape(reason)):
        check_parallel_layout(model_config, ParallelConfig(2, 1), None)


def test_online_fp8_of_a_float_checkpoint_matches_per_row_fp8_weights(checkpoint_factory):
    """--quantization fp8 on a float checkpoint: each linear weight becomes fp8 with one scale per row."""
    from quant_checkpoints import FORMATS, LINEARS, fp8_tensors

    folder, hf_model = checkpoint_factory("qwen2")
    reference_model = type(hf_model)(hf_model.config).eval()
    state = hf_model.state_dict()
    for name, value in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            state[name] = fp8_tensors(value, FORMATS["fp8-channel"], "")[1]
    reference_model.load_state_dict(state)
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, quantization="fp8")
    layer = llm.engine.executor.worker.model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (192, 1)
    assert token_outputs(llm, PROMPTS, GREEDY) == reference(reference_model, PROMPTS, MAX_TOKENS)
