"""A rank's LoRA adapters: read from their PEFT folders (this rank's shard of this stage's layers only),
kept in host memory for max_cpu_loras adapters, and copied into a slot when the scheduler says so.

An adapter whose files changed or vanished after the engine checked them fails alone: the ranks agree on
which loads failed (each reads only its own layers), every rank empties those slots, and the step's result
names the adapters so the engine fails their requests (runtime/core/engine.py)."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import cast

import numpy as np
import torch
from safetensors import SafetensorError
from torch import nn

from shardserve.planner.lora import WEIGHTS_FILE, adapted_module, read_adapter
from shardserve.runtime.worker.checkpoint import iterate_file
from shardserve.runtime.config import LoRAConfig
from shardserve.runtime.distributed.parallel_state import world_any
from shardserve.runtime.worker.inputs import HostInputs, RequestState
from shardserve.runtime.layers.linear import LinearBase
from shardserve.runtime.layers.lora import LORA_LAYERS, attach_lora_slots
from shardserve.runtime.layers.lora_batch import LoRABatch, lora_batch
from shardserve.runtime.lora_request import LoRARequest

# layer name -> (A per part, scaled B per part), None where the adapter leaves a part alone
AdapterShard = dict[str, tuple[list[torch.Tensor | None], list[torch.Tensor | None]]]
# what reading an adapter whose files changed, were cut short or vanished may raise (a file missing, a header
# or shape not the checked one, a module the model lacks); never a programming error such as an AssertionError
READ_ERRORS = (OSError, ValueError, KeyError, IndexError, RuntimeError, SafetensorError)

logger = logging.getLogger(__name__)


class RankAdapters:
    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.slots = attach_lora_slots(model, config.max_loras, config.max_lora_rank, dtype, device)
        self.dtype = dtype
        self.device = device
        self.num_slots = config.max_loras
        self.capacity = config.max_cpu_loras
        self.cache: OrderedDict[int, AdapterShard] = OrderedDict()  # by lora_int_id, most recently used last

    def load(self, loads: tuple[tuple[int, LoRARequest], ...]) -> tuple[int, ...]:
        """Fill each slot with its adapter, in order; the lora_int_ids of those some rank could not read,
        their slots left empty on every rank and their weights cached on none.
        NOTE: a collective (every rank calls it with the step's loads): a stage or a shard can fail where
        the others read fine, and only the output rank reports the step. Steps without loads pay nothing."""
        shards = [self._fill(slot, lora) for slot, lora in loads]
        failed = world_any([shard is None for shard in shards], self.device)
        for (slot, lora), shard, has_failed in zip(loads, shards, failed):
            self.cache.pop(lora.lora_int_id, None)
            if has_failed:
                self._set(slot, {})
            else:
                assert shard is not None  # filled on this rank
                self.cache[lora.lora_int_id] = shard  # most recently used (the same order on every rank)
                while len(self.cache) > self.capacity:
                    self.cache.popitem(last=False)
        return tuple(lora.lora_int_id for (_, lora), has_failed in zip(loads, failed) if has_failed)

    def _fill(self, slot: int, lora: LoRARequest) -> AdapterShard | None:
        """This rank's shard of the adapter, copied into the slot; None if it could not be read."""
        try:
            shard = self.cache.get(lora.lora_int_id)
            if shard is None:
                shard = self._read(lora)
            self._set(slot, shard)
            return shard
        except READ_ERRORS as error:
            # (the log may name the file; what reaches a client never does)
            logger.warning("LoRA adapter %r could not be read on this rank (%s: %s); its requests fail",
                           lora.lora_name, type(error).__name__, error)
            return None

    def _set(self, slot: int, shard: AdapterShard) -> None:
        for name, weights in self.slots.items():
            num_parts = len(weights.parts)
            a_parts, b_parts = shard.get(name, ([None] * num_parts, [None] * num_parts))
            weights.set_slot(slot, a_parts, b_parts)

    def _read(self, lora: LoRARequest) -> AdapterShard:
        """This rank's shard of the adapter, its scaling folded into B. The engine checked the adapter
        against the model before any request used it (planner.lora.adapter_problem); read_adapter reads
        its files again here, whole, and refuses them if they changed since."""
        spec = read_adapter(lora.lora_name, lora.lora_path)
        shard: AdapterShard = {}
        for tensor_name, tensor in iterate_file(os.path.join(lora.lora_path, WEIGHTS_FILE)):
            adapted = adapted_module(tensor_name)
            if adapted is None:  # read_adapter refused any other tensor: the file changed since
                raise ValueError("a tensor that is not a LoRA A or B")
            module, which = adapted
            target = self.model.checkpoint_target(module + ".weight")  # type: ignore[operator]  # every family's
            layer_name = target.param_name.rpartition(".")[0]
            if layer_name not in self.slots:
                continue  # a layer of another pipeline stage
            layer = cast(LinearBase, self.model.get_submodule(layer_name))
            parts = LORA_LAYERS[layer_name.rpartition(".")[2]]
            index = parts.index(module.rpartition(".")[2])
            a_parts, b_parts = shard.setdefault(layer_name, ([None] * len(parts), [None] * len(parts)))
            if which == "A":
                a_parts[index] = tensor.narrow(1, *layer.input_columns()).load().to(self.dtype)
            else:
                rows = tensor.narrow(0, *layer.part_rows(index)).load()
                b_parts[index] = (rows.float() * spec.scaling).to(self.dtype)
        return shard


def step_lora_batch(batch: list[RequestState], host: HostInputs, num_slots: int,
                    device: torch.device) -> LoRABatch | None:
    """Each token's slot for this step (its request's; -1 for the base model), sorted for the kernels;
    None when no request has an adapter (nothing to copy to the device, no layer adds anything)."""
    slots = np.fromiter((state.lora_slot for state in batch), np.int64, len(batch))
    if (slots < 0).all():
        return None
    return lora_batch(np.repeat(slots, np.diff(host.query_start_loc)), num_slots, device)
