"""Speculative decoding with a head on every rank that drafts from the model's own hidden states: an EAGLE-3 head
(speculative_config method eagle3: the states entering three layers, which every forward of the model captures,
worker/forward_context.HiddenCapture) or DeepSeek's MTP layer (method mtp: the model's final hidden states).

A draft position p reads the token after it, x_{p+1}, and the model's feature of p, so it can be computed once the
model has computed p and sampled (or been given) x_{p+1}:

    keep:      after the model's forward, each request's rows of features, from the position it started at
    catch-up:  next step, the positions the model has since computed for good (its num_computed_tokens; a verify
               step's rejected rows are dropped), each with the token after it; its last row gives draft 1
    round i:   each request drafting more than i tokens feeds draft i at the next position, with the head's own
               output of the row before as the feature, and takes draft i + 1

The head's KV is laid out in the model's pages as a draft model's is (worker/draft_model.py): a rejected draft's
row is written over by the next catch-up. Drafts are argmax (one-hot), so verification is rejection sampling
exactly (runtime/core/spec_decode.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from shardserve.planner.speculative import eagle3_aux_layers
from shardserve.runtime.config import EngineConfig, ModelConfig
from shardserve.runtime.models.deepseek_mtp import DeepseekMTP
from shardserve.runtime.models.qwen3_5_mtp import VARIANTS, Qwen3_5MTP
from shardserve.runtime.models.eagle3 import Eagle3Head
from shardserve.runtime.worker.checkpoint import checkpoint_files, iterate_file
from shardserve.runtime.worker.draft_model import DraftModelRunner
from shardserve.runtime.worker.forward_context import ForwardContext, HiddenCapture, forward_context
from shardserve.runtime.worker.inputs import HostInputs, RequestState, build_host_inputs, to_device, token_view
from shardserve.runtime.worker.loader import load_model


# architecture -> its multi-token-prediction layer's module (planner/speculative.MTP_ARCHITECTURES names them)
MTP_LAYERS = {"DeepseekV3ForCausalLM": DeepseekMTP, **{architecture: Qwen3_5MTP for architecture in VARIANTS}}


def make_drafter(config: EngineConfig, target: nn.Module, device: torch.device, backend,
                 states: dict[str, RequestState]) -> DraftModelRunner | None:
    """speculative_config's draft model, EAGLE-3 head or MTP layer on this rank; None without one."""
    if config.draft is None:
        return None
    spec, block_size = config.scheduler.speculative, config.cache.block_size
    method = None if spec is None else spec.method
    if method == "eagle3":
        names = {name for path in checkpoint_files(config.draft.model) for name, _ in iterate_file(path)}
        head: nn.Module = load_model(config.draft, device, lambda c: Eagle3Head(c, names))
        capture = HiddenCapture(eagle3_aux_layers(config.draft.hf_config.to_dict(), config.model.num_layers))
    elif method == "mtp":
        head, capture = load_model(config.draft, device, MTP_LAYERS[config.draft.architecture]), None
    else:
        return DraftModelRunner(config.draft, device, backend, block_size)
    head.share_embedding(target)  # type: ignore[operator]  # both heads' method
    return HeadRunner(config.draft, head, capture, device, backend, block_size, states)


