"""Quantized checkpoints of tiny random models, packed as the formats' public descriptions say (written
here, independently of the runtime), and the dequantized float weights for transformers' reference."""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj",  # Phi-3 ships these two fused
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # MLA's (DeepSeek)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble j of an int32 holds column AWQ_ORDER[j] of its 8
FP8_MAX = 448.0  # largest float8_e4m3fn
# projections of one input share an act-order permutation, as GPTQ's shared Hessian gives them ...
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
PER_PROJECTION_ORDER = {"gptq4-act-order-g32"}  # ... except in these formats: the format allows one each

# name -> quantization_config written to config.json
FORMATS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"},
    "gptq4-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": False},
    # groups of 32, and q, k, v (gate, up) each with its own permutation (PER_PROJECTION_ORDER)
    "gptq4-act-order-g32": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False},
    "gptq8-sym": {"quant_method": "gptq", "bits": 8, "group_size": 16, "desc_act": False, "sym": True},
    "fp8-tensor": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}},
                   "ignore": ["lm_head"]},
    "fp8-channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
                    "ignore": ["lm_head"]},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]},
}


def pack_int32(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Pack unsigned `bits`-wide values along `dim`: value j of each run of 32/bits goes to bits [j*b, j*b+b)
    (with `order`, slot j takes the run's element order[j])."""
    per_int = 32 // bits
    values = values.movedim(dim, -1).long()
    runs = values.reshape(*values.shape[:-1], values.shape[-1] // per_int, per_int)
    if order is not None:
        runs = runs[..., list(order)]
    packed = sum(runs[..., j] << (bits * j) for j in range(per_int))
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim)


def quantize_groups(w: torch.Tensor, bits: int, group: int, sym: bool, perm: torch.Tensor, min_zero: int = 0):
    """w [out, in] -> q [in, out], zeros [G, out], scales [G, out] (fp16), g_idx [in], dequantized w.
    Group k holds input rows perm[k*group:(k+1)*group] (act-order); perm = arange for the plain order.
    min_zero=1 for GPTQ's classic format, which stores zero - 1 and so cannot hold a zero point of 0."""
    num_in = w.shape[1]
    g_idx = torch.empty(num_in, dtype=torch.int32)
    g_idx[perm] = (torch.arange(num_in) // group).to(torch.int32)
    wt = w.t().float()  # [in, out]
    top = 2**bits - 1
    scales, zeros = [], []
    for k in range(num_in // group):
        rows = wt[perm[k * group:(k + 1) * group]]
        if sym:
            scale = (rows.abs().amax(0) / (top // 2)).clamp(min=1e-6).half().float()
            zero = torch.full_like(scale, (top + 1) // 2)
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scale = ((hi - lo) / top).clamp(min=1e-6).half().float()
            zero = torch.round(-lo / scale).clamp(min_zero, top)
        scales.append(scale)
        zeros.append(zero)
    scales, zeros = torch.stack(scales), torch.stack(zeros)
    q = torch.clamp(torch.round(wt / scales[g_idx.long()]) + zeros[g_idx.long()], 0, top)
    dequantized = ((q - zeros[g_idx.long()]) * scales[g_idx.long()]).t()
    return q.long(), zeros.long(), scales.half(), g_idx, dequantized


def gptq_tensors(w, qc, input_key: str) -> tuple[dict, torch.Tensor]:
    """Act-order ranks input rows by the layer input's statistics, so projections reading the same input
    (q, k, v; gate, up) share one permutation: here a random one seeded by `input_key`."""
    bits, group = qc["bits"], qc["group_size"]
    seeded = torch.Generator().manual_seed(sum(map(ord, input_key)) * 7919 + len(input_key))
    perm = torch.randperm(w.shape[1], generator=seeded) if qc["desc_act"] else torch.arange(w.shape[1])
    q, zeros, scales, g_idx, dq = quantize_groups(w, bits, group, qc["sym"], perm, min_zero=1)
    return {"qweight": pack_int32(q, bits, 0), "qzeros": pack_int32(zeros - 1, bits, 1),  # classic: zero - 1
            "scales": scales, "g_idx": g_idx}, dq


def awq_tensors(w, qc, input_key: str) -> tuple[dict, torch.Tensor]:
    q, zeros, scales, _, dq = quantize_groups(w, 4, qc["group_size"], False, torch.arange(w.shape[1]))
    return {"qweight": pack_int32(q, 4, 1, AWQ_ORDER), "qzeros": pack_int32(zeros, 4, 1, AWQ_ORDER),
            "scales": scales}, dq


def fp8_tensors(w, qc, input_key: str) -> tuple[dict, torch.Tensor]:
    w = w.float()
    if qc["quant_method"] == "fp8":
        bo, bi = qc["weight_block_size"]
        rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)  # the last block row/column may be partial
        padded = F.pad(w, (0, cols * bi - w.shape[1], 0, rows * bo - w.shape[0]))
        scale = padded.reshape(rows, bo, cols, bi).abs().amax(dim=(1, 3)) / FP8_MAX  # [ceil(out / bo), ceil(in / bi)]
        full = scale.repeat_interleave(bo, 0)[: w.shape[0]].repeat_interleave(bi, 1)[:, : w.shape[1]]
        weight = (w / full).to(torch.float8_e4m3fn)
        return {"weight": weight, "weight_scale_inv": scale}, weight.float() * full
    strategy = qc["config_groups"]["group_0"]["weights"]["strategy"]
    scale = (w.abs().amax(1, keepdim=True) if strategy == "channel" else w.abs().amax()) / FP8_MAX  # a scalar
    weight = (w / scale).to(torch.float8_e4m3fn)
    tensors = {"weight": weight, "weight_scale": scale}
    if strategy == "tensor":
        tensors["input_scale"] = torch.ones(1)
    return tensors, weight.float() * scale


def save_quantized(folder: str, family: str, fmt: str, num_layers: int = 2, seed: int = 0):
    """Write a random `family` model quantized as `fmt` to `folder`; returns the transformers model holding
    the dequantized float weights (the numeric reference)."""
    from tests.runtime.runtime_checkpoints import save_checkpoint

    float_folder = folder + "-float"
    hf_model = save_checkpoint(float_folder, family, seed=seed, num_layers=num_layers)
    qc = FORMATS[fmt]
    pack = pack_for(qc)
    torch.manual_seed(seed + 1)
    state, tensors = hf_model.state_dict(), {}
    for name, value in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            parent, proj = module.rsplit(".", 1)
            shared = proj if fmt in PER_PROJECTION_ORDER else SHARED_INPUT.get(proj, proj)
            packed, dequantized = pack(value, qc, parent + shared)
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
            state[name] = dequantized.to(value.dtype)
        elif not (name == "lm_head.weight" and hf_model.config.tie_word_embeddings):
            tensors[name] = value.contiguous()
    hf_model.load_state_dict(state)
    write_model(folder, float_folder, tensors, qc)
    return hf_model


def write_model(folder: str, float_folder: str, tensors: dict, quantization_config: dict | None = None) -> None:
    """A model folder: the float model's files but its weights, these tensors as its weights, and
    config.json's quantization_config when given."""
    os.makedirs(folder, exist_ok=True)
    for file in os.listdir(float_folder):
        if not file.endswith(".safetensors"):
            shutil.copy(os.path.join(float_folder, file), folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    if quantization_config is not None:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config | {"quantization_config": quantization_config}, f, indent=1)


# quantized experts: GPTQ without act-order (act-order experts are refused), the rest as for dense layers
MOE_FORMATS = {"awq": FORMATS["awq"],
               "gptq4": {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": False},
               "gptq8-sym": FORMATS["gptq8-sym"], "fp8-tensor": FORMATS["fp8-tensor"],
               "fp8-channel": FORMATS["fp8-channel"], "fp8-block": FORMATS["fp8-block"]}
EXPERT_LINEARS = ("w1", "w2", "w3")  # Mixtral's expert projections; Qwen's use LINEARS' names


def pack_for(qc: dict):
    return {"awq": awq_tensors, "gptq": gptq_tensors}.get(qc["quant_method"], fp8_tensors)


def save_quantized_moe(folder: str, family: str, fmt: str, num_layers: int = 2, seed: int = 0):
    """A random mixture-of-experts `family` model quantized as `fmt`, named as its releases name it on disk:
    attention, each expert (`experts.<e>.w1.qweight`, ...) and the shared expert quantized, the routers
    float. Returns transformers' model on the dequantized weights, loaded from a float copy beside it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.runtime.runtime_checkpoints import save_checkpoint

    float_folder, dequantized_folder = folder + "-float", folder + "-dequantized"
    save_checkpoint(float_folder, family, seed=seed, num_layers=num_layers)
    qc, tensors, dequantized = MOE_FORMATS[fmt], {}, {}
    torch.manual_seed(seed + 1)
    for name, value in load_file(os.path.join(float_folder, "model.safetensors")).items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and ".layers." in name and module.rpartition(".")[2] in LINEARS + EXPERT_LINEARS:
            packed, dequantized_value = pack_for(qc)(value, qc, module)
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
            dequantized[name] = dequantized_value.to(value.dtype).contiguous()
        else:
            tensors[name] = dequantized[name] = value
    write_model(folder, float_folder, tensors, qc)
    write_model(dequantized_folder, float_folder, dequantized)
    return AutoModelForCausalLM.from_pretrained(dequantized_folder, dtype=torch.float32).eval()


def save_quantized_experts(path: str, fmt: str, num_experts: int, hidden: int, inter: int, seed: int = 3):
    """Per-expert w1/w3/w2 tensors packed as `fmt` in one safetensors file (names `<e>.<kind>.<leaf>`);
    returns the dequantized float weights {(e, kind): [out, in]}."""
    torch.manual_seed(seed)
    qc, tensors, dequantized = MOE_FORMATS[fmt], {}, {}
    for e in range(num_experts):
        for kind, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            packed, dequantized[e, kind] = pack_for(qc)(torch.randn(*shape) * 0.2, qc, kind)
            tensors.update({f"{e}.{kind}.{leaf}": v.contiguous() for leaf, v in packed.items()})
    save_file(tensors, path)
    return dequantized


# gpt-oss's release: MXFP4 experts, everything else float
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitudes by the code's low 3 bits


def mxfp4_tensors(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., N, K] (rows = outputs) -> blocks [..., N, K / 32, 16] uint8, scales [..., N, K / 32] uint8 and
    the dequantized w, per the OCP MX format: each 32 inputs share the scale 2^(s - 127), the smallest
    power of two that brings their largest magnitude within e2m1's 6; each value rounds to the nearest
    e2m1 (sign bit 3), two per byte, the even input in the low nibble."""
    groups = w.float().unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -120) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = magnitude + 8 * (scaled < 0).long()
    dequantized = (E2M1[magnitude] * scaled.sign() * torch.exp2(exponent)[..., None]).flatten(-2)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8), dequantized


def save_mxfp4_gpt_oss(folder: str, num_layers: int = 2, seed: int = 0):
    """A random gpt-oss with MXFP4 experts as released (`experts.gate_up_proj_blocks`, `_scales`, float biases);
    returns transformers' model on the dequantized weights, loaded from a float copy beside it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.runtime.runtime_checkpoints import save_checkpoint

    float_folder, dequantized_folder = folder + "-float", folder + "-dequantized"
    save_checkpoint(float_folder, "gpt_oss", seed=seed, num_layers=num_layers)
    tensors, dequantized = {}, {}
    for name, value in load_file(os.path.join(float_folder, "model.safetensors")).items():
        tensors[name] = dequantized[name] = value
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stored [experts, inputs, outputs]
            del tensors[name]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"], rows = mxfp4_tensors(value.transpose(1, 2))
            dequantized[name] = rows.transpose(1, 2).to(value.dtype).contiguous()
    write_model(folder, float_folder, tensors, MXFP4)
    write_model(dequantized_folder, float_folder, dequantized)
    return AutoModelForCausalLM.from_pretrained(dequantized_folder, dtype=torch.float32).eval()
