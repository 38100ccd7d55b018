"""Speculative decoding's settings and its arithmetic, torch-free: vLLM's --speculative-config as far as it is
served, what rules it out, and the tokens a verify step yields at an acceptance rate. The engine parses the setting
here (runtime/core/spec_decode.py drafts and verifies); the planner prices it (planner/serving.py).

A step verifies a request's k drafts in one forward and keeps them up to the first the model did not sample, then
the model's own token. With each draft kept with probability a once the ones before it were (a constant per
position: the geometric model speculative-decoding papers and vLLM's synthetic acceptance use), a verify step
yields 1 + a + a^2 + ... + a^k tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
ALIASES = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp"}  # vLLM's older names
NOT_YET = {"eagle": "EAGLE (EAGLE-3 is served)", "medusa": "Medusa", "suffix": "suffix decoding"}
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
OWN_KEYS = {"ngram": ("prompt_lookup_max", "prompt_lookup_min"), "draft_model": ("model",), "eagle3": ("model",),
            "mtp": ()}
HEAD_METHODS = ("eagle3", "mtp")  # their drafter reads the model's hidden states: every step runs eagerly
# architectures whose checkpoints carry multi-token-prediction layers served as method mtp
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
                     "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
MTP_COUNT_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")  # DeepSeek's name, Qwen's
# config.json architectures of EAGLE-3 draft heads (the EAGLE authors' name and vLLM's)
EAGLE3_HEADS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# targets whose decoder layers do not hand the hidden states an EAGLE-3 head reads (they are not Llama-style)
NO_EAGLE3_TARGETS = ("GPT2LMHeadModel", "OPTForCausalLM")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config, as far as it is served: method "ngram" (prompt lookup), "draft_model" (a
    smaller model of the same vocabulary drafts greedily; `model` is its folder or Hub id), "eagle3" (an
    EAGLE-3 draft head, `model`, drafts from the model's own hidden states) or "mtp" (the model's own
    multi-token-prediction layer does: DeepSeek-V3/R1's, Qwen3.5's, Qwen3-Next's)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    model: str | None = None

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """From the JSON of --speculative-config (or its dict); a ValueError names the key to change."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not JSON ({e.msg} at character {e.pos}); give e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 3}\'') from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: a JSON object is needed, got {type(value).__name__}")
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config: {', '.join(unknown)} not served (keys served: {', '.join(KEYS)})")
        method = value.get("method", "draft_model" if "model" in value else "ngram" if "prompt_lookup_max" in value
                           else None)
        method = ALIASES.get(method, method) if isinstance(method, str) else method
        if isinstance(method, str) and method in NOT_YET:
            raise ValueError(f"speculative_config: method {method!r} ({NOT_YET[method]}) is not served yet; "
                             f"methods served: {', '.join(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
        foreign = [key for other, keys in OWN_KEYS.items() if other != method for key in keys
                   if key in value and key not in OWN_KEYS[method]]
        if foreign:
            owners = " or ".join(m for m, keys in OWN_KEYS.items() if foreign[0] in keys)
            raise ValueError(f"speculative_config: {foreign[0]} applies to method {owners}, not {method}")
        k = _int(value, "num_speculative_tokens", None)
        if "model" in OWN_KEYS[method]:
            model = value.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(f"speculative_config: method {method} needs model, the draft's folder or Hub id")
            return cls(method, k, model=model)
        if method == "mtp":
            return cls(method, k)
        high = _int(value, "prompt_lookup_max", 5)
        low = _int(value, "prompt_lookup_min", min(high, 2))
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) is above prompt_lookup_max ({high})")
        return cls(method, k, high, low)

    def to_json(self) -> str:
        """vLLM's JSON for this config, its method's keys written (what a plan records and an export passes on)."""
        own = {key: getattr(self, key) for key in OWN_KEYS[self.method]}
        return json.dumps({"method": self.method, "num_speculative_tokens": self.num_speculative_tokens, **own})


