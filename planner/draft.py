"""speculative_config's draft model (method draft_model) as a plan counts it: its weights and KV on every rank of
the (single) stage beside the target's, the tensor-parallel sizes its heads allow, and what the runtime refuses."""

from __future__ import annotations

from dataclasses import dataclass

from shardserve.planner.errors import PlanError
from shardserve.planner.model_source import ModelInfo, load_model
from shardserve.planner.options import RuntimeSettings
from shardserve.planner.rules import tensor_parallel_problem
from shardserve.planner.speculative import draft_layout_problem, draft_pair_problem


@dataclass(frozen=True)
class DraftModel:
    info: ModelInfo

    @property
    def num_layers(self) -> int:
        return self.info.spec.num_layers

    def weights_bytes(self, tp: int, dtype: str) -> int:
        """One rank's share of its weights (all its layers, embedding and head)."""
        return int(self.info.sharded(tp, dtype, 1).stage_bytes([self.num_layers])[0])

    def kv_bytes_per_token(self, tp: int, kv_dtype_bytes: int) -> int:
        """What one token caches in its layers on one rank (a page holds the draft's layers beside the target's)."""
        return self.num_layers * self.info.spec.kv_values_per_layer(tp) * kv_dtype_bytes

    def problem(self, tp: int, pp: int, kv_offloading_size: float | None) -> str | None:
        """Why it cannot draft beside this layout, in the engine's words, or None."""
        layout = draft_layout_problem(pp, kv_offloading_size)
        if layout:
            return layout
        problem = tensor_parallel_problem(self.info.spec, tp, False)
        return f"speculative_config's draft model {self.info.spec.id}: {problem}" if problem else None


def load_draft(settings: RuntimeSettings, target: ModelInfo) -> DraftModel | None:
    """The draft model the settings name, read as a plan reads a model; a PlanError names what keeps it from
    drafting for `target` (as the engine checks it)."""
    spec = settings.speculative
    if spec is None or spec.model is None:
        return None
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
