"""Multi-head latent attention (DeepSeek-V2/V3): the cache holds one latent per token, not K and V per head.

    hidden -> kv_a_proj_with_mqa -> [latent (kv_lora_rank), k_pe (qk_rope_head_dim)]
    latent -> kv_a_layernorm;  k_pe rotated (interleaved pairs), shared by every head
    cache entry per token and layer = [latent | k_pe]: kv_lora_rank + qk_rope_head_dim values, one plane,
    the same on every tensor-parallel rank (the heads are split, the latent is not)

With kv_b_proj = per head [W_UK (qk_nope_head_dim rows) | W_UV (v_head_dim rows)] over the latent, a head's
score q_nope . (W_UK c) + q_pe . k_pe equals (W_UK^T q_nope) . c + q_pe . k_pe, and its output
sum_j p_j W_UV c_j equals W_UV (sum_j p_j c_j). So the attention runs with W_UK absorbed into the query,
as multi-query attention over the cache entries themselves (keys = entries, values = their latent part),
and W_UV is applied once to each head's output: the latent is never expanded per head.
NOTE: prefill runs in this absorbed form too (exact, but its scores cost kv_lora_rank + qk_rope_head_dim
per head rather than qk_nope + qk_rope); an expanded prefill path would save compute on long prompts."""

from __future__ import annotations

import torch
from torch import nn

from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from shardserve.runtime.layers.norm import RMSNorm
from shardserve.runtime.layers.rotary import RotaryEmbedding, rope_parameters, yarn_mscale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: DeepSeek's default, not config.rms_norm_eps


def mla_softmax_scale(config) -> float:
    """1 / sqrt(qk_nope + qk_rope), times yarn's mscale(factor, mscale_all_dim) squared under yarn."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = rope_parameters(config)
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return scale


def mla_rotary(config, max_position: int) -> RotaryEmbedding:
    """The rotation of q_pe and k_pe (qk_rope_head_dim features), one table for every layer."""
    return RotaryEmbedding(config.qk_rope_head_dim, max_position, rope_parameters(config),
                           interleaved=bool(getattr(config, "rope_interleave", True)))


class MLAAttention(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding):
        super().__init__()
        heads, hidden, bias = config.num_attention_heads, config.hidden_size, bool(config.attention_bias)
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank = config.kv_lora_rank
        qk_dim = self.nope + self.rope
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_dim, bias=False)
            self.num_heads = self.q_b_proj.output_size_per_rank // qk_dim
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, bias=False)
            self.num_heads = self.q_proj.output_size_per_rank // qk_dim
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.rank + self.rope, mla_softmax_scale(config), 1, cache_planes=1)

    def absorbed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, qk_nope, rank] and W_UV [heads, v_dim, rank] of this rank's heads: views of a float
        kv_b_proj, or its weight dequantized (per call: no second copy held beside the quantized one)."""
        layer = self.kv_b_proj
        weight = layer.weight if layer.quant_method is None else layer.quant_method.dequantize(layer).to(dtype)
        per_head = weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return per_head[:, : self.nope], per_head[:, self.nope:]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))) if self.q_lora_rank else self.q_proj(hidden)
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))  # k_pe: [tokens, 1, rope]
        entry = torch.cat([self.kv_a_layernorm(latent.contiguous()).unsqueeze(1), k_pe], dim=-1)  # [tokens, 1, rank + rope]
        w_uk, w_uv = self.absorbed(hidden.dtype)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        out = self.attn(torch.cat([q_latent, q_pe], dim=-1), entry, entry)  # [tokens, heads * (rank + rope)]
        out_latent = out.view(-1, self.num_heads, self.rank + self.rope)[..., : self.rank]
        return self.o_proj(torch.einsum("thr,hvr->thv", out_latent, w_uv).reshape(-1, self.num_heads * self.v_dim))
