"""Pooling models on a worker: the LM head they drop, the tensor names their checkpoints use, and each
step's pooled vectors (a prompt's final hidden states -> one vector, folded in chunk by chunk)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
from torch import nn

from shardserve.runtime.worker.inputs import HostInputs, RequestState

T = TypeVar("T")  # a checkpoint tensor, passed through untouched


def drop_lm_head(model: nn.Module) -> None:
    """A pooling runner never computes logits: the head is neither loaded nor kept (a tied head is a view
    of the embedding, which stays)."""
    if hasattr(model, "lm_head"):
        del model.lm_head


def base_model_names(model: nn.Module, tensors: Iterable[tuple[str, T]]) -> Iterator[tuple[str, T]]:
    """A pooling checkpoint may hold the base model alone: sentence-transformers saves Qwen3-Embedding as
    Qwen3Model (`layers.0.self_attn.q_proj.weight`, `norm.weight`, no `model.` prefix, no head). Such names
    get the prefix of the causal LM's `model` module; a head in the checkpoint is skipped."""
    children = dict(model.named_children())
    for name, tensor in tensors:
        if name.startswith("lm_head."):
            continue
        if "model" in children and name.split(".", 1)[0] not in children:
            name = f"model.{name}"
        yield name, tensor


def pool_step(hidden: torch.Tensor, host: HostInputs, batch: list[RequestState]) -> dict[str, torch.Tensor]:
    """Fold this step's rows of each pooling request into its state; returns the vectors of the requests
    whose last prompt chunk ran ([hidden_size] float32 each, on the device), normalized where asked.

        hidden rows:  | r0: chunk 1 of 2 | r1: a whole prompt | r2: chunk 2 of 2 |
        MEAN:           summed             pooled               summed, pooled (sum / prompt tokens)
        LAST:           -                  its last row         its last row
        CLS:            row 0 kept         its first row        the row kept in chunk 1

    NOTE: a MEAN or CLS request never takes prompt blocks from the prefix cache (the scheduler's
    needs_every_prompt_token), so its first chunk starts at position 0; a preempted one is rebuilt from
    scratch on every rank, its sum with it."""
    done = {state.request_id for state in host.sampled_states}  # the whole prompt is in the cache now
    starts = host.query_start_loc.tolist()
    pooled = {}
    for row, state in enumerate(batch):
        params = state.pooling_params
        assert params is not None and params.normalize is not None  # resolved by the engine
        start, end = starts[row], starts[row + 1]
        if params.pooling_type == "MEAN":
            part = hidden[start:end].float().sum(dim=0)
            state.pooled = part if state.pooled is None else state.pooled + part
        elif params.pooling_type == "CLS" and state.pooled is None:
            state.pooled = hidden[start].float()
        if state.request_id not in done:
            continue
        if params.pooling_type == "LAST":
            vector = hidden[end - 1].float()
        else:
            assert state.pooled is not None  # folded in above, chunk by chunk
            vector = state.pooled / state.num_prompt_tokens if params.pooling_type == "MEAN" else state.pooled
        pooled[state.request_id] = nn.functional.normalize(vector, dim=-1) if params.normalize else vector
    return pooled
