"""What the runtime serves: architectures and the model features each can use (torch-free: the planner
refuses the rest by name at plan time, and the runtime's model registry is checked against it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardserve.planner.errors import PlanError

# families whose linear_attention layers are Gated DeltaNet (planner/linear_attention.py sizes their state)
LINEAR_ATTENTION_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")

if TYPE_CHECKING:
    from shardserve.planner.model_spec import ModelSpec

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# checkpoint weight formats (quantization_config.quant_method, vLLM's --quantization names)
QUANTIZATION_FORMATS = ("awq", "gptq", "fp8", "compressed-tensors", "mxfp4")
QUANTIZATION_METHODS = ("awq", "gptq", "fp8", "mxfp4")  # the weight schemes they carry (QuantSpec.method)
LINEAR_QUANTIZATION = ("awq", "gptq", "fp8")  # quantized linear layers (mxfp4: gpt-oss's experts only)
# NOTE: act-order permutes each expert's input rows; the expert GEMMs read groups in order only
ACT_ORDER_EXPERTS = ("gptq act-order (desc_act) experts are not served; quantized experts served: awq, "
                     "gptq without desc_act, fp8 (per tensor, per channel, 128x128 blocks)")


@dataclass(frozen=True)
class ServedArchitecture:
    family: str  # shardserve's family name; for a bare config.json, transformers' model_type
    rope_types: tuple[str, ...] = ROPE_TYPES  # empty: learned positions
    quantizations: tuple[str, ...] = LINEAR_QUANTIZATION  # weight schemes served; empty: float only (GPT-2)
    # True: routed experts, quantized as AWQ, GPTQ without act-order or fp8 (per tensor, channel or block)
    has_experts: bool = False
    # True: a multimodal checkpoint whose language model is served (config.json's text_config, the
    # weights under language_model.), its vision tower left unloaded
    has_text_config: bool = False
    serves_lora: bool = False  # True: LoRA adapters on q/k/v/o and gate/up/down (planner/lora.py)


# config.json `architectures` entry -> what the runtime serves of it
ARCHITECTURES: dict[str, ServedArchitecture] = {
    "LlamaForCausalLM": ServedArchitecture("llama", serves_lora=True),
    "MistralForCausalLM": ServedArchitecture("mistral", serves_lora=True),
    "Qwen2ForCausalLM": ServedArchitecture("qwen2", serves_lora=True),
    "Qwen3ForCausalLM": ServedArchitecture("qwen3", serves_lora=True),
    "MixtralForCausalLM": ServedArchitecture("mixtral", has_experts=True),
    "Qwen2MoeForCausalLM": ServedArchitecture("qwen2_moe", has_experts=True),
    "Qwen3MoeForCausalLM": ServedArchitecture("qwen3_moe", has_experts=True),
    "DeepseekV2ForCausalLM": ServedArchitecture("deepseek_v2", has_experts=True),
    "DeepseekV3ForCausalLM": ServedArchitecture("deepseek_v3", has_experts=True),
    "Gemma2ForCausalLM": ServedArchitecture("gemma2"),
    "Gemma3ForCausalLM": ServedArchitecture("gemma3_text"),
    "Gemma3ForConditionalGeneration": ServedArchitecture("gemma3_text", has_text_config=True),
    "Phi3ForCausalLM": ServedArchitecture("phi3"),
    "GptOssForCausalLM": ServedArchitecture("gpt_oss", quantizations=("mxfp4",), has_experts=True),
    "GPT2LMHeadModel": ServedArchitecture("gpt2", rope_types=(), quantizations=()),
    "OPTForCausalLM": ServedArchitecture("opt", rope_types=()),
    # Gated DeltaNet linear attention (a state per request) with gated full attention, 3:1. Float weights only:
    # their b/a projections (one feature per value head) fit no fp8 weight block, and no quantized
    # checkpoint of them has been loaded here yet.
    "Qwen3NextForCausalLM": ServedArchitecture("qwen3_next", quantizations=(), has_experts=True),
    "Qwen3_5ForCausalLM": ServedArchitecture("qwen3_5_text", quantizations=()),
    "Qwen3_5ForConditionalGeneration": ServedArchitecture("qwen3_5_text", quantizations=(), has_text_config=True),
    "Qwen3_5MoeForCausalLM": ServedArchitecture("qwen3_5_moe_text", quantizations=(), has_experts=True),
    "Qwen3_5MoeForConditionalGeneration": ServedArchitecture("qwen3_5_moe_text", quantizations=(), has_experts=True,
                                                             has_text_config=True),
}

# hybrids whose other kind of layer the runtime does not serve: architecture -> that kind
UNSERVED_LAYER_KINDS: dict[str, str] = {
    "NemotronHForCausalLM": "Mamba-2", "FalconH1ForCausalLM": "Mamba-2", "GraniteMoeHybridForCausalLM": "Mamba-2",
    "Zamba2ForCausalLM": "Mamba-2", "BambaForCausalLM": "Mamba-2", "Mamba2ForCausalLM": "Mamba-2",
    "JambaForCausalLM": "Mamba", "ZambaForCausalLM": "Mamba", "MambaForCausalLM": "Mamba",
    "FalconMambaForCausalLM": "Mamba", "Lfm2ForCausalLM": "short-convolution (LFM2)",
    "Lfm2MoeForCausalLM": "short-convolution (LFM2)", "KimiLinearForCausalLM": "Kimi Delta Attention",
    "MiniMaxForCausalLM": "lightning (linear) attention", "MiniMaxText01ForCausalLM": "lightning (linear) attention",
    "MiniMaxM1ForCausalLM": "lightning (linear) attention", "RecurrentGemmaForCausalLM": "RG-LRU recurrent",
    "RwkvForCausalLM": "RWKV",
}


def unserved_layers_problem(architectures: list) -> str | None:
    """Why a hybrid architecture among `architectures` is not served, naming its kind of layer; None when
    none of them is a known hybrid."""
    arch = next((a for a in architectures if a in UNSERVED_LAYER_KINDS), None)
    if arch is None:
        return None
    kind = UNSERVED_LAYER_KINDS[arch]
    hybrids = ", ".join(a for a, served in ARCHITECTURES.items() if served.family in LINEAR_ATTENTION_FAMILIES)
    return (f"architecture {arch} is not served: {kind} layers are not served by the runtime (the recurrent "
            f"hybrids served are Gated DeltaNet with attention: {hybrids})")


def check_served(spec: ModelSpec) -> None:
    """Raise a PlanError naming the first feature of this model the runtime cannot serve."""
    served = ARCHITECTURES.get(spec.architecture)
    if served is None:
        raise PlanError(f"{spec.id}: architecture {spec.architecture} is not served by the runtime; "
                        f"served: {', '.join(ARCHITECTURES)}")
    if spec.rope_type is not None and spec.rope_type not in served.rope_types:
        raise PlanError(f"{spec.id}: rope_type {spec.rope_type} is not served by the runtime; served: "
                        f"{', '.join(served.rope_types)}")
    if spec.quantization and spec.quantization.method not in QUANTIZATION_METHODS:
        raise PlanError(f"{spec.id}: {spec.quantization.method} quantization is not served; served formats: "
                        + ", ".join(QUANTIZATION_FORMATS))
    if spec.quantization and spec.quantization.method not in served.quantizations:
        method = spec.quantization.method
        raise PlanError(f"{spec.id}: {spec.architecture} is not served quantized ({method}); {method} "
                        "architectures: " + ", ".join(quantizable_architectures(method)))
    if spec.quantization and served.has_experts and spec.quantization.has_act_order:
        raise PlanError(f"{spec.id}: {ACT_ORDER_EXPERTS}")


def quantizable_architectures(method: str) -> tuple[str, ...]:
    """The architectures served with weights in `method` (a QuantSpec.method)."""
    return tuple(arch for arch, served in ARCHITECTURES.items() if method in served.quantizations)
