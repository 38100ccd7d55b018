"""The checkpoint's tensor list: read from safetensors headers, or derived from config.json."""

from __future__ import annotations

import json
import os
import struct
from math import prod
from pathlib import Path

from shardserve.planner.errors import PlanError
from shardserve.planner.model_spec import ModelSpec, TensorInfo
from shardserve.planner.served import LINEAR_ATTENTION_FAMILIES

_SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def read_safetensors_headers(folder: Path) -> list[TensorInfo] | None:
    """Tensor names, sizes and dtypes from every *.safetensors header; no weights are read."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    tensors = []
    for path in files:
        for name, info in safetensors_header(path).items():
            if name != "__metadata__":
                tensors.append(TensorInfo(name, prod(info["shape"]), info["dtype"]))
    return tensors


MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit on a header


class HeaderError(PlanError):
    """A file that is not a whole safetensors file; `reason` says why without naming the file."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path} {reason}")
        self.reason = reason


def safetensors_header(path: Path, whole: bool = False) -> dict:
    """One safetensors file's header (tensor name -> dtype, shape, offsets; and __metadata__), checked for
    shape: an object of tensor entries that fits in the file. whole: the tensors' data must also fill the
    rest of the file exactly (a file cut short, as a half-finished copy is, fails here rather than when its
    weights are read). OSError where the file cannot be read."""
    with open(path, "rb") as f:
        file_bytes = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise HeaderError(path, "is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", head)
        if size > min(MAX_HEADER_BYTES, file_bytes - 8):
            raise HeaderError(path, f"is not a safetensors file (its header would be {size} bytes long; the file "
                              f"holds {file_bytes})")
        try:
            header = json.loads(f.read(size))
        except (ValueError, RecursionError):
            raise HeaderError(path, "has a malformed safetensors header") from None
    data_bytes = _data_bytes(path, header)
    if whole and data_bytes != file_bytes - 8 - size:
        raise HeaderError(path, f"is not whole: its tensors take {data_bytes} bytes after the header, and the file "
                          f"holds {file_bytes - 8 - size} (a copy cut short?)")
    return header


def _data_bytes(path: Path, header) -> int:
    """Where the last tensor's data ends (0 for none); a HeaderError for entries not shaped as the format's."""
    if not isinstance(header, dict):
        raise HeaderError(path, "has a malformed safetensors header (not an object)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not _is_entry(info):
            raise HeaderError(path, "has a malformed safetensors header (a tensor without dtype, shape and "
                              "data_offsets)")
        end = max(end, info["data_offsets"][1])
    return end


def _is_entry(info) -> bool:
    """A tensor's entry as the format writes it: a dtype name, a shape of sizes, [begin, end] offsets."""
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        return False
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        return False
    return (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1])


# a multimodal checkpoint's language model tensors (transformers 5, then 4) -> the text model's names
_LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."), ("lm_head.", "lm_head."),
                            ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))


def language_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor as the text model names it; None: not the language model's
    (vision tower, multimodal projector)."""
    for prefix, text_prefix in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return text_prefix + name[len(prefix):]
    return None


def language_model_tensors(tensors: list[TensorInfo]) -> list[TensorInfo]:
    """The language model's tensors of a multimodal checkpoint, named as the text model names them."""
    named = ((language_model_name(t.name), t) for t in tensors)
    return [TensorInfo(name, t.numel, t.dtype) for name, t in named if name is not None]


class _Tensors:
    """Collects a derived checkpoint's tensors; norm and linear add a layer's weights (and biases)."""

    def __init__(self, spec: ModelSpec):
        self.spec, self.dtype = spec, _SAFETENSORS_DTYPE[spec.dtype]
        self.out: list[TensorInfo] = []

    def add(self, name: str, numel: int) -> None:
        self.out.append(TensorInfo(name, numel, self.dtype))

    def norm(self, name: str, with_bias: bool) -> None:
        self.add(f"{name}.weight", self.spec.hidden_size)
        if with_bias:
            self.add(f"{name}.bias", self.spec.hidden_size)

    def linear(self, name: str, n_in: int, n_out: int, bias: bool = False) -> None:
        self.out.extend(_linear_tensors(self.spec, name, n_in, n_out, self.dtype))
        if bias:
            self.add(f"{name}.bias", n_out)


