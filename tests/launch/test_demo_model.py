"""The bundled demo checkpoint is a real, small Hugging Face model that transformers can run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from shardserve.launch.demo import DEMO_MODEL_DIR

MAX_FOLDER_BYTES = 12 * 2**20


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR).eval()


def test_folder_holds_a_hugging_face_checkpoint():
    names = {p.name for p in DEMO_MODEL_DIR.iterdir()}
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= names
    assert list(DEMO_MODEL_DIR.glob("*.safetensors"))
    tokenizer_config = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())
    assert "chat_template.jinja" in names or "chat_template" in tokenizer_config


def test_folder_is_small_enough_for_the_repo():
    num_bytes = sum(p.stat().st_size for p in DEMO_MODEL_DIR.rglob("*") if p.is_file())
    assert num_bytes < MAX_FOLDER_BYTES


def test_config_and_tokenizer_agree(model, tokenizer):
    generation = GenerationConfig.from_pretrained(DEMO_MODEL_DIR)
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tokenizer)
    assert generation.eos_token_id == model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.bos_token_id == tokenizer.bos_token_id


def test_transformers_generates_text(model, tokenizer):
    prompt = tokenizer("The function returns", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape == (1, prompt.shape[1] + 8)
    text = tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
    assert any(ch.isalpha() for ch in text)


UTF8_SAMPLES = ["héllo wörld — ✓", "  two  spaces\nand a tab\t.", "日本語 🙂"]


@pytest.mark.parametrize("text", UTF8_SAMPLES)
def test_tokenizer_round_trips_utf8(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_chat_template_renders_turns_and_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith(tokenizer.bos_token)
    assert "<|system|>\nBe brief.<|end_of_text|>" in prompt
    assert "<|user|>\nHi<|end_of_text|>" in prompt
    assert prompt.endswith("<|assistant|>\n")
    closed = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not closed.endswith("<|assistant|>\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert ids["input_ids"][-2] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_rebuilding_never_overwrites_the_shipped_checkpoint_unless_asked():
    from shardserve.launch.demo.build import parse_args
    assert parse_args([]).out.resolve() != DEMO_MODEL_DIR.resolve()
    assert parse_args(["--out", str(DEMO_MODEL_DIR)]).out == DEMO_MODEL_DIR
