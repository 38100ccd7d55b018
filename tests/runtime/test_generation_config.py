"""The model's generation_config.json supplies sampling defaults where a request sets none (vLLM's
--generation-config auto); 'vllm' turns them off; another folder's file can stand in."""

from __future__ import annotations

import json
import shutil

import pytest

from shardserve.runtime import LLM, SamplingParams


@pytest.fixture(scope="module")
def greedy_by_default(checkpoint_factory, tmp_path_factory):
    """A copy of a tiny checkpoint whose generation_config.json asks for greedy, 5 tokens."""
    folder, _ = checkpoint_factory("llama3")
    copy = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "generation_config.json").read_text()) if (copy / "generation_config.json").exists() else {}
    (copy / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0, "max_new_tokens": 5,
                                                                      "top_p": 0.5}))
    return str(copy)


def test_defaults_come_from_the_models_generation_config(greedy_by_default):
    llm = LLM(greedy_by_default, device="cpu", kv_cache_memory_bytes=2**22)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_p=0.5, max_tokens=5)
    (implicit,) = llm.generate("hello world")
    (explicit,) = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=5))
    assert implicit.outputs[0].token_ids == explicit.outputs[0].token_ids and len(implicit.outputs[0].token_ids) == 5


def test_vllm_turns_the_defaults_off_and_a_folder_supplies_them(greedy_by_default, checkpoint_factory):
    llm = LLM(greedy_by_default, device="cpu", kv_cache_memory_bytes=2**22, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    plain, _ = checkpoint_factory("llama3")
    borrowed = LLM(plain, device="cpu", kv_cache_memory_bytes=2**22, generation_config=greedy_by_default)
    assert borrowed.get_default_sampling_params().temperature == 0.0
    with pytest.raises(ValueError, match="no generation_config.json there"):
        LLM(plain, device="cpu", kv_cache_memory_bytes=2**22, generation_config="/nonexistent/folder")
