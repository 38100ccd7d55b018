"""The adapters a server serves by name (--lora-modules, and /v1/load_lora_adapter with
--enable-runtime-lora-updating): a request's `model` names the base model or one of them.

Each adapter is checked against the model once, when it is added (planner.lora: its rank, modules and
shapes, its weights read whole), so a bad one is a launch error or a 400; one whose files change or vanish after
that fails only the requests that use it (the engine's ranks say so when they load it). A name loaded
again gets a new lora_int_id: replicas cache adapters by id, and the old weights are never mixed in."""

from __future__ import annotations

import itertools

from shardserve.launch.server.api_error import APIError
from shardserve.planner.errors import PlanError
from shardserve.planner.lora import AdapterError, adapter_problem, read_adapter
from shardserve.planner.model_spec import ModelSpec
from shardserve.runtime.lora_request import LoRARequest


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules name=path ... -> [(name, path)], refusing anything else by its text."""
    pairs = []
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise PlanError(f"--lora-modules {value!r}: give each adapter as name=path (a PEFT adapter folder)")
        pairs.append((name.strip(), path.strip()))
    return pairs


def registry_from_settings(base_name: str, spec: ModelSpec, enable_lora: bool, max_lora_rank: int,
                           lora_modules: list[str] | None, runtime_updating: bool) -> LoRARegistry:
    """The server's adapters at start-up, each checked before anything loads (a PlanError says why not)."""
    if runtime_updating and not enable_lora:
        raise PlanError("--enable-runtime-lora-updating loads adapters: it needs --enable-lora")
    registry = LoRARegistry(base_name, spec, enable_lora, max_lora_rank)
    for name, path in parse_lora_modules(lora_modules):
        registry.add(name, path)
    return registry


class LoRARegistry:
    def __init__(self, base_name: str, spec: ModelSpec | None, enable_lora: bool, max_lora_rank: int):
        self.base_name = base_name
        self.spec = spec
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter against the model and serve it under `name`; an AdapterError says why not."""
        if not self.enable_lora:
            raise AdapterError(f"LoRA adapter {name!r}: this server was started without --enable-lora")
        if name == self.base_name or name in self.adapters:
            raise AdapterError(f"LoRA adapter {name!r}: the name is already served; unload it first or pick another")
        assert self.spec is not None  # given with enable_lora
        problem = adapter_problem(read_adapter(name, path), self.spec, self.max_lora_rank)
        if problem:
            raise AdapterError(problem)
        self.adapters[name] = adapter = LoRARequest(name, next(self._ids), path)
        return adapter

    def remove(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"LoRA adapter {name!r} is not loaded", "lora_name", "not_found_error")

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model field names; None for the base model (or no name)."""
        if model is None or model == self.base_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            served = ", ".join(repr(n) for n in (self.base_name, *self.adapters))
            raise APIError(404, f"model {model!r} does not exist; this server serves {served}", "model",
                           "not_found_error")
        return adapter
