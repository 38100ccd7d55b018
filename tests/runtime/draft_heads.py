"""Draft heads' checkpoints for the tests: EAGLE-3 heads as the EAGLE authors' are laid out (config.json with
architectures LlamaForCausalLMEagle3, draft_vocab_size and eagle_config; tensors midlayer.*, fc, norm, lm_head,
d2t and t2d; an embed_tokens or none), and models with their multi-token-prediction layers as DeepSeek-V3's and
Qwen3.5's releases carry them."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

AUX_LAYERS = [0, 1, 2]  # the tests' targets have 2 layers: both layers' inputs and the last one's output


def save_eagle3_head(folder: str, target: str, tensors: dict[str, torch.Tensor], draft_vocab_size: int | None = None,
                     **config_changes) -> str:
    """`tensors` complete (random_head_tensors or a test's own); config.json from the target's, as a head's."""
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                  draft_vocab_size=draft_vocab_size or config["vocab_size"],
                  eagle_config={"eagle_aux_hidden_state_layer_ids": AUX_LAYERS}, **config_changes)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(folder, "model.safetensors"))
    return folder


def head_shapes(target: str, draft_vocab_size: int | None = None) -> dict[str, tuple[int, ...]]:
    with open(os.path.join(target, "config.json")) as f:
        c = json.load(f)
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return {"midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
            "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
            "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
            "midlayer.mlp.down_proj.weight": (h, inter), "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,), "midlayer.post_attention_layernorm.weight": (h,),
            "fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (draft_vocab_size or vocab, h),
            "embed_tokens.weight": (vocab, h)}


def random_head_tensors(target: str, seed: int, own_embedding: bool = True) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: (1.0 + 0.1 * torch.randn(shape, generator=generator)) if len(shape) == 1
               else 0.15 * torch.randn(shape, generator=generator)
               for name, shape in head_shapes(target).items()}
    if not own_embedding:
        del tensors["embed_tokens.weight"]
    return tensors


def save_mtp_checkpoint(folder: str) -> torch.nn.Module:
    """A DeepSeek-V3 checkpoint with its multi-token-prediction layer, `model.layers.{L}.` after its L layers, as the
    released checkpoints carry it: the decoder layer (here a copy of the last, sparse one), enorm, hnorm, eh_proj,
    shared_head (norm and head) and its copy of the embedding. Returns the transformers model (without it)."""
    from safetensors.torch import load_file

    from runtime_checkpoints import save_checkpoint

    model = save_checkpoint(folder, "deepseek_v3")
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    last, mtp = model.config.num_hidden_layers - 1, model.config.num_hidden_layers
    tensors.update({name.replace(f"model.layers.{last}.", f"model.layers.{mtp}."): t.clone()
                    for name, t in tensors.items() if name.startswith(f"model.layers.{last}.")})
    generator = torch.Generator().manual_seed(9)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    prefix = f"model.layers.{mtp}."
    tensors.update({prefix + "enorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
                    prefix + "hnorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
                    prefix + "eh_proj.weight": 0.15 * torch.randn(hidden, 2 * hidden, generator=generator),
                    prefix + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=generator),
                    prefix + "shared_head.head.weight": 0.15 * torch.randn(vocab, hidden, generator=generator),
                    prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    save_file(tensors, path, metadata={"format": "pt"})
    return model


def save_qwen_mtp_checkpoint(folder: str, family: str, num_layers: int) -> torch.nn.Module:
    """A Qwen3.5 / Qwen3-Next checkpoint with its MTP layer as the releases carry it: `mtp.layers.0.` (here a copy
    of the last, full-attention layer), mtp.fc, the zero-centred mtp.pre_fc_norm_embedding, pre_fc_norm_hidden and
    norm, and the count in config.json (mtp_num_hidden_layers; Qwen3-Next's num_nextn_predict_layers)."""
    from safetensors.torch import load_file

    from runtime_checkpoints import save_checkpoint

    model = save_checkpoint(folder, family, num_layers=num_layers)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    prefix = next(p for p in ("model.language_model.layers.", "model.layers.") if any(n.startswith(p) for n in tensors))
    last = f"{prefix}{num_layers - 1}."
    tensors.update({"mtp.layers.0." + name[len(last):]: t.clone() for name, t in tensors.items() if name.startswith(last)})
    generator = torch.Generator().manual_seed(13)
    hidden = model.config.get_text_config().hidden_size
    tensors.update({"mtp.fc.weight": 0.15 * torch.randn(hidden, 2 * hidden, generator=generator),
                    **{f"mtp.{name}.weight": 0.1 * torch.randn(hidden, generator=generator)
                       for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}})
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    text["num_nextn_predict_layers" if family == "qwen3_next" else "mtp_num_hidden_layers"] = 1
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return model
