"""Deployment settings from profiles, plans and flags: one set of names, validated by pydantic."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardserve.planner import PlanError
from shardserve.planner.yaml_file import read_yaml


class DeployConfig(BaseModel):
    """Every key a profile may set. Names are vLLM's; all optional (a profile is partial)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: Optional[str] = None
    hardware: Optional[str] = None
    device: Optional[Literal["auto", "cuda", "cpu"]] = None
    tensor_parallel_size: Optional[int] = Field(None, ge=1)
    pipeline_parallel_size: Optional[int] = Field(None, ge=1)
    data_parallel_size: Optional[int] = Field(None, ge=1)
    distributed_executor_backend: Optional[Literal["mp", "ray"]] = None
    max_model_len: Optional[int] = Field(None, ge=1)
    dtype: Optional[str] = None  # auto, bfloat16/bf16, float16/fp16/half, float32/fp32
    kv_cache_dtype: Optional[Literal["auto", "fp8"]] = None
    gpu_memory_utilization: Optional[float] = Field(None, gt=0, le=1)
    kv_cache_memory_bytes: Optional[int] = Field(None, ge=1)
    block_size: Optional[Literal[1, 8, 16, 32, 64, 128]] = None
    max_num_seqs: Optional[int] = Field(None, ge=1)
    max_num_batched_tokens: Optional[int] = Field(None, ge=1)
    enable_prefix_caching: Optional[bool] = None
    enforce_eager: Optional[bool] = None  # true: no CUDA graphs for decode
    target_concurrency: Optional[int] = Field(None, ge=1)
    host: Optional[str] = None
    port: Optional[int] = Field(None, ge=0, le=65535)
    served_model_name: Optional[str] = None
    # requests in flight before the server answers 503 (SGLang's name); default 4 x
    # max_num_seqs per replica
    max_queued_requests: Optional[int] = Field(None, ge=1)
    # variables set for the engine and every rank, on every node (Ray included)
    env: Optional[dict[str, str]] = None
    description: Optional[str] = None

    def set_values(self) -> dict:
        return self.model_dump(exclude_none=True)


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


def validate(values: dict, source: str, lines: dict[str, int] | None = None) -> DeployConfig:
    try:
        return DeployConfig(**values)
    except ValidationError as e:
        problems = []
        for error in e.errors():
            field = ".".join(str(p) for p in error["loc"])
            where = f" (line {lines[field]})" if lines and field in lines else ""
            message = ("unknown key" if error["type"] == "extra_forbidden"
                       else error["msg"].lower())
            problems.append(f"{field}{where}: {message}")
        raise PlanError(f"{source}: " + "; ".join(problems)) from None


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