def _int(value: dict, key: str, default: int | None) -> int:
    number = value.get(key, default)
    if number is None:
        raise ValueError(f"speculative_config: {key} is required (the tokens drafted per step, e.g. 3)")
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 64:
        raise ValueError(f"speculative_config: {key} must be an integer from 1 to 64, got {number!r}")
    return number


# NOTE: n-gram's default acceptance is vLLM's own measurement of its prompt-lookup proposer (5 drafts, lookup 2 to 5
# tokens) on code edits, vllm-project/vllm#24344: 5,376 tokens from 1,814 target forwards (2.96 per forward, steps
# without a match included), which 1 + a + ... + a^5 = 2.96 gives as a = 0.70. Prompt lookup pays on edits, code and
# retrieval answers, the traffic it is for; free chat accepts far fewer: measure yours (the plan says how).
DEFAULT_ACCEPTANCE = {"ngram": 0.70}  # a draft model's depends on the pair of models: no default is guessed


def acceptance_rate(config: SpeculativeConfig, given: float | None) -> float:
    """The acceptance rate to price `config` at: the one given, else its method's default; a ValueError names the
    setting when the method has none."""
    if given is not None:
        return given
    if config.method not in DEFAULT_ACCEPTANCE:
        raise ValueError(f"draft_acceptance_rate: method {config.method}'s acceptance depends on the pair of models "
                         "and the traffic; give --draft-acceptance-rate (launch's self-check measures it)")
    return DEFAULT_ACCEPTANCE[config.method]


def tokens_per_step(k: int, acceptance: float) -> float:
    """The tokens a request gains from one verify step of k drafts: 1 + a + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


def acceptance_for(tokens: float, k: int) -> float:
    """The acceptance rate at which a verify step of k drafts yields `tokens` tokens (the inverse of
    tokens_per_step, by bisection): what a measured tokens-per-forward means for --draft-acceptance-rate."""
    if not 1.0 <= tokens <= k + 1:
        raise ValueError(f"{tokens:g} tokens per forward: between 1 and {k + 1} with {k} drafts")
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if tokens_per_step(k, mid) < tokens else (low, mid)
    return low


def resolve(value: str | dict | None, given_rate: float | None) -> tuple[SpeculativeConfig | None, float | None]:
    """speculative_config parsed, and the acceptance rate it is priced at ((None, None) without it); a ValueError
    names the setting to change."""
    config = SpeculativeConfig.parse(value)
    if config is None:
        if given_rate is not None:
            raise ValueError("draft_acceptance_rate prices speculative decoding, and speculative_config is not set: "
                             "set both, or neither")
        return None, None
    return config, acceptance_rate(config, given_rate)


def draft_pair_problem(draft_vocab: int, vocab: int, num_groups: int, recurrent_kind: str | None) -> str | None:
    """Why a draft model cannot draft for a model (the plan and the engine alike): their vocabularies differ, or one
    has more than one kind of attention layer (`num_groups`: the larger of the two), or the draft has recurrent
    layers."""
    if draft_vocab != vocab:
        return f"its vocabulary has {draft_vocab} tokens, the model's {vocab}"
    if num_groups > 1 or recurrent_kind:
        return "a draft or model with more than one kind of attention layer (windows) or recurrent layers"
    return None


def draft_layout_problem(method: str, pipeline_parallel_size: int, kv_offloading_size: float | None) -> str | None:
    """Why a draft model or head (method draft_model, eagle3) cannot run beside these, or None (the plan and the
    engine alike)."""
    if pipeline_parallel_size > 1:
        return (f"speculative_config: method {method} runs beside the first pipeline stage only when there is "
                "one; pipeline_parallel_size above 1 is not served with it")
    if kv_offloading_size is not None:
        return (f"speculative_config: method {method} with kv_offloading_size: the CPU tier keeps the model's "
                "layers of a block, not the draft's, whose drafts would then read stale keys; drop one of them")
    return None


def mtp_problem(architecture: str, text_config: dict) -> str | None:
    """Why method mtp cannot draft for a model (its language model's config.json), or None (the plan and the engine
    alike)."""
    if architecture not in MTP_ARCHITECTURES:
        return (f"speculative_config: method mtp drafts with the model's own multi-token-prediction layers, served "
                f"for {', '.join(MTP_ARCHITECTURES)}; {architecture} has none served: use ngram, draft_model or eagle3")
    if not any(text_config.get(key) for key in MTP_COUNT_KEYS):
        return (f"speculative_config: method mtp needs the model's multi-token-prediction layer, and its config.json "
                f"counts none ({' or '.join(MTP_COUNT_KEYS)})")
    return None


def eagle3_aux_layers(head_config: dict, num_layers: int) -> tuple[int, ...]:
    """The decoder layers whose inputs (the hidden states entering them) an EAGLE-3 head reads: its config's
    eagle_config.eagle_aux_hidden_state_layer_ids, else layers 2, L/2 and L-3 of an L-layer model (the EAGLE-3
    training recipe's, and vLLM's default); index L is the last layer's output. A ValueError names a bad one."""
    given = (head_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(given) if given is not None else (2, num_layers // 2, num_layers - 3)
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= num_layers]
    if bad or len(layers) != 3:
        where = "eagle_config.eagle_aux_hidden_state_layer_ids" if given is not None else "the default layers"
        raise ValueError(f"{where} {list(layers)}: three layer indices from 0 to {num_layers} are needed for a "
                         f"model of {num_layers} layers")
    return layers


def eagle3_head_config(config: dict) -> dict:
    """An EAGLE-3 head's config.json as the EAGLE authors lay it out: a speculators-format one (vllm-project/speculators,
    `speculators_model_type` eagle3: its Llama layer under transformer_layer_config, the layer ids at the top, normed
    before the residual unless it says otherwise, as vLLM reads them) translated, any other as it is."""
    if config.get("speculators_model_type") != "eagle3":
        return config
    head = dict(config.get("transformer_layer_config") or {})
    head.update(architectures=["Eagle3LlamaForCausalLM"], model_type="llama",
                draft_vocab_size=config.get("draft_vocab_size") or head.get("vocab_size"),
                norm_before_residual=config.get("norm_before_residual", True))
    if config.get("target_hidden_size") is not None:
        head["target_hidden_size"] = config["target_hidden_size"]
    if config.get("eagle_aux_hidden_state_layer_ids"):
        head["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"]}
    return head


