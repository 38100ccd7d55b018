"""What the planner knows of a model: shapes from config.json, tensors from safetensors headers."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from shardserve.planner.errors import PlanError
from shardserve.planner.hf_config import (RECURRENT_KINDS, REQUIRED, ConfigReader, language_model_config,
                                          layer_types, max_context_length, recurrent_layer_kind)
from shardserve.planner.kv_groups import KVGroups, model_kv_groups
from shardserve.planner.linear_attention import LinearAttentionSpec, hybrid_fields
from shardserve.planner.served import (ARCHITECTURES, LINEAR_ATTENTION_FAMILIES, QUANTIZATION_FORMATS,
                                      unserved_layers_problem)
from shardserve.planner.settings import SettingError

# architectures entry in config.json -> family name used across shardserve: what the runtime serves.
SUPPORTED_ARCHITECTURES = {arch: served.family for arch, served in ARCHITECTURES.items()}

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16",
                  "bf16": "bfloat16", "float32": "float32", "float16": "float16",
                  "bfloat16": "bfloat16"}


def canonical_dtype(name: str) -> str:
    try:
        return _DTYPE_ALIASES[str(name).lower().removeprefix("torch.")]
    except KeyError:
        raise SettingError(f"dtype {name!r}: use auto, bfloat16, float16 or float32") from None


def refuse_quantization(method: str, where: str = "quantization_config.quant_method") -> PlanError:
    return PlanError(f"{where} {method!r} is not served; served formats: {', '.join(QUANTIZATION_FORMATS)}")


@dataclass(frozen=True)
class QuantSpec:
    method: str  # fp8 | gptq | awq | mxfp4
    bits: int
    group_size: int | None  # input features per scale group; None: one scale per channel/tensor
    block_shape: tuple[int, int] | None = None  # fp8 block quantization [out, in]
    has_act_order: bool = False  # GPTQ desc_act: input rows permuted, groups found through g_idx

    @staticmethod
    def from_config(qc: dict, method: str | None = None) -> "QuantSpec":
        """`method`: --quantization, overriding quantization_config.quant_method."""
        method = (method or str(qc.get("quant_method", ""))).lower()
        if not qc and method != "fp8":
            raise PlanError(f"quantization {method}: config.json has no quantization_config, which a {method} "
                            "checkpoint ships (only fp8 quantizes a float checkpoint while loading)")
        if method == "fp8":
            block = qc.get("weight_block_size")
            return QuantSpec("fp8", 8, None, tuple(block) if block else None)
        if method in ("gptq", "awq"):
            bits = int(qc.get("bits", qc.get("w_bit", 4)))
            group = int(qc.get("group_size", qc.get("q_group_size", 128)))
            return QuantSpec(method, bits, group if group > 0 else None,
                             has_act_order=method == "gptq" and bool(qc.get("desc_act", False)))
        if method == "compressed-tensors":
            return _compressed_tensors_spec(qc)
        if method == "mxfp4":  # OCP microscaling: e2m1 values, one e8m0 scale per 32 inputs
            return QuantSpec("mxfp4", 4, 32)
        raise refuse_quantization(method)


def compressed_tensors_weights(qc: dict) -> dict:
    """The weight scheme of a compressed-tensors config: only fp8 float weights are served."""
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if not weights or any(w != weights[0] for w in weights):
        raise PlanError("compressed-tensors quantization_config: need one weight scheme in config_groups")
    w = weights[0]
    if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
        raise PlanError(f"compressed-tensors weights of type {w.get('type')!r} with {w.get('num_bits')} bits "
                        "are not served: only 8-bit float (fp8) weights")
    if w.get("strategy") not in ("tensor", "channel", "block"):
        raise PlanError(f"compressed-tensors fp8 strategy {w.get('strategy')!r}: served are tensor, channel, block")
    return w


def _compressed_tensors_spec(qc: dict) -> QuantSpec:
    w = compressed_tensors_weights(qc)
    block = w.get("block_structure") if w.get("strategy") == "block" else None
    return QuantSpec("fp8", 8, None, tuple(block) if block else None)


# gpt-oss ships each expert projection as one tensor of every expert (float, or MXFP4 blocks and scales)
# beside its bias: `<prefix>.experts.gate_up_proj_blocks` (runtime/layers/moe_stacked.py loads them)
_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)(?:_(bias|blocks|scales))?$")


def stacked_expert_part(name: str) -> tuple[str, str] | None:
    """(projection, part) of a tensor of every expert: ("gate_up_proj", "blocks"), part "" for a float
    weight; None for any other tensor."""
    found = _STACKED_EXPERTS.search(name)
    return (found.group(1), found.group(2) or "") if found else None


@dataclass(frozen=True)
class TensorInfo:
    """One checkpoint tensor: name as in the checkpoint, element count and stored dtype."""

    name: str
    numel: int
    dtype: str  # safetensors dtype string: F32, BF16, F16, F8_E4M3, I32, ...

    @property
    def is_float(self) -> bool:
        return self.dtype in ("F32", "F16", "BF16", "F64")

    @property
    def stored_bytes(self) -> int:
        size = {"F64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "I64": 8, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}
        return self.numel * size.get(self.dtype, 2)


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): config.json's widths."""

    kv_lora_rank: int  # the latent each token caches
    qk_rope_head_dim: int  # the rotated key, shared by the heads, cached beside the latent
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)

    @property
    def cache_width(self) -> int:
        """Values one token caches per layer, whole on every tensor-parallel rank."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @staticmethod
    def from_config(read: ConfigReader) -> "MLASpec":
        return MLASpec(read.count("kv_lora_rank"), read.count("qk_rope_head_dim"), read.count("qk_nope_head_dim"),
                       read.count("v_head_dim"), read.int("q_lora_rank", default=None) or None)


@dataclass(frozen=True)
class ModelSpec:
    id: str
    architecture: str
    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    max_context_len: int  # max_position_embeddings stretched by the rope scaling
    tie_word_embeddings: bool
    dtype: str  # the checkpoint's dtype (config dtype, or torch_dtype before transformers 5)
    quantization: QuantSpec | None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    moe_layers: tuple[int, ...] = ()
    rope_type: str | None = None  # None: no rotary embedding (learned positions)
    sliding_window: int | None = None  # tokens each query attends back; None: the whole context
    # how its attention layers share the KV pool: a block table per kind (planner/kv_groups.py)
    kv_groups: KVGroups = KVGroups((None,), (), 1)
    # per layer "sliding_attention" (config.json's sliding_window) or "full_attention"; None: all alike
    layer_types: tuple[str, ...] | None = None
    mla: MLASpec | None = None  # multi-head latent attention (then num_kv_heads and head_dim do not apply)
    recurrent_kind: str | None = None  # its recurrent layers' kind ("Gated DeltaNet"); None: it has none
    # the "linear_attention" layers' widths (Gated DeltaNet: Qwen3-Next, Qwen3.5); None: no such layers
    linear_attention: LinearAttentionSpec | None = None
    has_attention_output_gate: bool = False  # q_proj also gives a sigmoid gate on the attention output
    partial_rotary_factor: float = 1.0  # the share of head_dim rotated

    @property
    def has_recurrent_layers(self) -> bool:
        """Layers keeping one state per request (linear attention) rather than KV per token."""
        return self.recurrent_kind is not None or self.linear_attention is not None

    def is_linear_layer(self, index: int) -> bool:
        return self.layer_types is not None and self.layer_types[index] == "linear_attention"

    def num_linear_layers(self, layers: Iterable[int]) -> int:
        """How many of `layers` are linear attention (a state per request, no KV)."""
        return sum(1 for i in layers if self.is_linear_layer(i))

    def num_kv_layers(self, layers: Iterable[int]) -> int:
        """How many of `layers` cache KV per token (every layer but linear attention)."""
        return sum(1 for i in layers if not self.is_linear_layer(i))

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def is_gated_mlp(self) -> bool:
        return self.family not in ("gpt2", "opt")

    def kv_values_per_layer(self, tp: int = 1) -> int:
        """Values one token caches in one layer on one of tp ranks: K and V of the rank's KV heads (one
        head per rank once tp exceeds them), or MLA's latent and rotated key, whole on every rank."""
        if self.mla:
            return self.mla.cache_width
        return 2 * kv_heads_per_rank(self, tp) * self.head_dim

    def kv_bytes_per_token(self, kv_dtype_bytes: int) -> int:
        """KV bytes per token for the whole unsharded model (linear-attention layers cache none)."""
        return self.num_kv_layers(range(self.num_layers)) * self.kv_values_per_layer() * kv_dtype_bytes

    @staticmethod
    def from_config(model_id: str, config: dict, quantization: str | None = None) -> "ModelSpec":
        """`quantization`: the --quantization setting, overriding quantization_config's quant_method."""
        arch = _architecture(model_id, config)
        family = SUPPORTED_ARCHITECTURES[arch]
        if ARCHITECTURES[arch].has_text_config:
            config = language_model_config(config, model_id)
        read = ConfigReader(model_id, config)
        names = _FIELD_NAMES.get(family, {})
        hidden = read.count(*names.get("hidden_size", ("hidden_size",)))
        heads = read.count(*names.get("num_attention_heads", ("num_attention_heads",)))
        num_layers = read.count(*names.get("num_hidden_layers", ("num_hidden_layers",)))
        inter = read.count(*names.get("intermediate_size", ("intermediate_size",)),
                           default=_default_intermediate_size(family, read, hidden))
        quant = read.get("quantization_config", default=None)
        if quant is not None and not isinstance(quant, dict):
            raise read.bad("quantization_config", quant, "a mapping")
        max_positions = read.count(*names.get("max_position_embeddings", ("max_position_embeddings",)))
        rope = read.rope_parameters() if family not in ("gpt2", "opt") else None
        mla = MLASpec.from_config(read) if family in MLA_FAMILIES else None
        types = _layer_types(config, model_id, family)
        return ModelSpec(
            id=model_id, architecture=arch, family=family, num_layers=num_layers,
            hidden_size=hidden, num_attention_heads=heads,
            num_kv_heads=read.count("num_key_value_heads", default=heads),
            head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim if mla else read.count("head_dim", default=max(1, hidden // heads)),
            intermediate_size=inter,
            vocab_size=read.count("vocab_size"),
            max_position_embeddings=max_positions,
            max_context_len=max_context_length(max_positions, rope, family),
            tie_word_embeddings=read.bool("tie_word_embeddings", family in _TIED_BY_DEFAULT),
            dtype=_dtype(read, family),
            quantization=QuantSpec.from_config(quant or {}, quantization) if quant or quantization else None,
            rope_type=rope["rope_type"] if rope else None,
            sliding_window=_sliding_window(read),
            kv_groups=model_kv_groups({**config, "architectures": [arch]}, num_layers, types),
            layer_types=types, **_moe_fields(family, read, num_layers),
            mla=mla, recurrent_kind=recurrent_layer_kind(config) or RECURRENT_KINDS.get(family),
            **hybrid_fields(family, read, rope))


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    """KV heads split evenly over tp ranks, or one whole head per rank once tp exceeds them."""
    return max(1, spec.num_kv_heads // tp)


def is_qwen_moe_layer(index: int, decoder_sparse_step: int, mlp_only_layers: Iterable[int]) -> bool:
    """Qwen-MoE's rule (transformers', the planner's and the runtime's): routed experts in every
    decoder_sparse_step-th layer unless listed in mlp_only_layers."""
    return index not in set(mlp_only_layers) and (index + 1) % decoder_sparse_step == 0


def is_deepseek_moe_layer(index: int, first_k_dense_replace: int, moe_layer_freq: int) -> bool:
    """DeepSeek's rule (the planner's and the runtime's): experts from first_k_dense_replace on, every
    moe_layer_freq-th layer."""
    return index >= first_k_dense_replace and index % moe_layer_freq == 0


MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
_TIED_BY_DEFAULT = ("gpt2", "opt", "gemma2", "gemma3_text")  # transformers' default when config.json omits it
_FIELD_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "gpt2": {"hidden_size": ("n_embd", "hidden_size"), "num_attention_heads": ("n_head",),
             "num_hidden_layers": ("n_layer",), "intermediate_size": ("n_inner",),
             "max_position_embeddings": ("n_positions", "n_ctx")},
    "opt": {"intermediate_size": ("ffn_dim",)},
}


def _architecture(model_id: str, config: dict) -> str:
    archs = config.get("architectures") or []
    if not isinstance(archs, list):
        raise PlanError(f"{model_id}: config.json architectures is {archs!r}; expected a list")
    if not archs and config.get("model_type"):
        # a bare config (no weights saved with it): the family names are HF's model_types
        archs = [a for a, f in SUPPORTED_ARCHITECTURES.items() if f == config["model_type"]]
        archs = archs or [f"model_type {config['model_type']}"]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    unserved = unserved_layers_problem(archs) if arch is None else None
    if unserved:
        raise PlanError(f"{model_id}: {unserved}")
    if arch is None:
        named = ", ".join(map(str, archs)) if archs else "no 'architectures' entry"
        raise PlanError(f"{model_id}: architecture {named} is not supported; supported: "
                        + ", ".join(SUPPORTED_ARCHITECTURES))
    return arch


# NOTE: config.json without a dtype means float32 to transformers, but gpt-oss's release names none and
# stores every float tensor in bfloat16 (transformers 5 and vLLM's "auto" both run it in bfloat16)
_DEFAULT_DTYPE = {"gpt_oss": "bfloat16"}


def _dtype(read: ConfigReader, family: str) -> str:
    saved = read.get("dtype", default=_DEFAULT_DTYPE.get(family, "float32"))
    try:
        return canonical_dtype(saved)
    except SettingError:
        raise read.bad("dtype", saved, "float32, float16 or bfloat16") from None


def _sliding_window(read: ConfigReader) -> int | None:
    """The attention window, when the model attends through one (Qwen2 only with use_sliding_window)."""
    window = read.int("sliding_window", default=None)
    if not window or not read.bool("use_sliding_window", True):
        return None
    return window


def _default_intermediate_size(family: str, read: ConfigReader, hidden: int):
    """intermediate_size where config.json may leave it out: GPT-2's 4 x hidden; Qwen3.5-MoE has no dense MLP
    (its text config has no intermediate_size), so the experts' width stands for it."""
    if family == "gpt2":
        return 4 * hidden
    return read.count("moe_intermediate_size") if family == "qwen3_5_moe_text" else REQUIRED


def _layer_types(config: dict, model_id: str, family: str) -> tuple[str, ...] | None:
    """layer_types, refusing linear_attention layers in a family that has none."""
    types = layer_types(config, model_id, family)
    if types and "linear_attention" in types and family not in LINEAR_ATTENTION_FAMILIES:
        raise PlanError(f"{model_id}: config.json layer_types has linear_attention layers, which {family} "
                        "models do not have")
    return types


def _moe_fields(family: str, read: ConfigReader, num_layers: int) -> dict:
    if family == "qwen3_5_moe_text":  # every layer routes (no decoder_sparse_step, no mlp_only_layers)
        return {"num_experts": read.count("num_experts"), "num_experts_per_tok": read.count("num_experts_per_tok"),
                "moe_intermediate_size": read.count("moe_intermediate_size"),
                "shared_expert_intermediate_size": read.int("shared_expert_intermediate_size", default=0) or None,
                "moe_layers": tuple(range(num_layers))}
    if family in ("mixtral", "gpt_oss"):
        return {"num_experts": read.count("num_experts"),
                "num_experts_per_tok": read.count("num_experts_per_tok"),
                "moe_intermediate_size": read.count("intermediate_size"),
                "moe_layers": tuple(range(num_layers))}
    if family in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        step = read.int("decoder_sparse_step", default=1)
        if step < 1:
            raise read.bad("decoder_sparse_step", step, "a positive integer")
        dense = read.ints("mlp_only_layers")
        layers = tuple(i for i in range(num_layers) if is_qwen_moe_layer(i, step, dense))
        return {"num_experts": read.count("num_experts"),
                "num_experts_per_tok": read.count("num_experts_per_tok"),
                "moe_intermediate_size": read.count("moe_intermediate_size"),
                "shared_expert_intermediate_size":
                    read.int("shared_expert_intermediate_size", default=0) or None,
                "moe_layers": layers}
    if family in MLA_FAMILIES:
        return _deepseek_moe_fields(read, num_layers)
    return {}


def _deepseek_moe_fields(read: ConfigReader, num_layers: int) -> dict:
    """DeepSeek's rule: experts from first_k_dense_replace on, every moe_layer_freq-th layer, each with
    n_shared_experts always-on experts (one MLP of their summed width)."""
    experts = read.int("n_routed_experts", default=0)
    if not experts:
        return {}
    first, frequency = read.int("first_k_dense_replace", default=0), read.int("moe_layer_freq", default=1) or 1
    inter = read.count("moe_intermediate_size")
    return {"num_experts": experts, "num_experts_per_tok": read.count("num_experts_per_tok"),
            "moe_intermediate_size": inter,
            "shared_expert_intermediate_size": inter * read.int("n_shared_experts", default=0) or None,
            "moe_layers": tuple(i for i in range(num_layers) if is_deepseek_moe_layer(i, first, frequency))}
