"""Measured operator latencies for a GPU: grids read from planner/perfdata or a calibration file.

A table is a dense grid of milliseconds over named integer axes (GEMM over m, n, k; attention over
heads, batch and lengths). A lookup interpolates between the measured points on log axes and
log latency; past the last point it scales by that axis's work exponent (a GEMM twice as long
in m takes twice the time), before the first it keeps the first point's time (launch floors).
Where a GPU has no data the planner falls back to a roofline (planner/operators.py) whose
efficiencies were fitted to the measured GPUs (perfdata/roofline_fit.json).
"""

from __future__ import annotations

import bisect
import functools
import gzip
import itertools
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from shardserve.planner.calibration import calibration_path, read_calibration

PERFDATA = Path(__file__).resolve().parent / "perfdata"
# Work exponent of each axis past its last measured point: latency ~ value ** exponent.
WORK_EXPONENT = {"m": 1, "n": 1, "k": 1, "head_dim": 1, "num_heads": 1, "num_kv_heads": 1,
                 "batch": 1, "isl": 2, "context": 1, "bytes": 1, "num_gpus": 0, "tp": 0, "ep": 0,
                 "num_tokens": 1}


@dataclass(frozen=True)
class Table:
    names: tuple[str, ...]
    axes: tuple[tuple[int, ...], ...]
    ms: tuple[float | None, ...]  # C order over axes

    @staticmethod
    def from_dict(data: dict) -> "Table":
        names = tuple(a[0] for a in data["axes"])
        axes = tuple(tuple(a[1]) for a in data["axes"])
        return Table(names, axes, tuple(data["ms"]))

    @staticmethod
    def from_cells(names: tuple[str, ...], axes: tuple[tuple[int, ...], ...],
                   cells: dict[tuple[int, ...], float | None]) -> "Table":
        """Measured cells (coordinates -> ms) laid out in C order; None where a cell was not measured."""
        return Table(names, axes, tuple(cells.get(c) for c in itertools.product(*axes)))

    def to_dict(self) -> dict:
        """The file form: {"axes": [[name, values], ...], "ms": [...]} (4 significant digits)."""
        return {"axes": [[n, list(v)] for n, v in zip(self.names, self.axes)],
                "ms": [None if v is None else float(f"{v:.4g}") for v in self.ms]}

    def _value(self, index: tuple[int, ...]) -> float | None:
        flat = 0
        for i, axis in zip(index, self.axes):
            flat = flat * len(axis) + i
        return self.ms[flat]

    def lookup(self, **coords: float) -> float | None:
        """Milliseconds at `coords` (one value per axis), or None where no neighbour was measured."""
        brackets: list[tuple[tuple[int, float], ...]] = []  # per axis: (index, weight) of each neighbour
        scale = 1.0
        for name, axis in zip(self.names, self.axes):
            x = float(coords[name])
            if x >= axis[-1]:
                scale *= (x / axis[-1]) ** WORK_EXPONENT[name]
                brackets.append(((len(axis) - 1, 1.0),))
            elif x <= axis[0]:
                brackets.append(((0, 1.0),))
            else:
                hi = bisect.bisect_right(axis, x)
                w = math.log(x / axis[hi - 1]) / math.log(axis[hi] / axis[hi - 1])
                brackets.append(((hi - 1, 1.0 - w), (hi, w)))
        total, weight = 0.0, 0.0
        for corner in _corners(brackets):
            value = self._value(tuple(i for i, _ in corner))
            w = math.prod(wi for _, wi in corner)
            if value is None or value <= 0 or w == 0:
                continue
            total += w * math.log(value)
            weight += w
        if weight < 0.5:  # most of the neighbourhood unmeasured: no answer rather than a guess
            return None
        return math.exp(total / weight) * scale


def _corners(brackets: list[tuple]) -> list[tuple]:
    out: list[tuple] = [()]
    for options in brackets:
        out = [c + (o,) for c in out for o in options]
    return out


@dataclass(frozen=True)
class HostModel:
    """Host time the device does not hide: per engine step (step_ms + per_request_ms * requests),
    per request on its way through the server (HTTP, tokenizer, engine hops: request_ms), and per
    decoder layer of a step run eagerly (eager_layer_ms: on a GPU the host's time to issue the
    layer's kernels, which the device waits for when it is the longer; on a CPU, where one thread
    dispatches and computes, what a layer costs beyond its GEMMs and attention)."""
    step_ms: float
    per_request_ms: float
    request_ms: float
    eager_layer_ms: float
    # the API process's own CPU time per request and per streamed token: one process serves every replica, so
    # 1000 / (api_request_ms + output_len x api_token_ms) requests/s bound the deployment (planner/speed.py)
    api_request_ms: float = 0.0
    api_token_ms: float = 0.0

    def ms(self, num_requests: int) -> float:
        return self.step_ms + self.per_request_ms * num_requests

    @property
    def api_ms(self) -> tuple[float, float]:
        return self.api_request_ms, self.api_token_ms


# NOTE: vLLM 0.11 and SGLang 0.5 at batch 1-4 on an H100 run 0.4-0.8 ms per step above their kernels,
# and answer the first token 15-45 ms after the kernels could (GPUStack's published runs, in
# bench/published_results.yaml); `shardserve calibrate` measures this runtime's own step time.
# eager_layer_ms: an eager decode layer of this runtime launches about 35 kernels (bench/NOTES.md); measured
# on an H200's host (torch 2.11, Triton 3.6; bench/RESULTS.md, 2026-11-28): the Llama-3.1-8B shape decoded
# 44.6 tok/s eagerly at batch 1, 22.42 ms a step, of which 0.50 is the step's own host time: 21.92 ms over
# 32 layers. `shardserve calibrate` measures it on the GPU's own host.
# api_request_ms, api_token_ms: this runtime's API process, measured by `calibrate` (launch/request_timing.py) on
# a 2-core EPYC VM, three runs of 96 streamed requests of 32 prompt tokens, 2 and 34 output tokens each: 1.03 /
# 1.10 / 1.33 ms a request and 59 / 75 / 65 us a streamed token (the medians here). `calibrate` measures them on
# the deployment's own host.
DEFAULT_HOST = HostModel(step_ms=0.5, per_request_ms=0.002, request_ms=15.0, eager_layer_ms=0.685,
                         api_request_ms=1.1, api_token_ms=0.065)


@dataclass(frozen=True)
class Database:
    gpu: str
    sources: tuple[str, ...]  # where each table came from, for the plan's note
    tables: dict[str, Table] = field(default_factory=dict)
    host: HostModel = DEFAULT_HOST

    @property
    def is_measured(self) -> bool:
        return bool(self.tables)

    def lookup(self, table: str, **coords: float) -> float | None:
        t = self.tables.get(table)
        return None if t is None else t.lookup(**coords)


@functools.lru_cache(maxsize=None)
def roofline_fit() -> dict:
    return json.loads((PERFDATA / "roofline_fit.json").read_text())


def _shipped(gpu: str) -> dict | None:
    path = PERFDATA / f"{gpu.lower()}.json.gz"
    if not path.exists():
        return None
    with gzip.open(path, "rt") as f:
        return json.load(f)


def load_database(gpu: str) -> Database:
    """This GPU's tables: a calibration of this runtime first, then the shipped measurements."""
    return _load(gpu, _calibration_key(gpu))


def _calibration_key(gpu: str) -> tuple[str, float] | None:
    path = calibration_path(gpu)
    return (str(path), path.stat().st_mtime) if path.exists() else None


@functools.lru_cache(maxsize=32)
def _load(gpu: str, calibration: tuple[str, float] | None) -> Database:
    tables: dict[str, Table] = {}
    sources, host = [], DEFAULT_HOST
    shipped = _shipped(gpu)
    if shipped:
        tables.update({k: Table.from_dict(v) for k, v in shipped["tables"].items()})
        sources.append(shipped["source"])
    if calibration:
        data = read_calibration(Path(calibration[0]))
        tables.update({k: Table.from_dict(v) for k, v in data["tables"].items()})
        if data.get("host"):
            measured = data["host"]
            host = HostModel(*(float(measured.get(f.name, getattr(DEFAULT_HOST, f.name)))
                               for f in fields(HostModel)))
        sources.insert(0, data["source"])
    return Database(gpu, tuple(sources), tables, host)
