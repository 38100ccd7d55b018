"""Factories for tiny random checkpoints (transformers' save_pretrained) and a tiny trained tokenizer, and
transformers' pooled hidden states on them (the embeddings' reference)."""

from __future__ import annotations

import json
import os

import torch

VOCAB_SIZE = 320
CYCLE_PERIOD = 5  # save_cycle_checkpoint's (VOCAB_SIZE is a multiple)
BOS, EOS, PAD = 0, 1, 2
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching admits new requests every step.",
    "naïve café déjà vu — ünïcödé text, 日本語のテキスト, 中文文本, emoji 🙂🚀.",
    "Ceci n'est pas une pipe. Über den Wolken. ¿Qué tal?",
] * 20


def build_tokenizer(folder: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


LONGROPE_FACTORS = {"short_factor": [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0],
                    "long_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}
# family -> (rope_parameters, max_position_embeddings)
ROPE_SCALING = {
    "llama-yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 64),
    "llama-yarn-mscale": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                           "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 8, "beta_slow": 2,
                           "truncate": False}, 64),
    "llama-dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 16),
    "llama-longrope": ({"rope_type": "longrope", "original_max_position_embeddings": 16,
                        **LONGROPE_FACTORS}, 64),
    "llama-linear": ({"rope_type": "linear", "factor": 2.0}, 16),
}


def family_config(family: str, num_layers: int = 2, max_position_embeddings: int = 256):
    import transformers as tf

    common = dict(vocab_size=VOCAB_SIZE, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    llama_like = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=max_position_embeddings, **common)
    if family == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return tf.LlamaConfig(rope_parameters=rope, **llama_like)
    if family == "llama2-linear-tied":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        return tf.LlamaConfig(rope_parameters=rope, tie_word_embeddings=True, attention_bias=True, **llama_like)
    if family in ROPE_SCALING:  # pretraining length 16: prompts up to 16 tokens, generation past it
        rope, positions = ROPE_SCALING[family]
        return tf.LlamaConfig(rope_parameters={"rope_theta": 10000.0, **rope},
                              **{**llama_like, "max_position_embeddings": positions})
    if family == "mistral":
        return tf.MistralConfig(sliding_window=None, head_dim=16, **llama_like)
    if family == "mistral-window":  # every layer attends over the last 8 positions
        return tf.MistralConfig(sliding_window=8, head_dim=16, **llama_like)
    if family == "qwen2-window":  # layers from max_window_layers on attend over the last 8 positions
        return tf.Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **llama_like)
    if family == "qwen2":
        return tf.Qwen2Config(tie_word_embeddings=True, **llama_like)
    if family == "qwen3":
        return tf.Qwen3Config(head_dim=24, tie_word_embeddings=False, **llama_like)
    if family == "mixtral":
        return tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **llama_like)
    if family == "qwen2_moe":  # layer 1 dense (mlp_only_layers); top-k weights not renormalized
        return tf.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, mlp_only_layers=[1], **llama_like)
    if family == "qwen3_moe":  # decoder_sparse_step 2: odd layers sparse; renormalized top-k
        return tf.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 decoder_sparse_step=2, norm_topk_prob=True, head_dim=24, **llama_like)
    if family.startswith("deepseek"):
        return _deepseek_config(tf, family, llama_like)
    if family == "gpt_oss":  # alternate layers attend over the last 8 positions; a low clamp, so it bites
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": max_position_embeddings // 4}
        return tf.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, head_dim=16,
                               swiglu_limit=1.5, rope_parameters=rope, **{**llama_like, "intermediate_size": 64})
    if family in ("gemma2", "gemma3", "phi3", "phi3-longrope"):
        return _gemma_phi3_config(tf, family, llama_like)
    if family.startswith(("qwen3_5", "qwen3_next")):
        return _qwen3_5_config(tf, family, num_layers, common)
    if family == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=num_layers, n_head=4, n_positions=256, **common)
    if family == "opt":
        return tf.OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=num_layers, num_attention_heads=4,
                            max_position_embeddings=256, word_embed_proj_dim=64, **common)
    if family == "opt-postln-proj":  # like opt-350m: LayerNorm after each block, 32-wide embeddings projected
        return tf.OPTConfig(hidden_size=64, ffn_dim=96, num_hidden_layers=num_layers, num_attention_heads=4,
                            max_position_embeddings=256, word_embed_proj_dim=32, do_layer_norm_before=False,
                            **common)
    raise KeyError(family)


