"""PEFT LoRA adapters for the tests, made with peft from a tiny transformers model: random A and B (not
PEFT's zero B), saved with save_pretrained, and the model with the adapter merged as the reference."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(folder: str, hf_model, seed: int, rank: int, modules: list[str], **options):
    """Write a LoRA of `hf_model` to `folder`; returns the merged transformers model."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False, **options)
    model = get_peft_model(copy.deepcopy(hf_model), config)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()
