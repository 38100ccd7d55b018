"""`shardserve calibrate`: time this runtime's operators here and write the file `plan` reads for this GPU.

What is timed (runtime/timing/op_timing.py, runtime/timing/allreduce_timing.py, runtime/timing/host_timing.py):
GEMMs through the runtime's linear layers (fp8 too where they run an fp8 GEMM), prefill and decode
attention through its attention backend (Triton on CUDA, torch on CPU; fp8 KV caches too on CUDA),
the tensor-parallel all-reduce over 2..N local ranks, the host's time per engine step and per eager
decoder layer, a request's way through the server and its API process's CPU time (launch/request_timing.py)."""

from __future__ import annotations

import datetime
import functools
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table as RichTable

from shardserve.launch import __version__
from shardserve.planner import PlanError
from shardserve.planner.calibration import calibration_path, write_calibration

if TYPE_CHECKING:  # op_timing imports torch: read only when timing
    from shardserve.runtime.timing.op_timing import Grid

POWERS_OF_TWO = tuple(2 ** i for i in range(16))


@dataclass(frozen=True)
class Sizes:
    """The grids of one --sizes choice: axis name -> values, per table."""

    gemm: dict[str, tuple[int, ...]]
    prefill: dict[str, tuple[int, ...]]
    decode: dict[str, tuple[int, ...]]
    allreduce_bytes: tuple[int, ...]
    host_batches: tuple[int, ...]
    host_steps: int


# NOTE: the full grids are about 3,800 cells on an H100 (gemm twice, attention for bf16 and fp8 KV);
# each cell's setup (weights, a KV pool, a CUDA graph capture) costs more than its timing: estimated
# at 4 to 5 minutes in all, not yet measured on a GPU.
FULL = Sizes(
    gemm={"m": POWERS_OF_TWO[:15], "n": (512, 1024, 2048, 4096, 5120, 8192, 14336, 16384),
          "k": (512, 1024, 2048, 4096, 5120, 8192, 14336, 16384)},
    prefill={"head_dim": (64, 128), "num_heads": (4, 8, 16, 32, 64), "batch": (1, 2, 4, 8),
             "isl": (128, 256, 512, 1024, 2048, 4096, 8192)},
    decode={"head_dim": (64, 128), "num_kv_heads": (1, 2, 4, 8), "batch": POWERS_OF_TWO[:9],
            "context": POWERS_OF_TWO[7:]},
    allreduce_bytes=tuple(2 ** i for i in range(10, 29)), host_batches=(1, 16, 64, 256), host_steps=32)
SMALL = Sizes(  # seconds on a CPU: the suite runs it
    gemm={"m": (1, 8, 64, 256), "n": (128, 512), "k": (128, 512)},
    prefill={"head_dim": (64,), "num_heads": (4, 8), "batch": (1, 2), "isl": (32, 128)},
    decode={"head_dim": (64,), "num_kv_heads": (1, 2), "batch": (1, 8, 32), "context": (128, 1024)},
    allreduce_bytes=(1024, 65536, 1 << 20), host_batches=(1, 8, 32), host_steps=8)
DTYPE_NAMES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Setup:
    """The command's options, settled: device, dtype and sizes chosen, the file to write."""

    device: str  # cpu | cuda
    dtype: str  # bfloat16 | float16 | float32
    sizes_name: str  # small | full
    tensor_parallel_size: int
    gpu: str  # the catalog's name, or "CPU"
    device_name: str
    output: Path

    @property
    def sizes(self) -> Sizes:
        return FULL if self.sizes_name == "full" else SMALL


def settle(device: str, dtype: str | None, sizes: str | None, output: Path | None,
           tensor_parallel_size: int | None) -> Setup:
    for flag, value, choices in (("--device", device, ("auto", "cpu", "cuda")), ("--dtype", dtype, DTYPE_NAMES),
                                 ("--sizes", sizes, ("small", "full"))):
        if value is not None and value not in choices:
            raise PlanError(f"{flag} {value}: one of {', '.join(choices)}")
    import torch

    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise PlanError("--device cuda: torch sees no CUDA device here (use --device cpu)")
    device = ("cuda" if has_cuda else "cpu") if device == "auto" else device
    num_gpus = torch.cuda.device_count() if device == "cuda" else 0
    tp = tensor_parallel_size or (min(8, num_gpus) if device == "cuda" else 1)
    if device == "cuda" and tp > num_gpus:
        raise PlanError(f"--tensor-parallel-size {tp}: this machine has {num_gpus} visible GPU(s)")
    gpu, name = gpu_name(device)
    if gpu is None and output is None:
        raise PlanError(f"{name} is not in the planner's GPU catalog (planner/catalog/gpus.yaml), so no plan "
                        "would read its calibration: add it there, or pass --output to keep the file anyway")
    gpu = gpu or name
    return Setup(device, dtype or ("bfloat16" if device == "cuda" else "float32"),
                 sizes or ("full" if device == "cuda" else "small"), tp, gpu, name,
                 output or calibration_path(gpu))


