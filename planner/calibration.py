"""Where `shardserve calibrate` keeps its measurements of this runtime, and reading and writing them.

A calibration file has the shape of planner/perfdata/*.json.gz (one per GPU):

    {"gpu": "H100-80GB", "source": "shardserve calibrate 0.1.0 on ... 2025-01-01T12:00:00",
     "tables": {"gemm.bfloat16": {"axes": [["m", [1, 2, ...]], ["n", [...]], ["k", [...]]],
                                  "ms": [C-order over the axes, milliseconds, null where not measured]},
                "prefill_attention.<kv dtype>", "decode_attention.<kv dtype>", "allreduce": ...},
     "host": {"step_ms": a, "per_request_ms": b,        # host time per engine step = a + b * requests
              "eager_layer_ms": c,                       # per decoder layer of a step without CUDA graphs
              "request_ms": d,                           # a request's TTFT outside the engine's steps
              "api_request_ms": e, "api_token_ms": f}}  # the API process's CPU a request, a streamed token
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import tempfile
from pathlib import Path

from shardserve.planner.errors import PlanError

# table kind -> its axes, in order
TABLE_AXES = {
    "gemm": ("m", "n", "k"),
    "prefill_attention": ("head_dim", "num_heads", "batch", "isl"),
    "decode_attention": ("head_dim", "num_kv_heads", "batch", "context"),
    "allreduce": ("num_gpus", "bytes"),
    "moe": ("tp", "ep", "num_tokens"),  # moe.<dtype>@<hidden>x<inter>x<topk>x<experts>: the fused MoE layer
}
DTYPES = ("bfloat16", "float16", "float32", "fp8")  # gemm: the weight's; attention: the KV cache's


class CalibrationError(PlanError):
    """A calibration file that is not in the format above; the message names the key."""


def calibration_dir() -> Path:
    """$XDG_CACHE_HOME/shardserve/calibration (XDG_CACHE_HOME defaults to ~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "shardserve" / "calibration"


def calibration_path(gpu_name: str) -> Path:
    """The calibration file `plan` reads for this GPU (the catalog's name, or "CPU")."""
    return calibration_dir() / f"{gpu_name.lower()}.json"


def read_calibration(path: Path | str) -> dict:
    """The file's contents, checked; a CalibrationError names the file and the key otherwise."""
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            data = json.load(f)
    except OSError as e:
        raise CalibrationError(f"{path}: cannot read the calibration file ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError) as e:
        raise CalibrationError(f"{path}: not JSON ({e}); run `shardserve calibrate` again") from None
    check_calibration(data, str(path))
    return data


def write_calibration(data: dict, path: Path | str) -> Path:
    """Check `data`, then write it at once (a temporary file renamed over `path`)."""
    path = Path(path)
    check_calibration(data, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_calibration(data: object, source: str) -> None:
    if not isinstance(data, dict):
        raise CalibrationError(f"{source}: expected a mapping with gpu, source, tables, got {type(data).__name__}")
    for key in ("gpu", "source"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise CalibrationError(f"{source}: {key}: expected a non-empty string, got {data.get(key)!r}")
    unknown = sorted(set(data) - {"gpu", "source", "tables", "host"})
    if unknown:
        raise CalibrationError(f"{source}: {unknown[0]}: unknown key (a calibration has gpu, source, tables, host)")
    tables = data.get("tables")
    if not isinstance(tables, dict) or not tables:
        raise CalibrationError(f"{source}: tables: expected a mapping of table name to table, got {tables!r}")
    for name, table in tables.items():
        _check_table(name, table, source)
    if "host" in data:
        _check_host(data["host"], source)


def _check_table(name: object, table: object, source: str) -> None:
    kind, _, dtype = str(name).partition(".")
    dtype, _, moe_shape = dtype.partition("@")
    if (kind == "moe") != bool(moe_shape) or (moe_shape and not re.fullmatch(r"\d+x\d+x\d+x\d+", moe_shape)):
        kind = ""  # a MoE table names its shape, and only a MoE table does
    if kind not in TABLE_AXES or (kind == "allreduce") != (dtype == "") or (dtype and dtype not in DTYPES):
        raise CalibrationError(f"{source}: tables.{name}: unknown table (names: gemm.<dtype>, "
                               f"prefill_attention.<dtype>, decode_attention.<dtype>, allreduce, "
                               f"moe.<dtype>@<hidden>x<inter>x<topk>x<experts>; "
                               f"dtypes: {', '.join(DTYPES)})")
    key = f"tables.{name}"
    if not isinstance(table, dict) or set(table) != {"axes", "ms"}:
        raise CalibrationError(f"{source}: {key}: expected a mapping with axes and ms, got {_short(table)}")
    axes = table["axes"]
    if not isinstance(axes, list) or [a[0] if isinstance(a, list) and a else None for a in axes] != \
            list(TABLE_AXES[kind]):
        raise CalibrationError(f"{source}: {key}.axes: expected [[name, values], ...] named "
                               f"{', '.join(TABLE_AXES[kind])} in that order, got {_short(axes)}")
    size = 1
    for axis_name, values in ((a[0], a[1] if len(a) == 2 else None) for a in axes):
        is_int = isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        if not is_int or not values or min(values) <= 0 or values != sorted(set(values)):
            raise CalibrationError(f"{source}: {key}.axes.{axis_name}: expected positive integers in ascending "
                                   f"order, got {_short(values)}")
        size *= len(values)
    ms = table["ms"]
    if not isinstance(ms, list) or len(ms) != size:
        found = len(ms) if isinstance(ms, list) else _short(ms)
        raise CalibrationError(f"{source}: {key}.ms: expected {size} values (the product of the axes' lengths), "
                               f"got {found}")
    for i, value in enumerate(ms):
        if value is not None and not _is_positive(value):
            raise CalibrationError(f"{source}: {key}.ms[{i}]: expected milliseconds > 0 or null, got {value!r}")


def _check_host(host: object, source: str) -> None:
    if not isinstance(host, dict) or not {"step_ms", "per_request_ms"} <= set(host) <= {
            "step_ms", "per_request_ms", "request_ms", "eager_layer_ms", "api_request_ms", "api_token_ms"}:
        raise CalibrationError(f"{source}: host: expected a mapping with step_ms and per_request_ms (and "
                               f"optionally request_ms, eager_layer_ms, api_request_ms and api_token_ms), got "
                               f"{_short(host)}")
    for key, value in host.items():
        if not _is_number(value) or value < 0:
            raise CalibrationError(f"{source}: host.{key}: expected milliseconds >= 0, got {value!r}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_positive(value: object) -> bool:
    return _is_number(value) and value > 0  # type: ignore[operator]


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
