"""How each served architecture is built, keyed by the `architectures` entry of config.json; which
architectures and features are served is the planner's table (planner/served.py)."""

from __future__ import annotations

from typing import Callable

from torch import nn

from shardserve.planner.served import ARCHITECTURES
from shardserve.runtime.config import ModelConfig
from shardserve.runtime.models.deepseek import deepseek_v2, deepseek_v3
from shardserve.runtime.models.gemma import gemma2, gemma3
from shardserve.runtime.models.gpt2 import GPT2LMHeadModel
from shardserve.runtime.models.gpt_oss import GptOssForCausalLM
from shardserve.runtime.models.llama import LlamaForCausalLM, LlamaVariant
from shardserve.runtime.models.mixtral import MixtralForCausalLM
from shardserve.runtime.models.opt import OPTForCausalLM
from shardserve.runtime.models.phi3 import phi3
from shardserve.runtime.models.qwen3_5 import qwen3_5, qwen3_5_moe, qwen3_next
from shardserve.runtime.models.qwen_moe import qwen2_moe, qwen3_moe

MODEL_BUILDERS: dict[str, Callable[[ModelConfig], nn.Module]] = {
    "LlamaForCausalLM": lambda c: LlamaForCausalLM(c, LlamaVariant()),
    "MistralForCausalLM": lambda c: LlamaForCausalLM(c, LlamaVariant(has_sliding_window=True)),
    "Qwen2ForCausalLM": lambda c: LlamaForCausalLM(c, LlamaVariant(qkv_bias=True, has_sliding_window=True)),
    "Qwen3ForCausalLM": lambda c: LlamaForCausalLM(c, LlamaVariant(qk_norm=True, has_sliding_window=True)),
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": qwen2_moe,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "DeepseekV2ForCausalLM": deepseek_v2,
    "DeepseekV3ForCausalLM": deepseek_v3,
    "Gemma2ForCausalLM": gemma2,
    "Gemma3ForCausalLM": gemma3,
    "Gemma3ForConditionalGeneration": gemma3,  # its language model; images are not served
    "Phi3ForCausalLM": phi3,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3_5ForCausalLM": qwen3_5,
    "Qwen3_5ForConditionalGeneration": qwen3_5,  # its language model; images are not served
    "Qwen3_5MoeForCausalLM": qwen3_5_moe,
    "Qwen3_5MoeForConditionalGeneration": qwen3_5_moe,
    "Qwen3NextForCausalLM": qwen3_next,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "OPTForCausalLM": OPTForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def build_model(model_config: ModelConfig) -> nn.Module:
    builder = MODEL_BUILDERS.get(model_config.architecture) if model_config.architecture in ARCHITECTURES else None
    if builder is None:
        raise ValueError(f"architecture {model_config.architecture!r} is not supported; "
                         f"supported: {', '.join(supported_architectures())}")
    return builder(model_config)