def eagle3_problem(head_config: dict, vocab: int, hidden_size: int, num_layers: int, architecture: str,
                   num_groups: int) -> str | None:
    """Why an EAGLE-3 head (its config.json) cannot draft for a model, or None (the plan and the engine alike)."""
    architectures = head_config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in EAGLE3_HEADS:
        return f"its architectures are {architectures}, not an EAGLE-3 head's ({' or '.join(EAGLE3_HEADS)})"
    if architecture in NO_EAGLE3_TARGETS:
        return f"{architecture} does not hand its layers' hidden states to a draft head"
    if head_config.get("vocab_size") != vocab:
        return f"it drafts for a vocabulary of {head_config.get('vocab_size')} tokens, the model's has {vocab}"
    target_hidden = head_config.get("target_hidden_size") or head_config.get("hidden_size")
    if target_hidden != hidden_size:
        return f"it reads hidden states of size {target_hidden}, the model's are {hidden_size}"
    if num_groups > 1:
        return "a model with more than one kind of attention layer (windows)"
    try:
        eagle3_aux_layers(head_config, num_layers)
    except ValueError as e:
        return str(e)
    return None


def speculative_problem(async_scheduling: bool = False, pooling: bool = False) -> str | None:
    """Why speculative_config cannot run with these (the engine's settings), or None."""
    blocker = next((why for why, present in (
        ("async_scheduling (its steps are queued before the drafts they would verify are known)", async_scheduling),
        ("a pooling model (it samples nothing)", pooling)) if present), None)
    return None if blocker is None else f"speculative_config cannot run with {blocker}; drop one of them"
