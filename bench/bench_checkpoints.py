"""The benchmarks' checkpoints: random weights of a real model's shapes (configs from the planner's catalog),
written once under a work folder, a word-per-id tokenizer, and a 4-bit AWQ copy for quantized decode."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from shardserve.planner.catalog import model_catalog

SHAPES = {"llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct", "qwen3-0.6b": "Qwen/Qwen3-0.6B"}
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048}


def make_checkpoint(shape: str, workdir: Path, small: bool, device: str, dummy: bool = False) -> Path:
    """Random weights with the shape's config, saved once; bf16 (float32 for --small on CPU). With dummy
    (vLLM's --load-format dummy) only config.json and the tokenizer: the engine draws the weights."""
    from transformers import AutoModelForCausalLM
    folder = workdir / (shape + ("-small" if small else "") + ("-dummy" if dummy else ""))
    if (folder / "config.json").exists():
        return folder
    hf_config = shape_config(shape, small)
    dtype = torch.float32 if small and device == "cpu" else torch.bfloat16
    partial = folder.with_name(folder.name + ".partial")
    if dummy:
        hf_config.dtype = dtype
        hf_config.save_pretrained(partial)
    else:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        model.save_pretrained(partial)
        del model
    save_word_tokenizer(partial, hf_config.vocab_size)
    os.replace(partial, folder)  # NOTE: a call cut off mid-save leaves no folder that looks complete
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def shape_config(shape: str, small: bool):
    """The transformers config of a shape (the planner's catalog entry; --small: tiny sizes)."""
    from transformers import AutoConfig
    config = dict(model_catalog()[SHAPES[shape]])
    if small:
        config |= SMALL | {"max_position_embeddings": 4096}
    arch = config["architectures"][0]
    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[arch]
    hf_config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "architectures"})
    hf_config.architectures = [arch]
    return hf_config


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """One word per id ("w0" ... "w{vocab_size - 1}"), so the server streams text for any token a
    random model samples."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(folder)


def make_awq_checkpoint(folder: Path) -> Path:
    """The float checkpoint's linear layers as random 4-bit AWQ tensors (group 128): speed, not quality."""
    import shutil

    from safetensors.torch import load_file, save_file
    awq = folder.with_name(folder.name + "-awq")
    if (awq / "config.json").exists():
        return awq
    partial = awq.with_name(awq.name + ".partial")
    shutil.copytree(folder, partial, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors, generator = {}, torch.Generator().manual_seed(0)

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-2**31, 2**31 - 1, shape, generator=generator, dtype=torch.int32)

    for file in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if name.endswith("_proj.weight") and ".layers." in name:
                out, num_in = tensor.shape
                prefix = name.removesuffix(".weight")
                tensors |= {f"{prefix}.qweight": words(num_in, out // 8), f"{prefix}.qzeros": words(num_in // 128, out // 8),
                            f"{prefix}.scales": (torch.rand(num_in // 128, out, generator=generator) * 1e-3).half()}
            else:
                tensors[name] = tensor
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((partial / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                     "version": "gemm"}
    (partial / "config.json").write_text(json.dumps(config, indent=1))
    (partial / "model.safetensors.index.json").unlink(missing_ok=True)
    os.replace(partial, awq)
    return awq
