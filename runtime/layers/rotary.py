"""Rotary position embedding (NeoX half-rotation layout) with default, linear, llama3, yarn, dynamic
and longrope scaling, as transformers computes each."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardserve.planner import hf_config
from shardserve.planner.served import ROPE_TYPES as SUPPORTED_ROPE_TYPES


def rope_parameters(config, layer_type: str = "full_attention") -> dict:
    """The rope settings of a transformers config (either spelling) for the layers of `layer_type`,
    checked against what is served."""
    values = {key: getattr(config, key, None) for key in
              ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings",
               "original_max_position_embeddings", "rope_local_base_freq", "partial_rotary_factor")}
    params = hf_config.rope_parameters(values, layer_type=layer_type)
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return params


def default_frequencies(rotary_dim: int, base) -> torch.Tensor:  # [rotary_dim // 2] or [n, rotary_dim // 2]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if isinstance(base, torch.Tensor):
        return 1.0 / (base[:, None] ** exponents)
    return 1.0 / (base ** exponents)


def rotation_angles(rotary_dim: int, num_positions: int, params: dict) -> torch.Tensor:
    """Angle of every (position, frequency): [num_positions, rotary_dim // 2], float32.
    NOTE: dynamic and longrope change the frequencies with the length; transformers recomputes them
    for the longest position of each forward. Here a token's rotation depends only on its own
    position, computed as transformers does when that token is the newest: equal to transformers
    for every generated token and every prompt within the pretraining length, and a prefix cache
    never holds keys that depend on which prompt wrote them."""
    positions = torch.arange(num_positions, dtype=torch.float32)
    kind = params["rope_type"]
    if kind == "dynamic":
        return positions[:, None] * _dynamic_frequencies(rotary_dim, num_positions, params)
    if kind == "longrope":
        return positions[:, None] * _longrope_frequencies(rotary_dim, num_positions, params)
    return torch.outer(positions, inverse_frequencies(rotary_dim, params))


def inverse_frequencies(rotary_dim: int, params: dict) -> torch.Tensor:  # [rotary_dim // 2], float32
    inv_freq = default_frequencies(rotary_dim, float(params["rope_theta"]))
    kind = params["rope_type"]
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        return _llama3_scale(inv_freq, params)
    if kind == "yarn":
        return _yarn_frequencies(rotary_dim, params)
    return inv_freq


def attention_factor(params: dict) -> float:
    """The scale yarn and longrope put on cos and sin (so on every attention logit, squared)."""
    kind, given = params["rope_type"], params.get("attention_factor")
    if kind not in ("yarn", "longrope") or given is not None:
        return 1.0 if given is None else float(given)
    factor = float(params["factor"])
    if kind == "longrope":
        old_len = params["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3_scale(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_frequencies(dim: int, params: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the pretraining length are
    interpolated by `factor`, those turning more than beta_fast times kept, a linear ramp between."""
    base, factor = float(params["rope_theta"]), float(params["factor"])
    old_len = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _dynamic_frequencies(dim: int, num_positions: int, params: dict) -> torch.Tensor:
    """Dynamic NTK: past the pretraining length L, position p uses base * (factor (p+1) / L -
    (factor - 1)) ** (dim / (dim - 2)). [num_positions, dim // 2]."""
    base, factor = float(params["rope_theta"]), float(params["factor"])
    old_len = params["original_max_position_embeddings"]
    lengths = torch.clamp(torch.arange(1, num_positions + 1), min=old_len)
    stretched = base * ((factor * lengths / old_len) - (factor - 1)) ** (dim / (dim - 2))
    original = default_frequencies(dim, base).expand(num_positions, -1)
    return torch.where((lengths > old_len)[:, None], default_frequencies(dim, stretched), original)


def _longrope_frequencies(dim: int, num_positions: int, params: dict) -> torch.Tensor:
    """LongRoPE: per-frequency short factors within the pretraining length, long ones past it."""
    old_len = params["original_max_position_embeddings"]
    base_freqs = float(params["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * base_freqs)
    long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * base_freqs)
    is_long = (torch.arange(1, num_positions + 1) > old_len)[:, None]
    return torch.where(is_long, long, short)


class RotaryEmbedding(nn.Module):
    """Rotates the first rotary_dim features of each head by position.
    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim].
    interleaved: the pairs rotated together are (x0, x1), (x2, x3), ... (GPT-J, DeepSeek's rope), not
    (x_i, x_{i + rotary_dim / 2}); the rotated features come out as NeoX's halves, the same order for q
    and k, which is all their dot product sees."""

    cos: torch.Tensor  # [max_position, rotary_dim // 2] buffers, the attention factor folded in
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, params: dict, rotary_dim: int | None = None,
                 interleaved: bool = False):
        super().__init__()
        self.head_dim, self.interleaved = head_dim, interleaved
        self.rotary_dim = rotary_dim or head_dim
        angles = rotation_angles(self.rotary_dim, max_position, params)  # [max_position, rotary_dim // 2]
        scale = attention_factor(params)
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, rotary_dim // 2]
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if self.interleaved else rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((rotated, rest), dim=-1) if rest.numel() else rotated