def derive_tensors(spec: ModelSpec) -> list[TensorInfo]:
    """The tensors a checkpoint of this config holds, named the way the family names them."""
    t = _Tensors(spec)
    derive = {"gpt2": _gpt2_tensors, "opt": _opt_tensors}
    derive.get(spec.family, _llama_like_tensors)(spec, t)
    return t.out


def _stacked_moe_tensors(spec: ModelSpec, t: _Tensors, p: str) -> None:
    """Routed experts as transformers 5 holds them, one tensor of every expert per projection (placed
    as that projection: stacked_expert_part), so that 512 experts x 60 layers make 120 tensors, not 92,160;
    the router, and the shared expert behind its sigmoid gate."""
    h, n, inter = spec.hidden_size, spec.num_experts or 0, spec.moe_intermediate_size or 0
    t.add(f"{p}.gate.weight", n * h)
    t.add(f"{p}.experts.gate_up_proj", n * 2 * inter * h)
    t.add(f"{p}.experts.down_proj", n * h * inter)
    if spec.shared_expert_intermediate_size:
        _gated_mlp(t.linear, f"{p}.shared_expert", h, spec.shared_expert_intermediate_size)
        t.linear(f"{p}.shared_expert_gate", h, 1)


def _gated_delta_net_tensors(spec: ModelSpec, t: _Tensors, p: str) -> None:
    """Qwen3-Next fuses the input projections in two (qkvz, ba); Qwen3.5 saves four (qkv, z, b, a)."""
    la, h = spec.linear_attention, spec.hidden_size
    assert la is not None  # a linear-attention layer's model
    if spec.family == "qwen3_next":
        t.linear(f"{p}.in_proj_qkvz", h, la.conv_dim() + la.value_dim)
        t.linear(f"{p}.in_proj_ba", h, 2 * la.num_value_heads)
    else:
        t.linear(f"{p}.in_proj_qkv", h, la.conv_dim())
        t.linear(f"{p}.in_proj_z", h, la.value_dim)
        t.linear(f"{p}.in_proj_b", h, la.num_value_heads)
        t.linear(f"{p}.in_proj_a", h, la.num_value_heads)
    t.add(f"{p}.conv1d.weight", la.conv_dim() * la.conv_kernel_dim)  # depthwise: [conv_dim, 1, kernel]
    t.add(f"{p}.A_log", la.num_value_heads)
    t.add(f"{p}.dt_bias", la.num_value_heads)
    t.add(f"{p}.norm.weight", la.value_head_dim)  # one gated RMSNorm shared by the value heads
    t.linear(f"{p}.out_proj", la.value_dim, h)


def _gpt2_tensors(spec: ModelSpec, t: _Tensors) -> None:
    h, inter = spec.hidden_size, spec.intermediate_size
    t.add("transformer.wte.weight", spec.vocab_size * h)
    t.add("transformer.wpe.weight", spec.max_position_embeddings * h)
    for i in range(spec.num_layers):
        p = f"transformer.h.{i}"
        t.norm(f"{p}.ln_1", True)
        t.linear(f"{p}.attn.c_attn", h, 3 * h, bias=True)
        t.linear(f"{p}.attn.c_proj", h, h, bias=True)
        t.norm(f"{p}.ln_2", True)
        t.linear(f"{p}.mlp.c_fc", h, inter, bias=True)
        t.linear(f"{p}.mlp.c_proj", inter, h, bias=True)
    t.norm("transformer.ln_f", True)


def _opt_tensors(spec: ModelSpec, t: _Tensors) -> None:
    h, inter = spec.hidden_size, spec.intermediate_size
    t.add("model.decoder.embed_tokens.weight", spec.vocab_size * h)
    t.add("model.decoder.embed_positions.weight", (spec.max_position_embeddings + 2) * h)
    for i in range(spec.num_layers):
        p = f"model.decoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            t.linear(f"{p}.self_attn.{proj}", h, h, bias=True)
        t.norm(f"{p}.self_attn_layer_norm", True)
        t.linear(f"{p}.fc1", h, inter, bias=True)
        t.linear(f"{p}.fc2", inter, h, bias=True)
        t.norm(f"{p}.final_layer_norm", True)
    t.norm("model.decoder.final_layer_norm", True)