def _deepseek_config(tf, family: str, llama_like: dict):
    """MLA with a 32-wide latent and 8 rotated features; layer 0 dense, then 8 routed experts (top 2)
    plus shared ones. deepseek_v2_lite: no q compression, softmax greedy routing (V2-Lite's shape);
    deepseek_v2: group-limited routing; deepseek_v3: sigmoid noaux_tc over 4 groups, yarn with mscale."""
    mla = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32,
               n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1)
    shape = {**llama_like, "num_key_value_heads": llama_like["num_attention_heads"]}
    if family == "deepseek_v2_lite":
        return tf.DeepseekV2Config(q_lora_rank=None, n_shared_experts=2, topk_method="greedy", **mla, **shape)
    if family == "deepseek_v2":
        return tf.DeepseekV2Config(q_lora_rank=48, n_shared_experts=1, topk_method="group_limited_greedy", n_group=4,
                                   topk_group=2, routed_scaling_factor=1.5, **mla, **shape)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
    return tf.DeepseekV3Config(q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=2.5, rope_parameters=rope, **mla, **shape)


def _qwen3_5_config(tf, family: str, num_layers: int, common: dict):
    """Hybrid Gated DeltaNet models: every 4th layer and the last full attention (gated, a quarter of each
    32-wide head rotated), the rest linear attention (2 key heads of 16, 4 value heads of 8, kernel 4).
    qwen3_5_vl / qwen3_5_moe_vl: the multimodal checkpoint (a one-block vision tower beside the text)."""
    types = ["full_attention" if (i + 1) % 4 == 0 or i == num_layers - 1 else "linear_attention"
             for i in range(num_layers)]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    text = dict(hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, max_position_embeddings=256, layer_types=types, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                tie_word_embeddings=False, **common)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    mrope = {**rope, "mrope_section": [2, 1, 1], "mrope_interleaved": True}  # Qwen3.5's: t, h, w frequencies
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    if family == "qwen3_next":  # layer 1 dense (mlp_only_layers); renormalized top-k
        return tf.Qwen3NextConfig(intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=True, rope_parameters=rope,
                                  **experts, **text)
    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(intermediate_size=96, rope_parameters=mrope, **text)
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(rope_parameters=mrope, **experts, **text)
    if family == "qwen3_5_vl":  # tied as the small Qwen3.5 are: said at the top level, not in text_config
        return tf.Qwen3_5Config(text_config=dict(intermediate_size=96, rope_parameters=mrope, **text),
                                vision_config=vision, tie_word_embeddings=True)
    return tf.Qwen3_5MoeConfig(text_config=dict(rope_parameters=mrope, **experts, **text), vision_config=vision,
                               tie_word_embeddings=False)  # qwen3_5_moe_vl


def _gemma_phi3_config(tf, family: str, llama_like: dict):
    """Caps small enough to bite on random weights; windows of 8 so prompts outgrow them."""
    gemma = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, hidden_activation="gelu_pytorch_tanh")
    if family == "gemma2":  # layers alternate local (even) and global (odd)
        return tf.Gemma2Config(attn_logit_softcapping=4.0, final_logit_softcapping=6.0, **gemma, **llama_like)
    if family == "gemma3":  # every 2nd layer global; local layers rotate with their own base; untied head
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
        return tf.Gemma3TextConfig(final_logit_softcapping=6.0, sliding_window_pattern=2, rope_parameters=rope,
                                   tie_word_embeddings=False, **gemma, **llama_like)
    if family == "phi3":  # a quarter of each head unrotated
        return tf.Phi3Config(sliding_window=8, rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.75},
                             **llama_like)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, **LONGROPE_FACTORS}  # phi3-longrope
    return tf.Phi3Config(rope_parameters=rope, original_max_position_embeddings=16,
                         **{**llama_like, "max_position_embeddings": 64})


