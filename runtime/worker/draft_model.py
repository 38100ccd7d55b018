"""Speculative decoding's draft model (speculative_config method draft_model) on every rank: a smaller model of the
target's vocabulary, sharded as the target is, with a KV pool of its own laid out in the target's blocks (the same
block tables and slots), that drafts each decoding request's tokens greedily before the target's forward verifies
them. Every rank runs it on the same batch, and the logits are gathered to every rank, so all draft alike.

    catch-up:  the tokens the target computes this step, bar its drafts, from where the draft's KV stops being
               valid (the target's num_computed_tokens, or the end of what the draft computed if that is sooner:
               after a step whose drafts were all kept, the last draft); its last token's logits give draft 1
    round i:   each request drafting more than i tokens feeds draft i at the next position and takes draft i + 1

The draft's KV is valid up to the target's num_computed_tokens: a rejected draft's row is written over by the
tokens that follow. Drafts are argmax (one-hot), so keeping a draft while the target samples it is rejection
sampling exactly (runtime/core/spec_decode.py)."""

from __future__ import annotations

import dataclasses
import math

import torch

from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.config import ModelConfig
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context
from shardserve.runtime.worker.inputs import HostInputs, RequestState, build_host_inputs, to_device, token_view
from shardserve.runtime.worker.loader import load_model
from shardserve.runtime.worker.staging import StagingBuffer


class DraftModelRunner:
    def __init__(self, config: ModelConfig, device: torch.device, backend, block_size: int,
                 model: torch.nn.Module | None = None):
        """`model`: the draft module already loaded (an EAGLE-3 head); None: the draft model `config` names."""
        self.model = model if model is not None else load_model(config, device)
        self.layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.layers:
            layer.fix_kv_scales()
        self.backend, self.block_size = backend, block_size
        self.staging = StagingBuffer(device)  # its own: a step's rounds are packed while the target's waits
        self.kv_cache: torch.Tensor | None = None

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[layers, planes, num_blocks, block_size, kv_heads, head_dim]: the target pool's layout, its layers."""
        layer = self.layers[0]
        return (len(self.layers), layer.cache_planes, num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return math.prod(self.kv_shape(1)) * dtype.itemsize

    def bind(self, num_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        self.kv_cache = torch.zeros(self.kv_shape(num_blocks), dtype=dtype, device=device)
        for index, layer in enumerate(self.layers):
            layer.kv_cache = self.kv_cache[index]

    def release(self) -> None:
        for layer in self.layers:
            layer.kv_cache = None
        self.layers, self.kv_cache = [], None
        self.model = None  # type: ignore[assignment]  # released: no step runs after this

    def dry_run(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, num_rows: int) -> None:
        """In the memory profile's forward (after the model's, in its context): the draft's forward over its tokens,
        so the KV budget leaves room for it (`hidden`, the model's: unused here)."""
        out = self.model(input_ids, positions, None)
        self.model.compute_logits(out[:num_rows])  # type: ignore[operator]  # every model family's method

    def propose(self, batch: list[RequestState], num_scheduled: dict[str, int],
                placeholders: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The drafts of the requests the scheduler left placeholders for (as many each), after catching the
        draft's KV up with the step's tokens for every request in the batch (prompt chunks too)."""
        views, counts = [], {}
        for state in batch:
            num_drafts = len(placeholders.get(state.request_id, ()))
            end = state.num_computed_tokens + num_scheduled[state.request_id] - num_drafts  # its known tokens' end
            start = min(state.draft_computed, state.num_computed_tokens)
            if end > start:
                views.append(dataclasses.replace(state, num_computed_tokens=start, num_pending_tokens=0))
                counts[state.request_id] = end - start
            state.draft_computed = end + max(0, num_drafts - 1)  # (rounds 1 to k - 1 compute drafts 1 to k - 1)
        if not views:
            return {}
        drafts: dict[str, list[int]] = {request_id: [] for request_id in placeholders}
        self._extend(build_host_inputs(views, counts, self.block_size), drafts)
        by_id = {state.request_id: state for state in batch}
        for i in range(1, max(map(len, placeholders.values()), default=0)):
            going = [request_id for request_id, wanted in placeholders.items() if len(wanted) > i]
            views = [dataclasses.replace(by_id[r], token_ids=token_view(by_id[r].token_ids, 0, drafts[r]),
                                         num_computed_tokens=by_id[r].num_computed_tokens + i, num_pending_tokens=0)
                     for r in going]
            self._extend(build_host_inputs(views, {r: 1 for r in going}, self.block_size), drafts)
        return {request_id: tuple(tokens) for request_id, tokens in drafts.items()}

    def _extend(self, host: HostInputs, drafts: dict[str, list[int]]) -> None:
        """One forward of the draft model; each drafting request's next draft is the argmax of its last row."""
        inputs = to_device(host, self.staging)
        with forward_context(ForwardContext(inputs.attn_metadata, self.backend)):
            hidden = self.model(inputs.input_ids, inputs.positions, None)
        rows = [row for row, state in enumerate(host.sampled_states) if state.request_id in drafts]
        if not rows:
            return
        picked = inputs.logits_indices[torch.tensor(rows, device=inputs.logits_indices.device)]
        # compute_logits: every model family's method, which nn.Module's type does not declare
        tokens = self.model.compute_logits(hidden[picked]).argmax(dim=-1).tolist()  # type: ignore[operator]
        for row, token in zip(rows, tokens):
            drafts[host.sampled_states[row].request_id].append(token)
