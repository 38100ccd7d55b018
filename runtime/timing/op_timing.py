"""Times this runtime's own operators on one device: its linear layers' GEMMs and its attention backend.

Each cell of a grid is timed after a warm-up (Triton compiles, allocations settle) as the median of
a few repeats: CUDA events on a GPU, the wall clock on a CPU. On a GPU a repeat runs the operator
`calls` times back to back (enough to fill about a millisecond), so a few-microsecond kernel is not
lost in the gap between launches; GEMMs and decode attention replay a CUDA graph of those calls, as
the runtime's decode steps do, prefill attention runs eagerly, as the runtime's prefills do.
A GEMM reads its weight cold, as a model's step does (every layer's weights once, far more bytes than
any cache holds): each call takes the next of enough copies of the weight to outgrow the last-level
cache twice over (a GPU's L2, a CPU's L3). Timed on one weight, the cache would serve it: on the
2-core EPYC the decode GEMMs of a 4-layer, 256-wide model ran 3.5-4.7x faster hot than cold.
Attention likewise takes the next of several KV pools, as each layer of a model reads its own.
A cell that does not fit in the device's free memory is left unmeasured (None)."""

from __future__ import annotations

import functools
import itertools
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardserve.planner.perf_tables import Table
from shardserve.planner.settings import BY_NAME
from shardserve.runtime.attention.layer import Attention
from shardserve.runtime.worker.forward_context import ForwardContext, forward_context
from shardserve.runtime.worker.inputs import RequestState, prepare_inputs
from shardserve.runtime.layers.linear import ReplicatedLinear
from shardserve.runtime.layers.quantization.config import QuantConfig
from shardserve.runtime.layers.quantization.methods import quantized_layers
from shardserve.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TARGET_MS = 1.0  # a repeat on a GPU runs the operator about this long
MAX_CALLS = 32
MAX_COPIES = 1024  # of one weight, to read it cold
MAX_POOL_COPIES = 64  # of one KV pool: a pool this small (under 1/32 of the cache) is bound by launches, not bytes
DEFAULT_CACHE_BYTES = 32 << 20  # a CPU whose caches sysfs does not list
MEMORY_FRACTION = 0.8  # of the free device memory a cell may allocate
BLOCK_SIZE = BY_NAME["block_size"].default  # the KV pool's blocks, as the engine's default
_FAILURES: set[str] = set()


@dataclass(frozen=True)
class Grid:
    """Named integer axes; cells are visited in C order (the last axis fastest)."""

    names: tuple[str, ...]
    values: tuple[tuple[int, ...], ...]

    @staticmethod
    def of(**axes) -> Grid:
        return Grid(tuple(axes), tuple(tuple(sorted(set(v))) for v in axes.values()))

    def cells(self) -> Iterator[tuple[int, ...]]:
        return itertools.product(*self.values)

    @property
    def size(self) -> int:
        return int(np.prod([len(v) for v in self.values]))


@dataclass(frozen=True)
class Timer:
    device: torch.device
    repeats: int = 5

    def __call__(self, fn: Callable[[], object], use_graph: bool = False) -> float:
        """Milliseconds one fn() takes: the median of `repeats` after a warm-up."""
        fn()  # compiles, allocates
        if self.device.type != "cuda":
            fn()
            samples = []
            for _ in range(self.repeats):
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e3)
            return statistics.median(samples)
        calls = max(1, min(MAX_CALLS, int(TARGET_MS / max(_event_ms(fn), 1e-3))))
        calls = max(calls, getattr(fn, "cycle", 1))  # a graph of fewer calls would replay a few copies hot
        run = _repeat(fn, calls)
        if use_graph:
            run = _captured(run) or run
        run()
        return statistics.median(_event_ms(run) / calls for _ in range(self.repeats))


