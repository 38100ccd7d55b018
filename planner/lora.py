"""LoRA adapters as the planner sees them, torch-free: a PEFT folder's config and tensor shapes checked
against the base model, and the bytes of the adapter slots each rank keeps on its GPU.

A PEFT LoRA adds (alpha / r) * B @ A to a linear layer's weight W [out, in], with A [r, in] and B [out, r]
(alpha / sqrt(r) with use_rslora). Its safetensors name each pair after the module it adapts:

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [r, hidden]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [q heads * head_dim, r]

Every rank keeps max_loras slots sized for max_lora_rank and the seven modules below, as the runtime
allocates them (runtime/layers/lora.py): per layer, A of each merged part over the rank's input features
and B over its output features (q|k|v share one matrix, as do gate|up)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from shardserve.planner.errors import PlanError
from shardserve.planner.model_spec import ModelSpec
from shardserve.planner.served import ARCHITECTURES
from shardserve.planner.tensors import HeaderError, safetensors_header

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(.*\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")
# PEFT options that change what the adapter computes; served only at their plain values
_PLAIN = {"bias": "none", "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
          "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


class AdapterError(PlanError, ValueError):
    """An adapter that cannot be served: a 400 for the server, a launch error for --lora-modules."""


@dataclass(frozen=True)
class AdapterSpec:
    """One PEFT LoRA folder, read without its weights."""

    name: str
    rank: int
    alpha: float
    use_rslora: bool
    # checkpoint module name (model.layers.3.self_attn.q_proj) -> (A's shape, B's shape)
    modules: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter(name: str, path: str) -> AdapterSpec:
    """The adapter at `path` (a folder), or an AdapterError naming what is wrong with it. NOTE: no error
    names the path or repeats what the adapter's files hold (a server's client reads them): a wrong path
    could show another file's contents."""
    folder = Path(path)
    try:
        is_folder = (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        is_folder = False
    if not is_folder:
        raise AdapterError(f"LoRA adapter {name!r}: its path is not a PEFT adapter folder (it needs {CONFIG_FILE} "
                           f"and {WEIGHTS_FILE})")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise AdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a PEFT LoRA config (r, lora_alpha)") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: its peft_type is not LORA")
    for key, plain in _PLAIN.items():
        if config.get(key) not in (None, [], {}) and config[key] != plain:
            raise AdapterError(f"LoRA adapter {name!r}: {key} is set, which is not served (only {plain!r})")
    return AdapterSpec(name, rank, alpha, bool(config.get("use_rslora", False)),
                       _module_shapes(name, folder / WEIGHTS_FILE))


def adapted_module(tensor: str) -> tuple[str, str] | None:
    """'base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight' -> ('model.layers.3.self_attn.q_proj',
    'A'); None for a tensor that is not a layer projection's A or B."""
    match = _TENSOR.match(tensor)
    return None if match is None else (match.group(1), match.group(4))


def _module_shapes(name: str, weights: Path) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    try:
        header = safetensors_header(weights, whole=True)
    except HeaderError as error:
        raise AdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} {error.reason}") from None
    except OSError:
        raise AdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read") from None
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    tensors = [(tensor, info) for tensor, info in header.items() if tensor != "__metadata__"]
    others = sum(adapted_module(tensor) is None for tensor, _ in tensors)
    if others:
        raise AdapterError(f"LoRA adapter {name!r}: {others} of its {len(tensors)} tensors are not a LoRA A or B "
                           f"of a layer's attention or MLP projection; served modules: {', '.join(LORA_MODULES)}")
    for tensor, info in tensors:
        module, which = adapted_module(tensor) or ("", "")
        pairs.setdefault(module, {})[which] = tuple(info["shape"])
    if not pairs:
        raise AdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: {module} has lora_{''.join(pair)} without its pair")
    return {module: (pair["A"], pair["B"]) for module, pair in pairs.items()}


def module_features(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(input, output) features of each module a LoRA may adapt, for the whole model."""
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def lora_problem(architecture: str, max_loras: int, max_cpu_loras: int | None) -> str | None:
    """Why enable_lora cannot be served with these settings (plan and engine alike), or None."""
    served = ARCHITECTURES.get(architecture)
    if served is not None and not served.serves_lora:
        names = ", ".join(a for a, s in ARCHITECTURES.items() if s.serves_lora)
        return f"enable_lora: {architecture} is not served with LoRA adapters; served: {names}"
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        return f"max_cpu_loras={max_cpu_loras} is below max_loras={max_loras}: every slot's adapter stays in host memory"
    return None


def adapter_problem(adapter: AdapterSpec, spec: ModelSpec, max_lora_rank: int) -> str | None:
    """Why this adapter does not fit the model and the slots (rank, modules, shapes), or None."""
    where = f"LoRA adapter {adapter.name!r}"
    if adapter.rank > max_lora_rank:
        return f"{where} has rank {adapter.rank}, above max_lora_rank={max_lora_rank}: raise --max-lora-rank"
    features = module_features(spec)
    for module, (a_shape, b_shape) in adapter.modules.items():
        kind, layer = module.rpartition(".")[2], int(module.split(".layers.")[1].split(".")[0])
        if kind not in features:
            return f"{where} adapts {kind}, which is not served; served modules: {', '.join(LORA_MODULES)}"
        if layer >= spec.num_layers:
            return f"{where} adapts layer {layer}, but {spec.id} has {spec.num_layers} layers: another base model's?"
        fan_in, fan_out = features[kind]
        if a_shape != (adapter.rank, fan_in) or b_shape != (fan_out, adapter.rank):
            return (f"{where} does not fit {spec.id}: {module} has A {list(a_shape)} and B {list(b_shape)}, the "
                    f"model needs A [{adapter.rank}, {fan_in}] and B [{fan_out}, {adapter.rank}] (another base "
                    "model's adapter?)")
    return None


def slot_bytes(spec: ModelSpec, tp: int, num_layers: int, max_lora_rank: int, dtype_bytes: int) -> int:
    """One adapter slot on one rank of a stage with num_layers layers (zeros where an adapter's rank or
    modules are smaller). Column-parallel modules keep A whole and B's rows of the rank; row-parallel
    ones A's columns of the rank and B whole."""
    q, kv = spec.num_attention_heads * spec.head_dim // tp, max(1, spec.num_kv_heads // tp) * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size // tp
    a = 3 * hidden + q + 2 * hidden + inter  # qkv's three parts, o_proj, gate_up's two, down_proj
    b = (q + 2 * kv) + hidden + 2 * inter + hidden
    return (a + b) * max_lora_rank * num_layers * dtype_bytes