FAMILIES = ["llama3", "llama2-linear-tied", "mistral", "mistral-window", "qwen2", "qwen2-window", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe",
            "deepseek_v2_lite", "deepseek_v2", "deepseek_v3", "gpt_oss", "gemma2", "gemma3", "phi3", "gpt2", "opt", "opt-postln-proj"]


# NOTE: transformers 5.23's cached generate of gpt-oss departs from its own full forward once a sequence
# passes the sliding window (a 13-token prompt over an 8-token window: tokens 2 on differ), so gpt-oss's
# reference recomputes the whole sequence for every token (generate's use_cache=False), the model's definition
FULL_FORWARD_REFERENCE = ("gpt_oss",)


def save_checkpoint(folder: str, family: str, with_tokenizer: bool = True, seed: int = 0,
                    max_shard_size: str | None = None, num_layers: int = 2, max_position_embeddings: int = 256):
    """Write a random model of `family` to `folder`; returns the transformers model (eval, float32)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = family_config(family, num_layers, max_position_embeddings)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    std = 0.3 if family.startswith("opt") else 0.15
    with torch.no_grad():  # larger weights than the default init make logits less flat, so argmax is robust
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
            elif "bias" in name:
                param.normal_(0.0, 0.05)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    if with_tokenizer:
        build_tokenizer(folder)
    return model.eval()


def save_cycle_checkpoint(folder: str, period: int = CYCLE_PERIOD, slice_size: int = 16) -> None:
    """A Llama whose next token follows its current one around cycles of `period` ids (attention and MLP write
    nothing; the head maps each embedding to its successor's row), so its outputs repeat and drafts land. Each
    `slice_size` features of an embedding (an attention head's share) have the same norm, so a head's query
    matches its own token's key best (tests/runtime/test_eagle3.py's token-reading head)."""
    model = save_checkpoint(folder, "llama3")
    ids = torch.arange(VOCAB_SIZE)
    successor = ids - ids % period + (ids % period + 1) % period
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        slices = embed.view(VOCAB_SIZE, -1, slice_size)
        slices.div_(slices.norm(dim=2, keepdim=True)).mul_(0.6)
        head = torch.empty_like(model.lm_head.weight)
        head[successor] = embed / embed.norm(dim=1, keepdim=True) * 3.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)


def bytes_per_block(folder: str, block_size: int) -> int:
    from transformers import AutoConfig

    from shardserve.planner.kv_groups import model_kv_groups

    c = AutoConfig.from_pretrained(folder)
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    hidden = getattr(c, "hidden_size", None) or c.n_embd
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    layers = getattr(c, "num_hidden_layers", None) or c.n_layer
    groups = model_kv_groups({**c.to_dict(), "architectures": c.architectures})
    if groups.layers and (groups.is_hybrid or len(groups.layers) < layers):  # a page spans a group's layers (planner/kv_groups.py)
        layers = groups.group_size
    if getattr(c, "kv_lora_rank", None):  # MLA: one latent and rotated key per token and layer
        return block_size * (c.kv_lora_rank + c.qk_rope_head_dim) * layers * 4
    return 2 * block_size * kv_heads * head_dim * layers * 4


def save_sentence_transformers_model(folder: str, mode: str, with_normalize: bool) -> None:
    """Qwen3-Embedding's layout: the base model's weights (no `model.` prefix, no head) under a config.json
    naming Qwen3ForCausalLM, with modules.json and 1_Pooling/config.json beside them."""
    from transformers import AutoModel

    torch.manual_seed(3)
    config = family_config("qwen3")
    config.tie_word_embeddings = True
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(folder)
    build_tokenizer(folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        saved = json.load(f)
    with open(path, "w") as f:
        json.dump(saved | {"architectures": ["Qwen3ForCausalLM"]}, f)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if with_normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(folder, "1_Pooling"))
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
                   "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_lasttoken": mode == "lasttoken"}, f)


def pooled_reference(folder: str, prompts: list[list[int]], pooling_type: str, normalize: bool = True) -> torch.Tensor:
    """transformers' base model (AutoModel) on each prompt alone: its last hidden state, pooled."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]  # [num_tokens, hidden_size]
            rows.append({"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type])
    pooled = torch.stack(rows)
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled
