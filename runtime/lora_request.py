"""An adapter a request is served with (vLLM's LoRARequest)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardserve.planner.lora import AdapterError, adapter_problem, read_adapter
from shardserve.planner.model_spec import ModelSpec

if TYPE_CHECKING:
    from shardserve.runtime.config import EngineConfig


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """lora_int_id names one loaded version of an adapter: engines and ranks cache its weights by it, and
    the prefix cache keeps its blocks apart from the base model's and other adapters'. A name loaded again
    from another path needs a new id."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive int, "
                             f"got {self.lora_int_id!r}")

    @property
    def hash_seed(self) -> bytes:
        """The parent of a prompt's first block hash under this adapter (the base model's is none)."""
        return hashlib.blake2b(b"lora:%d" % self.lora_int_id, digest_size=16).digest()


class AdapterChecks:
    """An engine's check of each adapter a request brings, once per lora_int_id: enable_lora is on, and the
    adapter's rank, modules and shapes fit the model and the slots (the planner's rule, as the server's)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._checked: dict[int, LoRARequest] = {}

    def check(self, lora: LoRARequest | None) -> None:
        if lora is None or self._checked.get(lora.lora_int_id) == lora:
            return
        if self.config.lora is None:
            raise AdapterError(f"LoRA adapter {lora.lora_name!r} asked for, but this engine serves none: "
                               "start it with enable_lora=True (--enable-lora)")
        problem = adapter_problem(read_adapter(lora.lora_name, lora.lora_path), self._spec,
                                  self.config.lora.max_lora_rank)
        if problem:
            raise AdapterError(problem)
        self._checked[lora.lora_int_id] = lora

    def forget(self, lora: LoRARequest) -> None:
        """A rank could not read the adapter after it was checked (its files changed or vanished): the next
        request that names it is checked again, its files read whole."""
        self._checked.pop(lora.lora_int_id, None)

    @functools.cached_property
    def _spec(self) -> ModelSpec:
        """The planner's spec of the loaded model, made for the first adapter checked."""
        model = self.config.model
        return ModelSpec.from_config(model.architecture, model.hf_config.to_dict())
