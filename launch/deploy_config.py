"""Deployment settings from profiles, plans and flags: one set of names, validated by pydantic."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from shardserve.planner import PlanError
from shardserve.planner.settings import BY_NAME, SETTINGS, Setting
from shardserve.planner.yaml_file import read_yaml


class _DeployConfigBase(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    if TYPE_CHECKING:  # the fields come from the settings table at import (below), unseen by checkers
        def __getattr__(self, name: str) -> Any: ...

    def set_values(self) -> dict:
        return self.model_dump(exclude_none=True)


_PYDANTIC_TYPES: dict[type, Any] = {tuple: list[int], list: list[str], dict: dict[str, str]}  # the table's kinds


def _pydantic_field(setting: Setting) -> tuple:
    """A setting as an optional pydantic field (a profile is partial) with the table's checks."""
    kind: Any = _PYDANTIC_TYPES.get(setting.type, setting.type)
    if setting.choices is not None:
        kind = Literal[setting.choices]
    bounds: dict[str, Any] = {"ge": setting.minimum, "le": setting.maximum, "gt": setting.above}
    bounds = {k: v for k, v in bounds.items() if v is not None}
    if setting.words or setting.human_readable or setting.fixed:  # 32k, auto, a fixed flag: the table reads it
        inner = Union[kind, Literal[setting.words]] if setting.words else kind
        return Optional[Annotated[inner, BeforeValidator(setting.check)]], Field(None, description=setting.help)
    return Optional[kind], Field(None, description=setting.help, **bounds)


# Every key a profile, a plan or a flag may set: the settings table's, all optional.
_FIELDS: dict[str, Any] = {s.name: _pydantic_field(s) for s in SETTINGS if s.in_profile}
if TYPE_CHECKING:
    DeployConfig = _DeployConfigBase
else:
    DeployConfig = create_model("DeployConfig", __base__=_DeployConfigBase, **_FIELDS)


def merge(*layers: dict) -> dict:
    """Later layers win: profile < plan < flags."""
    out: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if value is not None:  # env: a layer adds variables rather than replacing them all
                out[key] = {**out[key], **value} if key == "env" and key in out else value
    return out


def parse_env(items: list[str]) -> dict[str, str]:
    """`--env NAME=VALUE` pairs."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise PlanError(f"--env {item!r}: write NAME=VALUE, such as --env NCCL_IB_HCA=mlx5")
        out[name.strip()] = value
    return out


def validate(values: dict, source: str, lines: dict[str, int] | None = None, flags: dict | None = None) -> DeployConfig:
    """The settings as one record; a PlanError names each bad one as its source gave it: a flag as typed
    (--input-len) where `flags` (the command line's values) holds it, else the key (with its line)."""
    try:
        return DeployConfig(**values)
    except ValidationError as e:
        problems = []
        for error in e.errors():
            field = ".".join(str(p) for p in error["loc"])
            if flags and flags.get(field) is not None and field in BY_NAME:
                field = BY_NAME[field].flag
            where = f" (line {lines[field]})" if lines and field in lines else ""
            message = ("unknown key" if error["type"] == "extra_forbidden"
                       else str(error["ctx"]["error"]) if error["type"] == "value_error"
                       else error["msg"].lower())
            problems.append(f"{field}{where}: {message}")
        raise PlanError((f"{source}: " if source else "") + "; ".join(problems)) from None


def load_yaml_config(path: Path) -> DeployConfig:
    """A profile file: a flat mapping of DeployConfig keys. Errors name the key and its line."""
    values, text = read_yaml(path, "profile")
    node = yaml.compose(text)
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise PlanError(f"{path}: a profile is a mapping of settings, such as "
                        "'tensor_parallel_size: 2'")
    lines = {str(k.value): k.start_mark.line + 1 for k, _ in node.value} if node else {}
    return validate(values, str(path), lines)


def parse_set(items: list[str]) -> dict:
    """`--set key=value` pairs, values read as YAML scalars (2 -> int, true -> bool)."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise PlanError(f"--set {item!r}: write key=value, such as --set max_num_seqs=64")
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    return out