def gpu_name(device: str) -> tuple[str | None, str]:
    """(the planner catalog's name for this device, "CPU", or None when the catalog lacks it; the
    device's own name)."""
    if device == "cpu":
        return "CPU", _cpu_name()
    import torch

    from shardserve.planner.catalog import find_gpu
    name = torch.cuda.get_device_name()
    found = find_gpu(name)
    return (found[0] if found else None), name


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def source_line(setup: Setup) -> str:
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return (f"shardserve calibrate {__version__} on {setup.device_name} (torch {torch.__version__}, "
            f"triton {triton_version}) {now}")


@dataclass(frozen=True)
class Part:
    """One thing measured, for the summary."""

    name: str
    num_cells: int
    num_measured: int
    low_ms: float | None
    high_ms: float | None
    seconds: float


def measure_tables(setup: Setup, say: Callable[[str], None]) -> tuple[dict, list[Part]]:
    """Every operator table for this setup: {table name: {"axes", "ms"}}, and what each took."""
    tables, parts = {}, []
    for name, grid, job in _jobs(setup):
        say(f"timing {name}: {grid.size} cells over {', '.join(grid.names)}")
        start = time.monotonic()
        table = job(grid)
        tables[name] = table.to_dict()
        parts.append(_part(name, table.ms, time.monotonic() - start))
    return tables, parts


def _jobs(setup: Setup) -> list[tuple[str, Grid, Callable]]:
    """(table name, grid, job(grid) -> perf_tables.Table) for each operator table."""
    import torch

    from shardserve.runtime.timing import op_timing as ops
    from shardserve.runtime.worker.worker import select_attention_backend

    device, dtype, sizes = torch.device(setup.device), getattr(torch, setup.dtype), setup.sizes
    timer = ops.Timer(device)
    gemm, grid = functools.partial(ops.gemm_table, dtype=dtype, timer=timer), ops.Grid.of(**sizes.gemm)
    jobs: list[tuple[str, Grid, Callable]] = [(f"gemm.{setup.dtype}", grid, gemm)]
    if ops.has_fp8_gemm(device, dtype):
        jobs.append(("gemm.fp8", grid, functools.partial(gemm, is_fp8=True)))
    attention = functools.partial(ops.attention_table, dtype=dtype, backend=select_attention_backend(device),
                                  timer=timer)
    kv_dtypes = [(setup.dtype, dtype)] + ([("fp8", torch.float8_e4m3fn)] if device.type == "cuda" else [])
    for kv_name, kv_dtype in kv_dtypes:
        jobs.append((f"prefill_attention.{kv_name}", ops.Grid.of(**sizes.prefill), functools.partial(
            attention, shape_of=ops.prefill_shape, kv_dtype=kv_dtype, use_graph=False)))
        jobs.append((f"decode_attention.{kv_name}", ops.Grid.of(**sizes.decode), functools.partial(
            attention, shape_of=ops.decode_shape, kv_dtype=kv_dtype, use_graph=True)))
    return jobs


def _part(name: str, ms, seconds: float) -> Part:
    measured = [v for v in ms if v is not None]
    return Part(name, len(ms), len(measured), min(measured, default=None), max(measured, default=None), seconds)


def measure_allreduce(setup: Setup, say: Callable[[str], None]) -> tuple[dict, Part]:
    """The all-reduce table over num_gpus 2, 4, 8 (and tensor_parallel_size) up to tensor_parallel_size."""
    import torch

    from shardserve.runtime.timing.allreduce_timing import time_allreduce

    counts = sorted({g for g in (2, 4, 8) if g <= setup.tensor_parallel_size} | {setup.tensor_parallel_size})
    sizes = list(setup.sizes.allreduce_bytes)
    start, ms = time.monotonic(), []
    for num_gpus in counts:
        say(f"timing allreduce over {num_gpus} ranks: {len(sizes)} sizes")
        times = time_allreduce(num_gpus, sizes, torch.device(setup.device), getattr(torch, setup.dtype))
        ms += [times.get(size) for size in sizes]
    table = {"axes": [["num_gpus", counts], ["bytes", sizes]],
             "ms": [None if v is None else float(f"{v:.4g}") for v in ms]}
    return table, _part("allreduce", ms, time.monotonic() - start)


