"""speculative_config's draft model (method draft_model), EAGLE-3 head (eagle3) or MTP layer (mtp) as a plan counts
it: its weights and KV on every rank of the (single) stage beside the target's, the tensor-parallel sizes its heads
allow, and what the runtime refuses.

An EAGLE-3 head is priced as the one-layer Llama it mostly is (its layer, norm and head over the draft vocabulary),
plus what that leaves out: fc (three hidden states to one, whole on every rank), the q/k/v projections' second
input half, and the model's embedding it shares when it has none of its own. Its weights are counted from the
checkpoint's own tensor headers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardserve.planner.errors import PlanError
from shardserve.planner.hf_config import read_config_json
from shardserve.planner.hub import cached_snapshot
from shardserve.planner.model_source import ModelInfo, load_model, model_path
from shardserve.planner.model_spec import DTYPE_BYTES, ModelSpec, TensorInfo
from shardserve.planner.options import RuntimeSettings
from shardserve.planner.rules import tensor_parallel_problem
from shardserve.planner.speculative import (draft_layout_problem, draft_pair_problem, eagle3_head_config,
                                            eagle3_problem, mtp_problem)
from shardserve.planner.tensors import derive_tensors, read_safetensors_headers

# an EAGLE-3 head's tensors kept whole on every rank: fc, the norms, d2t (t2d is not loaded)
_REPLICATED = ("fc.weight", "norm.weight", "layernorm.weight", "hidden_norm.weight", "d2t")


@dataclass(frozen=True)
class DraftModel:
    info: ModelInfo
    method: str = "draft_model"
    head_tensors: tuple[TensorInfo, ...] = ()  # an EAGLE-3 head's checkpoint tensors (its weights are theirs)
    shared_tables: int = 0  # an MTP layer's: the model's embedding (DeepSeek), and its LM head too (Qwen)

    @property
    def num_layers(self) -> int:
        return self.info.spec.num_layers

    @property
    def name(self) -> str:
        if self.method == "mtp":
            return f"the MTP layer of {self.info.spec.id}"
        return f"{'the EAGLE-3 head' if self.method == 'eagle3' else 'the draft model'} {self.info.spec.id}"

    def weights_bytes(self, tp: int, dtype: str) -> int:
        """One rank's share of its weights (all its layers, embedding and head)."""
        if self.method == "mtp":  # a one-layer model less the tables it shares, plus its fc (whole on each rank)
            spec, size = self.info.spec, DTYPE_BYTES[dtype]
            stage = self.info.sharded(tp, dtype, 1).stage_bytes([1])[0]
            shared = self.shared_tables * spec.vocab_size * spec.hidden_size * size / tp
            return int(stage - shared + 2 * spec.hidden_size ** 2 * size)
        if not self.head_tensors:
            return int(self.info.sharded(tp, dtype, 1).stage_bytes([self.num_layers])[0])
        total = 0.0
        for t in self.head_tensors:
            if t.name.endswith("t2d"):
                continue
            size = t.stored_bytes if not t.is_float else t.numel * DTYPE_BYTES[dtype]
            total += size if t.name.endswith(_REPLICATED) else size / tp
        return int(total)

    def kv_bytes_per_token(self, tp: int, kv_dtype_bytes: int) -> int:
        """What one token caches in its layers on one rank (a page holds the draft's layers beside the target's)."""
        return self.num_layers * self.info.spec.kv_values_per_layer(tp) * kv_dtype_bytes

    def problem(self, tp: int, pp: int, kv_offloading_size: float | None) -> str | None:
        """Why it cannot draft beside this layout, in the engine's words, or None."""
        layout = draft_layout_problem(self.method, pp, kv_offloading_size)
        if layout:
            return layout
        problem = tensor_parallel_problem(self.info.spec, tp, False)
        return f"speculative_config's {self.name}: {problem}" if problem else None


def load_draft(settings: RuntimeSettings, target: ModelInfo) -> DraftModel | None:
    """The draft model or EAGLE-3 head the settings name, read as a plan reads a model; a PlanError names what keeps
    it from drafting for `target` (as the engine checks it)."""
    spec = settings.speculative
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "mtp":
        return _mtp_layer(target)
    if spec.method == "eagle3":
        assert spec.model is not None  # (parse requires it)
        return _load_head(spec.model, target)
    assert spec.model is not None  # (parse requires it of draft_model)
    try:
        info = load_model(spec.model)
    except PlanError as e:
        raise PlanError(f"speculative_config: the draft model {spec.model}: {e}") from None
    draft, model = info.spec, target.spec
    problem = draft_pair_problem(draft.vocab_size, model.vocab_size,
                                 max(draft.kv_groups.num_groups, model.kv_groups.num_groups), draft.recurrent_kind)
    if problem is None and draft.max_context_len < settings.max_model_len:
        problem = f"it has {draft.max_context_len} positions, max_model_len is {settings.max_model_len}"
    if problem:
        raise PlanError(f"speculative_config: the draft model {spec.model} cannot draft here: {problem}")
    return DraftModel(info)


def _load_head(name: str, target: ModelInfo) -> DraftModel:
    """An EAGLE-3 head from its folder (or the Hugging Face cache): its config.json and tensor headers."""
    path = Path(model_path(name)).expanduser()
    folder = path if path.is_dir() else cached_snapshot(name, target.hub)
    if folder is None or not (folder / "config.json").is_file():
        raise PlanError(f"speculative_config: the EAGLE-3 head {name}: not a folder with config.json nor in the "
                        f"Hugging Face cache; download it first (`hf download {name}`)")
    config = eagle3_head_config(read_config_json(folder / "config.json", str(folder / "config.json")))
    model = target.spec
    problem = eagle3_problem(config, model.vocab_size, model.hidden_size, model.num_layers, model.architecture,
                             model.kv_groups.num_groups)
    headers = read_safetensors_headers(folder)
    if problem is None and not headers:
        problem = "its folder has no safetensors weights"
    if problem:
        raise PlanError(f"speculative_config: the draft model {name} cannot draft here: {problem}")
    layer = {**config, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "tie_word_embeddings": False,
             "vocab_size": config.get("draft_vocab_size") or config["vocab_size"]}
    try:
        spec = ModelSpec.from_config(name, layer)
    except PlanError as e:
        raise PlanError(f"speculative_config: the EAGLE-3 head {name}: {e}") from None
    info = ModelInfo(spec, tuple(derive_tensors(spec)), "folder", str(folder), "config", config)
    return DraftModel(info, "eagle3", tuple(headers or ()))


def _mtp_layer(target: ModelInfo) -> DraftModel:
    """The model's own multi-token-prediction layer (method mtp), priced as one more sparse layer (MLA, or gated
    full attention) and its head."""
    model, config = target.spec, target.config
    text = config.get("text_config") or config  # (a multimodal checkpoint's language model)
    problem = mtp_problem(model.architecture, text)
    if problem:
        raise PlanError(problem)
    layer = {**text, "num_hidden_layers": 1, "first_k_dense_replace": 0}  # one sparse layer
    if "layer_types" in text:
        layer["layer_types"] = ["full_attention"]
    spec = ModelSpec.from_config(model.id, {**config, "text_config": layer} if "text_config" in config else layer)
    return DraftModel(ModelInfo(spec, tuple(derive_tensors(spec)), target.source, target.path, "config", config),
                      "mtp", shared_tables=1 if model.architecture == "DeepseekV3ForCausalLM" else 2)
