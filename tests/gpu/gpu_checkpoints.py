"""Random Llama, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3, Phi-3, DeepSeek-V3 and gpt-oss checkpoints for the GPU tests (transformers
save_pretrained), bigger than the CPU tests' so that the kernels see real head sizes, GQA groups and
several KV blocks per request."""

from __future__ import annotations

import torch

VOCAB_SIZE = 512


def gpu_config(family: str, num_hidden_layers: int = 3):
    import transformers as tf

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=num_hidden_layers, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if family == "llama":
        return tf.LlamaConfig(head_dim=64, **common)  # GQA groups of 4
    if family == "qwen3":
        return tf.Qwen3Config(head_dim=128, tie_word_embeddings=False, **common)  # head_dim above hidden / heads
    if family == "gemma2":  # soft caps in the kernels and the head; local layers (window 64); untied head
        return tf.Gemma2Config(head_dim=128, query_pre_attn_scalar=128, sliding_window=64, attn_logit_softcapping=50.0,
                               final_logit_softcapping=30.0, tie_word_embeddings=False, **common)
    if family == "gemma3":  # Gemma's 256-wide heads; local layers (window 64) with their own rope base
        # NOTE: an untied head: with the embedding scaled by sqrt(hidden), a random tied model repeats its input
        return tf.Gemma3TextConfig(head_dim=256, query_pre_attn_scalar=256, sliding_window=64, sliding_window_pattern=3,
                                   final_logit_softcapping=30.0, tie_word_embeddings=False, **common)
    if family == "phi3":  # fused checkpoint tensors, a quarter of each head unrotated, window 64
        return tf.Phi3Config(sliding_window=64, rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.75},
                             **common)
    if family == "qwen3_moe":  # 16 experts, top 4: the fused MoE kernel in a whole model
        return tf.Qwen3MoeConfig(head_dim=128, tie_word_embeddings=False, num_experts=16, num_experts_per_tok=4,
                                 moe_intermediate_size=256, norm_topk_prob=True, **common)
    if family == "deepseek_v3":  # MLA at serving widths (576-wide entries; 32 heads: two launches of 16), yarn,
        # noaux_tc routing over 16 experts in 4 groups, a dense first layer, one shared expert
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
        return tf.DeepseekV3Config(**{**common, "num_attention_heads": 32, "num_key_value_heads": 32},
                                   q_lora_rank=192, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                   v_head_dim=128, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                   moe_intermediate_size=256, n_shared_experts=1, first_k_dense_replace=1,
                                   rope_parameters=rope)
    if family == "gpt_oss":  # sinks in the kernels, window 64 on alternate layers, yarn, biased swigluoai experts
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 512,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        return tf.GptOssConfig(**{**common, "intermediate_size": 256}, head_dim=64, sliding_window=64,
                               num_local_experts=16, num_experts_per_tok=4, rope_parameters=rope)
    raise KeyError(family)


def save_gpu_checkpoint(folder: str, family: str, seed: int = 0, num_hidden_layers: int = 3):
    """Writes float32 weights (each run casts them to its dtype); returns the transformers model, float32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gpu_config(family, num_hidden_layers), dtype=torch.float32)
    with torch.no_grad():  # larger than the default init: peaked logits, so greedy argmax is robust in bf16
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    return model.eval()
