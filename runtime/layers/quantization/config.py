"""Which quantization a checkpoint uses (config.json's quantization_config, or --quantization) and how
its linear layers are built while the model is."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.planner.errors import PlanError
from shardserve.planner.model_spec import QuantSpec, compressed_tensors_weights


@dataclass(frozen=True)
class QuantConfig:
    """What the linear layers need to know; `spec` is the planner's view of the same config."""

    format: str  # awq | gptq | fp8 | compressed-tensors | mxfp4 (the checkpoint's quant_method)
    spec: QuantSpec
    desc_act: bool = False  # GPTQ act-order: input rows permuted, groups found through g_idx
    zero_offset: int = 0  # GPTQ's classic format stores zeros minus one
    fp8_strategy: str | None = None  # tensor | channel | block
    has_input_scale: bool = False  # compressed-tensors static activation scales (read, unused)
    is_online: bool = False  # a float checkpoint quantized while loading (--quantization fp8)

    @property
    def method(self) -> str:
        return self.spec.method

    @staticmethod
    def from_dict(qc: dict | None, quantization: str | None = None) -> QuantConfig | None:
        """`quantization` (the --quantization setting) overrides the detected quant_method."""
        if quantization is None and not qc:
            return None
        qc = qc or {}  # --quantization on a checkpoint without quantization_config
        if not qc and quantization == "fp8":
            return QuantConfig("fp8", QuantSpec("fp8", 8, None), fp8_strategy="channel", is_online=True)
        fmt = (quantization or str(qc.get("quant_method", ""))).lower()
        try:
            return _parse(dict(qc), fmt)
        except PlanError as e:
            raise ValueError(str(e)) from None


def _parse(qc: dict, fmt: str) -> QuantConfig:
    spec = QuantSpec.from_config(qc, fmt)
    if fmt == "gptq":
        if spec.bits not in (4, 8):
            raise ValueError(f"gptq with {spec.bits} bits is not served: 4 or 8 bits")
        classic = str(qc.get("checkpoint_format", "gptq")).lower() != "gptq_v2"
        return QuantConfig(fmt, spec, desc_act=bool(qc.get("desc_act", False)), zero_offset=int(classic))
    if fmt == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if spec.bits != 4 or version != "gemm" or not qc.get("zero_point", True):
            raise ValueError(f"awq {version} with {spec.bits} bits (zero_point={qc.get('zero_point', True)}) is "
                             "not served: 4-bit GEMM layout with zero points")
        return QuantConfig(fmt, spec)
    if fmt == "mxfp4":  # gpt-oss: the experts only (mxfp4_moe.py)
        return QuantConfig(fmt, spec)
    if fmt == "fp8":  # AutoFP8's static activation scheme ships input_scale tensors (read, unused)
        return QuantConfig(fmt, spec, fp8_strategy="block" if spec.block_shape else "tensor",
                           has_input_scale=str(qc.get("activation_scheme", "dynamic")).lower() == "static")
    weights = compressed_tensors_weights(qc)
    inputs = next(iter(qc["config_groups"].values())).get("input_activations") or {}
    return QuantConfig(fmt, spec, fp8_strategy=weights["strategy"],
                       has_input_scale=bool(inputs) and not inputs.get("dynamic", False))


def check_quantized_layout(model_config) -> None:
    """Refuse a quantized checkpoint of an architecture the quantized layers cannot build, before loading
    (how its groups split over ranks is the planner's rule 4, checked with the layout)."""
    from shardserve.planner.served import ACT_ORDER_EXPERTS, ARCHITECTURES, quantizable_architectures

    quant = model_config.quantization
    if quant is not None and model_config.architecture not in quantizable_architectures(quant.method):
        raise ValueError(f"{model_config.architecture} is not served quantized ({quant.format}); {quant.method} "
                         f"architectures: {', '.join(quantizable_architectures(quant.method))}")
    served = ARCHITECTURES.get(model_config.architecture)
    if quant is not None and quant.desc_act and served is not None and served.has_experts:
        raise ValueError(f"{model_config.architecture}: {ACT_ORDER_EXPERTS}")