class HeadRunner(DraftModelRunner):
    """A head drafting from the model's hidden states: an EAGLE-3 head (the states `capture` keeps, combined by
    its fc) or an MTP layer (the model's final hidden states: `capture` None)."""

    def __init__(self, config: ModelConfig, head: nn.Module, capture: HiddenCapture | None, device: torch.device,
                 backend, block_size: int, states: dict[str, RequestState]):
        """`states`: the worker's requests (a request's features are dropped once it is no longer among them)."""
        super().__init__(config, device, backend, block_size, head)
        self.head = head
        self.capture = capture
        self.states = states
        # request id -> (its state, the position of its first row, the rows' features): the last forward's
        self.features: dict[str, tuple[RequestState, int, torch.Tensor]] = {}

    def keep(self, batch: list[RequestState], host: HostInputs, hidden: torch.Tensor) -> None:
        """After the model's forward over `host` (built from `batch`), whose final hidden states are `hidden`: each
        request's features, from its start."""
        features = self._features(hidden)
        starts = host.query_start_loc.tolist()
        for index, state in enumerate(batch):
            self.features[state.request_id] = (state, state.num_computed_tokens,
                                               features[starts[index]:starts[index + 1]])
        for request_id in [r for r, (state, _, _) in self.features.items() if self.states.get(r) is not state]:
            del self.features[request_id]  # finished, or preempted and since come back as another state

    def dry_run(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, num_rows: int) -> None:
        """In the memory profile's forward (after the model's, in its context): the features of its tokens and a
        forward of the head over them, so the KV budget leaves room for both."""
        normed, _ = self.head(input_ids, positions, self._features(hidden))
        self.head.draft_tokens(normed[:num_rows])  # type: ignore[operator]  # both heads' method

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        """A forward's features: an EAGLE-3 head's fc of the states it captured (taken), else `hidden`, the
        model's final states (an MTP layer's)."""
        if self.capture is None:
            return hidden
        combined = self.head.combine(self.capture.captured)  # type: ignore[operator]  # an EAGLE-3 head's
        self.capture.captured.clear()
        return combined

    def propose(self, batch: list[RequestState], num_scheduled: dict[str, int],
                placeholders: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The drafts of the requests the scheduler left placeholders for (as many each), after catching the head
        up with the positions the model computed for good since its last forward (for every request in the batch)."""
        views, features = [], []
        for state in batch:
            entry = self.features.pop(state.request_id, None)
            if entry is None or entry[0] is not state or state.num_computed_tokens <= entry[1]:
                continue
            _, start, rows = entry
            # (the view's tokens are shifted by one: position p reads x_{p+1})
            views.append(dataclasses.replace(state, token_ids=token_view(state.token_ids, 1), num_computed_tokens=start,
                                             num_pending_tokens=0))
            features.append(rows[:state.num_computed_tokens - start])
        drafts: dict[str, list[int]] = {request_id: [] for request_id in placeholders}
        carried: dict[str, torch.Tensor] = {}  # request id -> the head's feature for its next draft position
        if views:
            counts = {view.request_id: len(rows) for view, rows in zip(views, features)}
            self._draft_round(build_host_inputs(views, counts, self.block_size), [v.request_id for v in views],
                              torch.cat(features), drafts, carried)
        by_id = {state.request_id: state for state in batch}
        for i in range(1, max(map(len, placeholders.values()), default=0)):
            going = [r for r, wanted in placeholders.items() if len(wanted) > i and r in carried]
            if not going:
                break
            views = [dataclasses.replace(by_id[r], token_ids=token_view(by_id[r].token_ids, 1, drafts[r]),
                                         num_computed_tokens=by_id[r].num_computed_tokens - 1 + i,
                                         num_pending_tokens=0) for r in going]
            self._draft_round(build_host_inputs(views, {r: 1 for r in going}, self.block_size), going,
                              torch.stack([carried[r] for r in going]), drafts, carried)
        for request_id, wanted in placeholders.items():  # NOTE: only a request the head has no feature for yet:
            known = by_id[request_id].token_ids  # its last token repeated, kept if the model samples it
            drafts[request_id] += [known[-1]] * (len(wanted) - len(drafts[request_id]))
        return {request_id: tuple(tokens) for request_id, tokens in drafts.items()}

    def _draft_round(self, host: HostInputs, request_ids: list[str], features: torch.Tensor,
                     drafts: dict[str, list[int]], carried: dict[str, torch.Tensor]) -> None:
        """One forward of the head over `host` (the requests `request_ids`, in order); each drafting request's next
        draft is the argmax of its last row, and the head's output there its next feature."""
        inputs = to_device(host, self.staging)
        with forward_context(ForwardContext(inputs.attn_metadata, self.backend)):
            normed, prenorm = self.head(inputs.input_ids, inputs.positions, features)
        ends = np.asarray(host.query_start_loc[1:], dtype=np.int64) - 1
        picked = [(row, request_id) for row, request_id in zip(ends.tolist(), request_ids) if request_id in drafts]
        if not picked:
            return
        rows = torch.tensor([row for row, _ in picked], device=normed.device)
        tokens = self.head.draft_tokens(normed[rows]).tolist()  # type: ignore[operator]  # both heads' method
        for (row, request_id), token in zip(picked, tokens):
            drafts[request_id].append(token)
            carried[request_id] = prenorm[row]