def _llama_like_tensors(spec: ModelSpec, t: _Tensors) -> None:
    h, d = spec.hidden_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * d, spec.num_kv_heads * d
    t.add("model.embed_tokens.weight", spec.vocab_size * h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        t.norm(f"{p}.input_layernorm", False)
        t.norm(f"{p}.post_attention_layernorm", False)
        if spec.family in ("gemma2", "gemma3_text"):  # the sandwich norms around the MLP
            t.norm(f"{p}.pre_feedforward_layernorm", False)
            t.norm(f"{p}.post_feedforward_layernorm", False)
        if spec.is_linear_layer(i):  # Qwen3-Next and Qwen3.5: Gated DeltaNet in place of attention
            _gated_delta_net_tensors(spec, t, f"{p}.linear_attn")
        else:
            _attention_tensors(spec, t, p, q_out, kv_out)
        if i in spec.moe_layers and spec.linear_attention:
            _stacked_moe_tensors(spec, t, f"{p}.mlp")
        elif i in spec.moe_layers:
            t.out += _moe_tensors(spec, p, t.linear, t.dtype)
        elif spec.family == "phi3":  # gate and up fused in the checkpoint
            t.linear(f"{p}.mlp.gate_up_proj", h, 2 * spec.intermediate_size)
            t.linear(f"{p}.mlp.down_proj", spec.intermediate_size, h)
        else:
            _gated_mlp(t.linear, f"{p}.mlp", h, spec.intermediate_size)
    t.norm("model.norm", False)
    if not spec.tie_word_embeddings:
        t.add("lm_head.weight", spec.vocab_size * h)


def _mla_tensors(spec: ModelSpec, t: _Tensors, p: str) -> None:
    m, h, heads = spec.mla, spec.hidden_size, spec.num_attention_heads
    assert m is not None  # an MLA model's attention
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank:
        t.linear(f"{p}.self_attn.q_a_proj", h, m.q_lora_rank)
        t.add(f"{p}.self_attn.q_a_layernorm.weight", m.q_lora_rank)
        t.linear(f"{p}.self_attn.q_b_proj", m.q_lora_rank, heads * qk)
    else:
        t.linear(f"{p}.self_attn.q_proj", h, heads * qk)
    t.linear(f"{p}.self_attn.kv_a_proj_with_mqa", h, m.cache_width)
    t.add(f"{p}.self_attn.kv_a_layernorm.weight", m.kv_lora_rank)
    t.linear(f"{p}.self_attn.kv_b_proj", m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim))
    t.linear(f"{p}.self_attn.o_proj", heads * m.v_head_dim, h)


def _attention_tensors(spec: ModelSpec, t: _Tensors, p: str, q_out: int, kv_out: int) -> None:
    h, d = spec.hidden_size, spec.head_dim
    if spec.mla:
        return _mla_tensors(spec, t, p)
    if spec.family == "phi3":  # q, k and v fused in the checkpoint
        t.linear(f"{p}.self_attn.qkv_proj", h, q_out + 2 * kv_out)
    else:
        qkv_bias = spec.family in ("qwen2", "qwen2_moe", "gpt_oss")
        gate = 2 if spec.has_attention_output_gate else 1  # Qwen3.5's q_proj: each head's query and output gate
        t.linear(f"{p}.self_attn.q_proj", h, gate * q_out, bias=qkv_bias)
        t.linear(f"{p}.self_attn.k_proj", h, kv_out, bias=qkv_bias)
        t.linear(f"{p}.self_attn.v_proj", h, kv_out, bias=qkv_bias)
    t.linear(f"{p}.self_attn.o_proj", q_out, h, bias=spec.family == "gpt_oss")
    if spec.family == "gpt_oss":  # a learned softmax sink per head
        t.out.append(TensorInfo(f"{p}.self_attn.sinks", spec.num_attention_heads, "F32"))
    if spec.family in ("qwen3", "qwen3_moe", "gemma3_text", *LINEAR_ATTENTION_FAMILIES):
        t.add(f"{p}.self_attn.q_norm.weight", d)
        t.add(f"{p}.self_attn.k_norm.weight", d)


