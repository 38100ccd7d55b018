"""Checkpoint loading (single and sharded), the architecture registry, and start-up/request refusals."""

from __future__ import annotations

import logging
import os

import pytest

from shardserve.planner import PlanError
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.config import load_model_config
from shardserve.runtime.models.registry import supported_architectures


def test_sharded_checkpoint_matches_single_file(checkpoint_factory):
    single, _ = checkpoint_factory("mistral")
    sharded, _ = checkpoint_factory("mistral", max_shard_size="60KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    a = LLM(single, device="cpu", kv_cache_memory_bytes=2**22).generate(prompts, params)
    b = LLM(sharded, device="cpu", kv_cache_memory_bytes=2**22).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_unknown_architecture_is_refused_by_name(checkpoint_factory, tmp_path):
    folder, _ = checkpoint_factory("gpt2")
    for name in os.listdir(folder):
        data = open(os.path.join(folder, name), "rb").read()
        if name == "config.json":
            data = data.replace(b"GPT2LMHeadModel", b"FalconForCausalLM")
        (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match="FalconForCausalLM.*not supported.*GPT2LMHeadModel"):
        LLM(str(tmp_path), device="cpu", kv_cache_memory_bytes=2**22)
    assert "Qwen3ForCausalLM" in supported_architectures()


def test_skip_tokenizer_init_takes_token_ids_only(checkpoint_factory, tmp_path):
    folder, _ = checkpoint_factory("opt", with_tokenizer=False)
    llm = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, skip_tokenizer_init=True)
    (output,) = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 4 and output.outputs[0].text == ""
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate("some text")
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        LLM(folder, device="cpu", kv_cache_memory_bytes=2**22)


def test_max_model_len_that_does_not_fit_names_the_largest(checkpoint_factory, kv_bytes_for):
    folder, _ = checkpoint_factory("qwen3")
    with pytest.raises(ValueError, match="set max_model_len <= 40"):
        LLM(folder, device="cpu", block_size=4, max_model_len=200, kv_cache_memory_bytes=kv_bytes_for(folder, 10, 4))
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        load_model_config(folder, max_model_len=1000)


def test_pool_size_is_logged_and_reported(checkpoint_factory, kv_bytes_for, caplog):
    folder, _ = checkpoint_factory("qwen3")
    with caplog.at_level(logging.INFO, logger="shardserve.runtime"):
        llm = LLM(folder, device="cpu", block_size=4, max_model_len=64, kv_cache_memory_bytes=kv_bytes_for(folder, 50, 4))
    info = llm.kv_cache_info
    assert (info.num_blocks, info.num_tokens, info.max_concurrency) == (50, 200, 50 / 16)
    assert "KV cache size: 200 tokens" in caplog.text
    assert "Maximum concurrency for 64 tokens per request: 3.12x" in caplog.text


def test_requests_that_can_never_fit_are_rejected(checkpoint_factory):
    folder, _ = checkpoint_factory("qwen3")
    llm = LLM(folder, device="cpu", max_model_len=32, kv_cache_memory_bytes=2**22)
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.generate({"prompt_token_ids": [5] * 30}, SamplingParams(max_tokens=5))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"\[0, 320\)"):
        llm.generate({"prompt_token_ids": [5, 9999]})


def test_legacy_rope_scaling_config_is_read_like_transformers(checkpoint_factory, tmp_path):
    """Published Llama 3.1 folders spell rope settings as rope_theta + rope_scaling (older format)."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    folder, _ = checkpoint_factory("llama3")
    for name in os.listdir(folder):
        shutil.copy(os.path.join(folder, name), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompt = list(range(40, 90))  # past original_max_position_embeddings=32, where llama3 scaling matters
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    ids = torch.tensor([prompt])
    expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
    llm = LLM(str(tmp_path), device="cpu", kv_cache_memory_bytes=2**22)
    (output,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert output.outputs[0].token_ids == expected


def test_weights_and_cache_are_converted_to_the_requested_dtype(checkpoint_factory):
    import torch

    folder, hf_model = checkpoint_factory("qwen3")
    full = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22)
    half = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, dtype="bfloat16")
    worker = half.engine.executor.worker
    assert {p.dtype for p in worker.model.parameters()} == {torch.bfloat16}
    assert worker.kv_cache.dtype == torch.bfloat16
    assert half.kv_cache_info.num_blocks == 2 * full.kv_cache_info.num_blocks  # half the bytes per block
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    with torch.no_grad():
        first_token = hf_model(torch.tensor([prompt])).logits[0, -1].argmax().item()
    (output,) = half.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1))
    assert output.outputs[0].token_ids == [first_token]
    with pytest.raises(ValueError, match="dtype 'float8': use auto, bfloat16"):
        LLM(folder, device="cpu", dtype="float8")


def test_model_id_in_the_local_hugging_face_cache(checkpoint_factory, tmp_path, monkeypatch):
    """LLM("org/name") serves the snapshot refs/main names, tokenizer included."""
    import shutil

    folder, _ = checkpoint_factory("qwen2")
    repo = tmp_path / "models--acme--tiny-qwen2"
    shutil.copytree(folder, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=6)
    cached = LLM("acme/tiny-qwen2", device="cpu", kv_cache_memory_bytes=2**22)
    assert cached.engine.config.model.model == str(repo / "snapshots" / "abc123")
    expected = LLM(folder, device="cpu", kv_cache_memory_bytes=2**22).generate("The quick", params)
    assert cached.generate("The quick", params)[0].outputs[0].text == expected[0].outputs[0].text
    with pytest.raises(PlanError, match="acme/not-cached is not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        LLM("acme/not-cached", device="cpu")  # the suite runs offline: launch's error, the Hub not asked