def calibrate(setup: Setup, console: Console) -> Path:
    """Measure everything, write the calibration file, print a summary; the file's path."""
    from shardserve.launch.request_timing import measure_server
    from shardserve.runtime.timing.host_timing import measure_host

    say = lambda text: console.print(text, highlight=False)  # noqa: E731
    console.print(f"calibrating {setup.device_name} ({setup.gpu}) in {setup.dtype}, {setup.sizes_name} sizes")
    started = time.monotonic()
    tables, parts = measure_tables(setup, say)
    if setup.tensor_parallel_size > 1:
        tables["allreduce"], part = measure_allreduce(setup, say)
        parts.append(part)
    say(f"timing the host's step: batches {', '.join(map(str, setup.sizes.host_batches))}")
    start = time.monotonic()
    host = measure_host(setup.sizes.host_batches, setup.sizes.host_steps)
    say("timing an eager decoder layer")
    eager_layer_ms = measure_eager(setup)
    say("timing a request's way through the server and its API process (a `shardserve launch` of a micro model)")
    server = measure_server(setup.device)
    host_seconds = time.monotonic() - start
    data = {"gpu": setup.gpu, "source": source_line(setup), "tables": tables,
            "host": {**host.to_dict(), "eager_layer_ms": eager_layer_ms, **asdict(server)}}
    path = write_calibration(data, setup.output)
    print_summary(console, parts, host, host_seconds)
    console.print(f"eager decoder layer: {eager_layer_ms} ms "
                  + ("beyond its GEMMs and attention (a CPU computes as it dispatches)" if setup.device == "cpu"
                     else "to issue (steps without CUDA graphs: --enforce-eager, LoRA)"), highlight=False)
    console.print(f"request: {server.request_ms} ms of TTFT outside the engine's steps (HTTP, the prompt's way in, "
                  f"the first token's way out); the API process: {server.api_request_ms} ms of CPU a request and "
                  f"{server.api_token_ms} ms a streamed token", highlight=False)
    console.print(f"calibration of {setup.gpu} written to [bold]{path}[/] in {time.monotonic() - started:.0f} s"
                  + (f"; `shardserve plan` reads it for {setup.gpu} from now on"
                     if path == calibration_path(setup.gpu) else ""), highlight=False)
    return path


def measure_eager(setup: Setup) -> float:
    """Milliseconds an eager decode step spends per decoder layer beyond what the tables time: on a
    GPU the host's time to issue the layer (the device idles when it is the longer), on a CPU the
    layer's time less its GEMMs and attention (measured again here at the micro model's shapes)."""
    import torch

    from shardserve.runtime.timing import op_timing as ops
    from shardserve.runtime.timing.host_timing import measure_eager_layer
    from shardserve.runtime.worker.worker import select_attention_backend

    steps, prompt_len = setup.sizes.host_steps, 32
    layer = measure_eager_layer(setup.device, steps, prompt_len)
    if setup.device == "cpu":
        device = torch.device("cpu")
        layer -= ops.micro_layer_ops_ms(device, torch.float32, select_attention_backend(device),
                                        prompt_len + steps // 2, ops.Timer(device))
    return round(max(0.0, layer), 4)


def print_summary(console: Console, parts: list[Part], host, host_seconds: float) -> None:
    table = RichTable("table", "cells", "min ms", "max ms", "seconds")
    table.columns[0].no_wrap = True
    for p in parts:
        table.add_row(p.name, f"{p.num_measured}/{p.num_cells}", _ms(p.low_ms), _ms(p.high_ms), f"{p.seconds:.1f}")
    console.print(table)
    fit, points = host.to_dict(), ", ".join(f"{ms:.3g}" for _, ms in host.points)
    console.print(f"host step: {fit['step_ms']} ms + {fit['per_request_ms']} ms x requests (measured {points} ms "
                  f"at batches {', '.join(str(b) for b, _ in host.points)}; {host_seconds:.1f} s)", highlight=False)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
