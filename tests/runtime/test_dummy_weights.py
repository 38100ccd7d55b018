"""load_format dummy (vLLM's benchmarking mode): a folder with config.json and the tokenizer, no weight files,
serves random weights of the model's shapes, float and quantized; other load formats are refused by name,
and so is turning chunked prefill off (the scheduler always chunks)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
import torch

from shardserve.launch.demo import DEMO_MODEL_DIR
from shardserve.planner.settings import SettingError
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.worker.dummy_weights import DUMMY_RANGE, fill_dummy_weights
from shardserve.runtime.engine_args import EngineArgs
from shardserve.runtime.worker.loader import load_model
from tests.runtime.quant_checkpoints import FORMATS

POOL = 1 << 25
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def without_weights(source: str, folder) -> str:
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(source):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(source, name), folder)
    return str(folder)


def test_dummy_weights_need_no_weight_files(tmp_path):
    folder = without_weights(str(DEMO_MODEL_DIR), tmp_path / "model")
    with pytest.raises(ValueError, match="no model.safetensors"):
        LLM(folder, device="cpu", kv_cache_memory_bytes=POOL)
    with LLM(folder, device="cpu", kv_cache_memory_bytes=POOL, load_format="dummy") as llm:
        assert llm.engine.config.model.load_format == "dummy"
        out = llm.generate(["The Python interpreter"], GREEDY)[0].outputs[0]
        assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_dummy_weights_are_small_random_and_of_the_checkpoints_shapes(tmp_path):
    config = EngineArgs(model=str(DEMO_MODEL_DIR), device="cpu").create_engine_config().model
    real = dict(load_model(config, torch.device("cpu")).named_parameters())  # one rank: the whole model
    dummy = load_model(replace(config, load_format="dummy"), torch.device("cpu"))
    drawn = {n: p.clone() for n, p in dummy.named_parameters()}
    fill_dummy_weights(dummy)  # the same draws again: seeded
    assert {n: p.shape for n, p in drawn.items()} == {n: p.shape for n, p in real.items()}
    for name, param in dummy.named_parameters():
        assert torch.equal(param, drawn[name]), name
        assert param.abs().max() <= DUMMY_RANGE and param.float().std() > 0, name


@pytest.mark.parametrize("fmt", ["gptq4-act-order", "awq", "fp8-block"])
def test_quantized_dummy_weights_serve(tmp_path, fmt):
    folder = without_weights(str(DEMO_MODEL_DIR), tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "quantization_config": FORMATS[fmt]}))
    with LLM(folder, device="cpu", kv_cache_memory_bytes=POOL, load_format="dummy") as llm:
        assert len(llm.generate(["hello"], GREEDY)[0].outputs[0].token_ids) == 6


def test_other_load_formats_and_unchunked_prefill_are_refused_by_name():
    with pytest.raises(SettingError, match="load_format='pt' must be one of auto, safetensors, dummy"):
        LLM(str(DEMO_MODEL_DIR), device="cpu", load_format="pt")
    with pytest.raises(SettingError, match="enable_chunked_prefill=False is not served: the scheduler always "
                                           "chunks prefills"):
        LLM(str(DEMO_MODEL_DIR), device="cpu", enable_chunked_prefill=False)