def _repeat(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(calls):
            fn()
    return run


def _event_ms(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _captured(run: Callable[[], None]) -> Callable[[], None] | None:
    """`run` as a CUDA graph's replay, or None where it cannot be captured (then it runs eagerly)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    return graph.replay


class Rotating:
    """Each call runs the next of `calls` (in turn, round and round): one operator on other copies of
    its operands, so none is in the cache when its turn comes again."""

    def __init__(self, calls: Sequence[Callable[[], object]]) -> None:
        self.calls, self.next = list(calls), 0

    @property
    def cycle(self) -> int:
        return len(self.calls)

    def __call__(self) -> object:
        call = self.calls[self.next]
        self.next = (self.next + 1) % len(self.calls)
        return call()


def last_level_cache_bytes(device: torch.device) -> int:
    """The largest cache between the device and its memory: a GPU's L2, a CPU's largest (its L3)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    sizes = [_cache_size(path.read_text()) for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
    return max(sizes, default=DEFAULT_CACHE_BYTES)


def _cache_size(text: str) -> int:
    """sysfs's '32768K' (or '1M', or bytes) in bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG") or 0) * scale


def cold_copies(num_bytes: int, cache_bytes: int, most: int = MAX_COPIES) -> int:
    """How many copies of an operand outgrow the cache twice over (at least 1, at most `most`)."""
    return max(1, min(most, -(-2 * cache_bytes // max(1, num_bytes))))


def fits(device: torch.device, num_bytes: int) -> bool:
    """Whether a cell's tensors fit in what the device has free (a CPU: always)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return num_bytes <= MEMORY_FRACTION * free


def has_fp8_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the runtime's fp8 linear layers run an fp8 GEMM here (layers/quantization/fp8.py:
    torch._scaled_mm on sm_90+ with bf16 activations); elsewhere they dequantize, a float GEMM."""
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)


def _linear(n: int, k: int, dtype: torch.dtype, device: torch.device, is_fp8: bool) -> ReplicatedLinear:
    """A [n, k] linear layer as the runtime builds it: float weights, or fp8 ones with a scale per
    output row (what --quantization fp8 makes of a float checkpoint)."""
    config = QuantConfig.from_dict(None, "fp8") if is_fp8 else None
    with torch.device(device), quantized_layers(config):
        layer = ReplicatedLinear(k, n, bias=False, dtype=dtype)
    layer.weight.data = torch.randn(n, k, dtype=dtype, device=device) * k ** -0.5
    if is_fp8:
        layer.quant_method.process_after_loading(layer)
    return layer


def gemm_table(grid: Grid, dtype: torch.dtype, timer: Timer, is_fp8: bool = False) -> Table:
    """grid: m, n, k; a cell is layer.matmul(x) for x [m, k] and a weight [n, k] (y = x W^T)."""
    ms_axis, n_axis, k_axis = grid.values
    cells: dict[tuple[int, ...], float | None] = {}
    cache = last_level_cache_bytes(timer.device)
    with torch.inference_mode():
        for n, k in itertools.product(n_axis, k_axis):  # one weight per (n, k), every m through it
            weight_bytes = n * k * (1 if is_fp8 else dtype.itemsize)
            copies = cold_copies(weight_bytes, cache)
            if not fits(timer.device, copies * weight_bytes + 2 * n * k * dtype.itemsize):
                continue
            layers = [_linear(n, k, dtype, timer.device, is_fp8) for _ in range(copies)]
            for m in ms_axis:
                if fits(timer.device, 2 * (m * k + m * n) * dtype.itemsize):
                    cells[(m, n, k)] = _time_or_none(timer, functools.partial(_matmul, layers, m, dtype), use_graph=True)
            del layers  # freed before the next weight is made
    return Table.from_cells(grid.names, grid.values, cells)


def _matmul(layers: list[ReplicatedLinear], m: int, dtype: torch.dtype) -> Rotating:
    """y = x W^T through each copy of the layer in turn, for activations x [m, k] in the model dtype."""
    x = torch.randn(m, layers[0].weight.shape[1], dtype=dtype, device=layers[0].weight.device)
    return Rotating([functools.partial(layer.matmul, x) for layer in layers])


def _time_or_none(timer: Timer, make: Callable[[], Callable[[], object]], use_graph: bool) -> float | None:
    """The time of the call make() builds; None where the device runs out of memory for it, or the
    operator fails at this shape (said once per message: one cell must not end a long run)."""
    try:
        return timer(make(), use_graph=use_graph)
    except torch.cuda.OutOfMemoryError:
        return None
    except RuntimeError as e:
        if str(e) not in _FAILURES:
            _FAILURES.add(str(e))
            logger.warning("left unmeasured: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
    finally:
        if timer.device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    requests: tuple[tuple[int, int], ...]  # (num_cached, num_new) per request

    @property
    def num_blocks(self) -> int:
        return sum(-(-(c + n) // BLOCK_SIZE) for c, n in self.requests) + 1

    def kv_bytes(self, kv_dtype: torch.dtype) -> int:
        return 2 * self.num_blocks * BLOCK_SIZE * self.num_kv_heads * self.head_dim * kv_dtype.itemsize


def attention_call(shape: AttentionShape, dtype: torch.dtype, kv_dtype: torch.dtype, backend,
                   device: torch.device, copies: int = 1) -> Callable[[], object]:
    """One attention layer's forward over a step of `shape`'s requests, as a model calls it: new
    K/V written into a KV pool of kv_dtype, then attention over each request's cached blocks
    (scattered over the pool, as a block manager hands them out). No rotary embedding. With
    copies > 1 each call takes the next of that many pools (a model's layers each have their own)."""
    free = np.random.default_rng(0).permutation(shape.num_blocks).tolist()
    states, scheduled = [], {}
    for i, (num_cached, num_new) in enumerate(shape.requests):
        total = num_cached + num_new
        blocks = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        states.append(RequestState(f"r{i}", [1] * total, total, SamplingParams(), 0, frozenset(),
                                   np.asarray(blocks, dtype=np.int32), num_cached))
        scheduled[f"r{i}"] = num_new
    meta = prepare_inputs(states, scheduled, BLOCK_SIZE, device).attn_metadata
    pools = [_random_cache((2, shape.num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim), kv_dtype, device)
             for _ in range(copies)]
    num_tokens = meta.query_start_loc_cpu[-1]
    q = torch.randn(num_tokens, shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    k = torch.randn(num_tokens, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    layer = Attention(shape.num_heads, shape.head_dim, shape.head_dim ** -0.5, shape.num_kv_heads).to(device)
    context = ForwardContext(meta, backend)

    def call(pool: torch.Tensor) -> torch.Tensor:
        layer.kv_cache = pool
        with forward_context(context):
            return layer(q, k, v)
    return Rotating([functools.partial(call, pool) for pool in pools])


def _random_cache(shape: tuple[int, ...], kv_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A KV pool of small values (an fp8 one from random bytes below the format's NaN and infinity)."""
    if kv_dtype.itemsize == 1:
        return torch.empty(shape, dtype=torch.uint8, device=device).random_(0, 0x70).view(kv_dtype)
    return torch.empty(shape, dtype=kv_dtype, device=device).uniform_(-1, 1)


def attention_table(grid: Grid, shape_of: Callable[..., AttentionShape], dtype: torch.dtype,
                    kv_dtype: torch.dtype, backend, timer: Timer, use_graph: bool) -> Table:
    """Each cell's AttentionShape comes from shape_of(**cell as axis name -> value)."""
    cells: dict[tuple[int, ...], float | None] = {}
    cache = last_level_cache_bytes(timer.device)
    with torch.inference_mode():
        for cell in grid.cells():
            shape = shape_of(**dict(zip(grid.names, cell)))
            num_tokens = sum(n for _, n in shape.requests)
            activations = 4 * num_tokens * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * dtype.itemsize
            copies = cold_copies(shape.kv_bytes(kv_dtype), cache, MAX_POOL_COPIES)
            if fits(timer.device, copies * shape.kv_bytes(kv_dtype) + activations):
                cells[cell] = _time_or_none(timer, functools.partial(attention_call, shape, dtype, kv_dtype, backend,
                                                                     timer.device, copies), use_graph)
    return Table.from_cells(grid.names, grid.values, cells)


def prefill_shape(head_dim: int, num_heads: int, batch: int, isl: int) -> AttentionShape:
    """batch prompts of isl new tokens each; KV heads = num_heads / 4 where that divides."""
    num_kv_heads = num_heads // 4 if num_heads % 4 == 0 else num_heads
    return AttentionShape(num_heads, num_kv_heads, head_dim, ((0, isl),) * batch)


def decode_shape(head_dim: int, num_kv_heads: int, batch: int, context: int) -> AttentionShape:
    """batch requests each decoding one token after context - 1 cached; 4 query heads per KV head."""
    return AttentionShape(4 * num_kv_heads, num_kv_heads, head_dim, ((context - 1, 1),) * batch)


def micro_layer_ops_ms(device: torch.device, dtype: torch.dtype, backend, context: int, timer: Timer) -> float:
    """What the operator tables time of one layer of host_timing's micro model decoding one request
    over `context` tokens: its four GEMMs and its attention, from the cache as the micro model (a few
    hundred KB) runs them. On a CPU, where one thread dispatches and computes, this is the part of an
    eager micro layer's time that the tables count too (their dispatch, at a real model's shapes)."""
    from shardserve.runtime.timing.host_timing import MICRO, MICRO_HEAD_DIM

    hidden, inter, head_dim = MICRO["hidden_size"], MICRO["intermediate_size"], MICRO_HEAD_DIM
    heads, kv_heads = MICRO["num_attention_heads"], MICRO["num_key_value_heads"]
    total = 0.0
    with torch.inference_mode():
        for n, k in (((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
                     (hidden, inter)):
            total += timer(_matmul([_linear(n, k, dtype, device, False)], 1, dtype))
        total += timer(attention_call(AttentionShape(heads, kv_heads, head_dim, ((context - 1, 1),)), dtype, dtype,
                                      backend, device))
    return total