def _moe_tensors(spec: ModelSpec, prefix: str, linear, dtype: str) -> list[TensorInfo]:
    h, inter, n = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    assert inter is not None and n is not None  # a mixture of experts has both
    if spec.family == "gpt_oss":
        return _gpt_oss_experts(spec, prefix, dtype)
    if spec.family == "mixtral":
        router = f"{prefix}.block_sparse_moe.gate"
        for e in range(n):
            p = f"{prefix}.block_sparse_moe.experts.{e}"
            linear(f"{p}.w1", h, inter)
            linear(f"{p}.w3", h, inter)
            linear(f"{p}.w2", inter, h)
    else:
        router = f"{prefix}.mlp.gate"
        for e in range(n):
            _gated_mlp(linear, f"{prefix}.mlp.experts.{e}", h, inter)
        shared = spec.shared_expert_intermediate_size
        if shared and spec.mla:  # DeepSeek: always-on shared experts, no gate
            _gated_mlp(linear, f"{prefix}.mlp.shared_experts", h, shared)
        elif shared:  # Qwen2-MoE: one shared expert behind a sigmoid gate
            _gated_mlp(linear, f"{prefix}.mlp.shared_expert", h, shared)
            linear(f"{prefix}.mlp.shared_expert_gate", h, 1)
    bias = [TensorInfo(f"{router}.e_score_correction_bias", n, "F32")] if spec.family == "deepseek_v3" else []
    return [TensorInfo(f"{router}.weight", n * h, dtype)] + bias


def _gpt_oss_experts(spec: ModelSpec, prefix: str, dtype: str) -> list[TensorInfo]:
    """gpt-oss: a biased router, and each projection one tensor of every expert (runtime/layers/
    moe_stacked.py), in MXFP4 (4-bit values in bytes, one byte of scale per 32 inputs) as released."""
    h, inter, n = spec.hidden_size, spec.moe_intermediate_size or 0, spec.num_experts or 0
    out = [TensorInfo(f"{prefix}.mlp.router.weight", n * h, dtype), TensorInfo(f"{prefix}.mlp.router.bias", n, dtype)]
    for proj, n_in, n_out in (("gate_up_proj", h, 2 * inter), ("down_proj", inter, h)):
        p = f"{prefix}.mlp.experts.{proj}"
        if spec.quantization is None:
            out.append(TensorInfo(p, n * n_in * n_out, dtype))
        else:
            out += [TensorInfo(f"{p}_blocks", n * n_out * n_in // 2, "U8"),
                    TensorInfo(f"{p}_scales", n * n_out * n_in // 32, "U8")]
        out.append(TensorInfo(f"{p}_bias", n * n_out, dtype))
    return out


def _gated_mlp(linear, prefix: str, hidden: int, inter: int) -> None:
    """gate_proj, up_proj and down_proj under `prefix` (a dense MLP, an expert, a shared expert)."""
    linear(f"{prefix}.gate_proj", hidden, inter)
    linear(f"{prefix}.up_proj", hidden, inter)
    linear(f"{prefix}.down_proj", inter, hidden)


def _linear_tensors(spec: ModelSpec, name: str, n_in: int, n_out: int, dtype: str):
    q = spec.quantization
    if q is None or n_out == 1 or q.method == "mxfp4":  # MXFP4 quantizes gpt-oss's experts only
        return [TensorInfo(f"{name}.weight", n_in * n_out, dtype)]
    if q.method == "fp8":  # without blocks, a scale per channel (per-tensor checkpoints hold fewer)
        if q.block_shape:
            scales, scale_name = -(-n_out // q.block_shape[0]) * -(-n_in // q.block_shape[1]), "weight_scale_inv"
        else:
            scales, scale_name = n_out, "weight_scale"
        return [TensorInfo(f"{name}.weight", n_in * n_out, "F8_E4M3"),
                TensorInfo(f"{name}.{scale_name}", scales, "F32")]
    groups = n_in // q.group_size if q.group_size else 1
    pack = 32 // q.bits
    packed = [TensorInfo(f"{name}.qweight", n_in * n_out // pack, "I32"),
              TensorInfo(f"{name}.qzeros", groups * n_out // pack, "I32"),
              TensorInfo(f"{name}.scales", groups * n_out, "F16")]
    return packed + [TensorInfo(f"{name}.g_idx", n_in, "I32")] if q.method == "gptq" else packed
